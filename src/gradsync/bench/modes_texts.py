"""The words of ``bench modes``' sections in docs/benchmarks.md (sync, async, local SGD, DiLoCo; where compute dominates)."""

from __future__ import annotations

MODES_ABOUT = {
    "modes": """\
The main job (MNIST-1D CNN, AdamW lr 1e-2 cosine) in sync mode, async mode
(parameter server, one more process) per staleness bound (`s<=S`; `lr/s`
divides the lr by the staleness), and local SGD per H, each without and with
worker rank 1 slowed down (`straggler`). Every setting trains once in each of
`--repeat` repetitions, the whole runs alternating, repetition k with seed k
(5 repetitions of 15 epochs by default; `make bench` runs 3 of 5 epochs to
stay affordable). `vs sync` is samples/s over sync's with the same straggler
in the same repetition, `t vs sync` the seconds to the target over sync's
(below 1: sooner); every cell shows the median over the repetitions and, in
brackets, their min–max. `s to 85%` is the wall time at the first evaluation
at or above the target accuracy, over the repetitions that reached it (`in
2/3` when not all did); staleness is 0 for sync, the server versions a
gradient missed for async, and the local steps since the last average for
local SGD (`stale mean` the median, `stale max` the largest). The plot shows
the first repetition.

DiLoCo rows (`--diloco H[:COMPRESSION[:F]]`) are local SGD with DiLoCo's outer
Nesterov step (`outer`) on the averaged pseudo-gradient every H steps, the
outer deltas sent as `delta` (fp32, or bf16/fp16/int8 with error feedback),
F fragments (Streaming DiLoCo); `torchft diloco` is torchft's own `DiLoCo`
(its Lighthouse and Managers, on Gloo) training the same model, samples and
schedule at the same H and outer optimizer, evaluated once at the end.
`MB/rank` is what each worker sent to keep the replicas in sync, one
definition for every row: each AllReduce of n payload bytes (encoded, as
sent) counts 2(p-1)/p·n (a ring's volume, whatever algorithm ran), a
parameter-server push n; `bytes ÷ sync` is sync's bytes over the row's. The
`goal` lines judge DiLoCo's goals on paired repetitions.""",
    "modes_after": """\
How to read it. With a straggler, fast async workers take the straggler's
share of the batches while sync and local SGD wait for it (local SGD only at
each average). Async runs are not deterministic (arrival order); plain
Downpour async (no bound, full lr) is fragile with AdamW at this lr and may
stay near chance. When compute is a small part of a sync step, as on these
shared cores, a compute straggler slows sync less than its factor, and its
sleep frees a core for the others.""",
    "modes_compute": """\
The same comparison where compute dominates a step: the MNIST-1D CNN at a
larger batch per worker (`--batch-size`, more MNIST-1D samples so that every
epoch still has tens of steps) with 2 workers, one core each, so that a
sleeping straggler does not hand its core to the other workers (with 4
workers on these 2 cores it does, and sync then slows far less than the
factor). Columns as in the table above. The `# goal` lines judge issue 40's
goals from the medians: async at least 1.5× and DiLoCo (local SGD with the
outer Nesterov optimizer; plain local SGD where the table has no DiLoCo row)
at least 2× sync's samples/s under the straggler, each ending within 1 pp of
sync's final accuracy, and async at least 0.9× sync without a straggler; the
first line says how much the straggler slows sync here.""",
    "modes_compute_after": """\
How to read it. The parameter server moves pushes and parameters through
shared memory on one host (its `summary.json` says `ps_link`), so an
exchange costs a copy and a wake-up, not four TCP messages. A synchronous
round, sync's every step or local SGD's every H steps, waits for the
straggler: local SGD saves only the communication of the steps between
averages, which is what a compute-dominated step does not spend, so under a
straggler it stays near sync's samples/s; async lets the fast worker take
the straggler's share of the batches. On a loaded machine every process
also waits for a core, which makes even the runs without a straggler
uneven: async does not wait for the slowest worker of each step and sync
does.""",
}

MODES_TITLES = {"modes": "Sync, async and local SGD",
                "modes_compute": "Sync, async and local SGD where compute dominates a step"}
