"""The prose of ``bench memory``'s section of docs/benchmarks.md: its title, what it measures, how to read it,
and whether a DeepSpeed row can be measured here."""

DEEPSPEED_NOTE = """\
DeepSpeed: no row yet, though one is possible here. DeepSpeed's CPU path
was said to need oneCCL (`oneccl_bindings_for_pytorch`), and that is not on
this machine's package index (`pip index versions oneccl_bind_pt` finds
nothing); but DeepSpeed 0.19.8 (its sdist downloads; `pip install` with
`DS_BUILD_OPS=0` and its pure-Python dependencies) falls back to Gloo when
oneCCL is absent (`accelerator/cpu_accelerator.py`), and ZeRO stages 1 and
2 then train a small model over Gloo with 2 CPU processes and
`torch.optim.AdamW` as the client optimizer (JIT-building its shared-memory
communication op with ninja on first use). The row needs DeepSpeed as an
optional extra and a counter for its flat fp32 partitions and gradient
buckets; it is not measured yet."""

MEMORY_ABOUT = {
    "memory": """\
What each rank holds at every sharding level of `DataParallel` (`shard=`
`none`, the baseline; `optimizer`, ZeRO-1; `gradients`, ZeRO-2; all with
`--algorithm shm`, the fastest on one host: its AllReduce at `none`, its
reduce-scatter and all-gather at the others) and with
torch's `ZeroRedundancyOptimizer` (ZeRO-1, whole tensors per rank) over
`DistributedDataParallel` on Gloo, built as its documentation shows
(`parameters_as_bucket_view` and `overlap_with_ddp` off; DDP with the same
`bucket_cap_mb`), all with the same optimizer. `gpt` is a decoder-only
transformer over bytes, `gradsync train --model gpt` at the benches' size
(width 512, depth 8, 8 heads, 128 bytes of context, ~25.4M parameters; 2
windows of its corpus, Python's help texts, per rank), `mlp` the 1024-4096-4096-1024-10 MLP of
`bench train` (batch 64 per rank; its 4096x4096 layer holds two thirds of
the parameters, which is what a per-tensor partition like torch's cannot
split). Bytes: after a warm-up step, one step is sampled after forward,
after backward and after the optimizer step; at each point the tensors the
rank holds are counted (parameters, gradients, optimizer state,
communication buffers; each storage once, a view charged its whole storage:
`gradsync.parallel.memory`), the point with the largest total is the peak
(`peak at`) and its parts are shown, for the rank with the largest peak.
torch's peer is counted the same way from its parameters, their `.grad`,
the local optimizer's state and DDP's gradient buckets (their bytes from
DDP's logging data, `bucket_sizes`). `RSS MiB` is the peak resident set of
each rank (`getrusage` `ru_maxrss`), max over ranks, each row in a fresh
world. Activations, allocator slack and Python objects are in the RSS, not
in the counted bytes. A shared-memory segment (the shm arena that holds
`shard=none`'s zero-copy buckets) is charged by the bytes of it the rank's
tensors view, its own slot, not whole: every rank of the host maps all of
it, and it exists once. Samples/s: every setting first trains 3 identical
steps in float64 and its parameters are compared with the baseline's
(allclose, rtol 1e-5, atol 1e-6, every rank; `check`); one that differs is
not timed (in float32, AdamW turns the different summation orders of a
gradient that nearly cancels across ranks into parameter differences of a
few 1e-6 within 3 steps, above rtol 1e-5 of the gpt's weights). Then
each repetition times every setting once, interleaved, on a fresh copy;
`x none` and `x zero` divide by the baseline and by torch's peer, paired per
repetition for samples/s. The goals (issue 38, gpt at world size 4 with
AdamW) are judged under the table, each with met or missed.""",
    "memory_after": """\
How to read it. With AdamW in float32 a replica holds 16 bytes a parameter
before buffers: 4 of parameters, 4 of gradients, 8 of optimizer state, and
`shard=none` adds its buckets, a second copy of the gradients. Sharding the
optimizer divides the 8 by the world size, and each rank then keeps only
its shard of the reduced gradients (the `.grad` of a parameter is released
once copied into its bucket), but the buckets stay whole. Sharding the
gradients replaces the buckets with two slabs used in turn, each as large
as the largest bucket: on the gpt (buckets of 25 MiB) that is the second
large saving; on the MLP, whose 4096x4096 layer is one 64 MiB bucket on its
own, the two slabs hold more than the buckets they replace. torch's
`ZeroRedundancyOptimizer` assigns whole tensors to ranks, so the rank that
gets that layer holds its whole optimizer state at every world size, and it
keeps full gradients and DDP's buckets; gradsync cuts every bucket evenly.
The RSS column counts more than the tensors: every page of the shm arena a
rank touched (its peers' slots included), torch itself, the activations
and the allocator's free lists. A world of 1 runs 2 threads per rank and
the others 1, as `bench train`; on a machine shared with other programs, 2
threads that wait for each other at every parallel region slow down most.
On these 2 shared cores a world of 4 runs its ranks in turn, so samples/s
compares the implementations' costs on the same cores rather than their
scaling.

""" + DEEPSPEED_NOTE,
}

MEMORY_TITLES = {"memory": "Memory per rank: ZeRO-1 and ZeRO-2 against torch's ZeroRedundancyOptimizer"}
