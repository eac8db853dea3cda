"""The words of ``bench preflight``'s and ``bench fit``'s sections in docs/benchmarks.md: what they measure, how to read them."""

from __future__ import annotations

PREFLIGHT_ABOUT = {
    "preflight": """\
The memory preflight of `gradsync train` (issue 39) against what the run
then took: one `gradsync train --epochs 1` process tree per model and
`--shard` level (2 ranks; the gpt at width 256 and depth 4, 3.3M
parameters, batch 32 windows of 64 bytes per rank; MNIST-1D's CNN and MLP
on 4000 samples, batch 32), each repetition running every case once.
`estimate` is one rank's, computed before step 1 (`gradsync.preflight`:
parameters, gradients, optimizer state, buffers, and the activations of one
measured micro-batch and of the rank's piece of the test split, with what
the allocator kept beyond their tensors); `measured` the largest rank's
peak above its baseline (peak resident set less the shared-memory pages
beyond its share and less file-backed pages; in a cgroup of its own, its
peak usage), both from `summary.json`. `error %` is (estimate - measured) /
measured, each cell the median with the min-max over the repetitions; the
goal (within 15% on the gpt at every level) is judged on the median of its
size ([sharding.md](sharding.md#memory-preflight)).""",
    "preflight_after": """\
How to read it. On the gpt the largest pass is the evaluation: each rank
scores its half of the test split (364 windows) in one forward, about 230
MiB of tensors against 143 for a training micro-batch, and glibc's heap
holds some 140 MiB more than those tensors while it runs (freed blocks stay
in the heap, and once a freed chunk was mmapped its dynamic threshold sends
that size to the heap, where a block freed between two live ones cannot be
given back). The parameters, gradients and AdamW's moments are 50 MiB. So
`gradsync train` gives the heap back to the kernel (`malloc_trim`) before
each evaluation and before each pass the preflight measures, and the
estimate adds what the allocator held beyond the tensors during its own
measured passes. What still moves is that allocator part: measured on rank
0's one evaluation pass, it varies by up to 70 MiB from run to run (the
spread of the estimate), against some 15 MiB for the measured peaks. The
CNN and the MLP hold a few MiB: Python objects and small allocations, which
the estimate does not count, weigh as much as their tensors there (the
error is 0.3 to 3 MiB).""",
}

PREFLIGHT_TITLES = {"preflight": "Memory preflight: the estimate against the measured peak"}

FIT_ABOUT = {
    "fit": """\
The model that does not fit one replica, trained (issue 39): `gradsync
bench fit` runs `gradsync train --model gpt` (width 256, depth 8, 8 heads,
64 bytes of context: 6.3M parameters; AdamW; one epoch of its corpus at a
global batch of 32) at 4 ranks: `--shard none` without a limit (the
reference, run `--reference-runs` times: once first, the others last),
`--shard none --memory-limit-mib M` (each rank in a child memory cgroup
the kernel enforces, at a limit below what one unsharded replica needs),
and `--shard parameters` under the same limit. The preflight must refuse
the second before step 1, in one line naming what would fit, and the
third must end within 2% of the reference's final test loss (the median
over its runs) after the same steps. `estimate MiB` and `peak MiB` are
the preflight's per-rank estimate and the measured peak from summary.json
(under the limit: the rank's cgroup's peak usage). Results, not times,
are compared.
""",
    "fit_after": """How to read it. The unsharded run is refused before step 1 because
the estimate counts, beside the rank's own tensors, buffers, measured
passes and heap, what its cgroup is charged for the pages it shares with
the forkserver it was forked from and writes (copy-on-write copies of
torch's imported modules, ~80 MiB here, measured on rank 0 after its
passes): the kernel holds those to the limit too. Without that part the
estimate ran ~20% under the cgroup's count and the unsharded run was
killed by the kernel after three minutes instead. On this model the
evaluation's forward, not the model states, is the largest part. ZeRO-3
trains under the same limit, and its final test loss is the same in
every run: its sums are laid out once, unit by unit. The unsharded
reference's loss varies from run to run, because its buckets are rebuilt
where backward paused (which the machine's load moves) and one epoch of
AdamW on this gpt amplifies the different roundings; hence the median of
several reference runs, with their span printed beside the goal.
""",
}

FIT_TITLES = {"fit": "The model that does not fit: refused unsharded, trained with ZeRO-3 under a memory limit"}
