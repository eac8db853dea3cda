"""The prose of ``bench memory``: its table's notes, its section of docs/benchmarks.md (title, what it measures,
how to read it) and whether a DeepSpeed row can be measured here."""

TABLE_NOTES = [
    "# bytes: counted from the tensors each rank holds (parameters, gradients, optimizer state, communication "
    "buffers; a storage once) at the same points of one step, after a warm-up step, for every row: inside the pass "
    "at each block (the gpt's blocks, the mlp's Linear layers; FSDP2's units): fwd i, right after block i's forward "
    "(before any wrapper frees it); bwd-in i, as backward enters block i (after the wrappers gathered it); grads i, "
    "as each gradient of block i is accumulated, before the wrappers' own hooks copy or reduce it (the largest); "
    "then after forward, after backward and after the optimizer step; the point with the largest total (peak at) "
    "and its parts, for the rank with the largest; x none / x zero / x fsdp2: total bytes over shard=none's / "
    "torch-zero's / torch-fsdp2's",
    "# gradsync parameters (ZeRO-3): DataParallel(shard='parameters'), units by size (bucket cap 25 MB: one per gpt "
    "block; the root unit keeps the embeddings and final norm); param: its shards plus the units whole at the point "
    "(the root from its forward to the end of backward, a block while it runs, the next one prefetched); grad: its "
    "gradient shards (each unit's allocated when it is reduce-scattered, dropped by zero_grad) plus the .grad of a "
    "unit not yet copied into its slab; buffer: one slab of the largest unit",
    "# torch-fsdp2: PyTorch FSDP2, fully_shard on each gpt block (each mlp Linear), then on the root, defaults "
    "(reshard_after_forward; the root stays unsharded after forward), AdamW built after sharding, Gloo; param: "
    "its padded local shards plus the unsharded parameters alive at the point; grad: local shards plus the "
    "unsharded gradients of a unit not yet reduce-scattered; optim: local shards; buffer: what it holds between "
    "collectives (an all-gather output kept for the next copy-in, a reduce-scatter input); bucket cap and "
    "algorithm do not apply",
    "# RSS: peak resident set (getrusage ru_maxrss), max over ranks, of a fresh world per row; samples/s: median "
    "(min-max) of the repetitions, every setting timed once in each (not sampled); x none / x zero / x fsdp2: "
    "paired per repetition; check: parameters allclose (rtol 1e-5, atol 1e-6) to shard=none's after 3 float64 "
    "steps (ZeRO-3's gathered with full_parameters(), torch-fsdp2's with full_tensor, and its float32 reduced "
    "gradient of one step allclose to the ranks' mean gradient: FSDP2 reduces float32 with AVG and float64 with a "
    "divided SUM), else not timed"]

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
`none`, the baseline; `optimizer`, ZeRO-1; `gradients`, ZeRO-2;
`parameters`, ZeRO-3, its units chosen by size: one per gpt block at the
bucket cap of 25 MB, the embeddings and final norm in the root unit; all
with `--algorithm shm`, the fastest on one host: its AllReduce at `none`,
its reduce-scatter and all-gather at the others) and with torch's
`ZeroRedundancyOptimizer` (ZeRO-1, whole tensors per rank) over
`DistributedDataParallel` on Gloo, built as its documentation shows
(`parameters_as_bucket_view` and `overlap_with_ddp` off; DDP with the same
`bucket_cap_mb`), and PyTorch's FSDP2 (`torch-fsdp2`,
`torch.distributed.fsdp.fully_shard`, ZeRO-3-like: every parameter a
`DTensor` sharded on its first dimension), applied as its documentation
recommends for a transformer: `fully_shard` on each gpt block (on each of
the MLP's `Linear` layers), then on the root, over a 1-D CPU `DeviceMesh` of
the Gloo group, with its defaults (`reshard_after_forward=True`, which FSDP2
turns off for the root; no mixed precision or offload), the optimizer built
on the sharded parameters; `bucket_cap_mb` and `--algorithm` do not apply to
it. All with the same optimizer. `gpt` is a decoder-only transformer over
bytes, `gradsync train --model gpt` at the benches' size (width 512, depth
8, 8 heads, 128 bytes of context, ~25.4M parameters; 2 windows of its
corpus, Python's help texts, per rank), `mlp` the 1024-4096-4096-1024-10 MLP
of `bench train` (batch 64 per rank; its 4096x4096 layer holds two thirds of
the parameters, which is what a per-tensor partition like torch's cannot
split). Bytes: after a warm-up step, one step is sampled at the same points
for every row, inside the pass as well as between its phases
(`gradsync.bench.shard_memory_points`), at each block (the gpt's blocks, the
MLP's `Linear` layers: the modules FSDP2 wraps): `fwd i` right after block
i's forward, before any wrapper's hook frees it (a ZeRO-3 unit and the next
one, prefetched, are whole there); `bwd-in i` as backward enters block i
(a hook on the gradient of its output, after the wrappers' own, which gather
the unit and prefetch the one before); `grads i` as each of block i's
gradients is accumulated, before any other hook of that parameter (the
wrappers' reducers copy a gradient into a bucket and release it, ZeRO-3
frees a unit once its gradients are there), the largest of these: at the
block's last parameter all its gradients are alive beside the whole unit,
not yet reduce-scattered; then after forward, after backward and after the
optimizer step. At each point the tensors the rank holds are counted
(parameters, gradients, optimizer state, communication buffers; each
storage once, a view charged its whole storage: `gradsync.parallel.memory`),
the point with the largest total is the peak (`peak at`) and its parts are
shown, for the rank with the largest peak. The sampling only counts; the
byte run is separate from the timed one. torch's peer is counted the same
way from its parameters, their `.grad`, the local optimizer's state and
DDP's gradient buckets (their bytes from DDP's logging data,
`bucket_sizes`). gradsync's ZeRO-3 holds its parameter shards, the flat
buffers of the units whole at the point (their storage is freed otherwise),
its gradient shards (a unit's allocated when it is reduce-scattered, dropped
by `zero_grad`), the `.grad` of parameters not yet copied into the slab, and
one slab the size of its largest unit. FSDP2 is counted from the local
shards of its parameters (each padded to ceil(rows / world size) rows), the
unsharded parameters alive at the point (each unit's all-gather output
until it reshards), the local shards of the gradients (views of each unit's
reduce-scatter output), the unsharded gradients of a unit not yet
reduce-scattered, the local shards of AdamW's state, and the communication
buffers it keeps between collectives (an all-gather output kept for the next
copy-in, the reduce-scatter input). Peaks inside an operation (a
collective's temporary buffers, an all-gather before its copy-out) are not
sampled, for any row. `RSS MiB` is the peak resident set of each rank
(`getrusage` `ru_maxrss`), max over ranks, each row in a fresh world.
Activations, allocator slack and Python objects are in the RSS, not in the
counted bytes. A shared-memory segment (the shm arena that holds
`shard=none`'s zero-copy buckets) is charged by the bytes of it the rank's
tensors view, its own slot, not whole: every rank of the host maps all of
it, and it exists once. Samples/s: every setting first trains 3 identical
steps in float64 and its parameters are compared with the baseline's
(allclose, rtol 1e-5, atol 1e-6, every rank; `check`; ZeRO-3's gathered with
`full_parameters()`, FSDP2's with `full_tensor()`); one that differs is not
timed, and the run says so (in float32, AdamW turns the different summation
orders of a gradient that nearly cancels across ranks into parameter
differences of a few 1e-6 within 3 steps, above rtol 1e-5 of the gpt's
weights). FSDP2 picks its gradient reduction by dtype: a reduce-scatter with
`ReduceOp.AVG` in float32, a SUM between a pre- and a post-division in
float64; so it is also checked in float32, the dtype it is timed in: one
backward from the same weights, its reduced gradients gathered whole
against the mean of every rank's gradient of a plain copy (same tolerances;
`grads differ` when not). On this torch (2.13) both hold: it averages on
Gloo. Then each repetition times every setting once, interleaved, on a
fresh copy, without sampling; `x none`, `x zero` and `x fsdp2` divide by the
baseline and by torch's peers, paired per repetition for samples/s. The
goals (issues 38 and 39, gpt at world size 4 with AdamW) are judged under
the table, each with met or missed.""",
    "memory_after": """\
How to read it. With AdamW in float32 a replica holds 16 bytes a parameter
before buffers: 4 of parameters, 4 of gradients, 8 of optimizer state, and
`shard=none` adds its buckets, a second copy of the gradients. Sharding the
optimizer divides the 8 by the world size, and each rank then keeps only its
shard of the reduced gradients (the `.grad` of a parameter is released once
copied into its bucket), but the buckets stay whole. Sharding the gradients
replaces the buckets with two slabs used in turn, each as large as the
largest bucket, filled when a bucket is launched: inside backward the
`.grad` of a bucket not yet launched lives beside them (on the gpt, buckets
of 25 MiB); on the MLP, whose 4096x4096 layer is one 64 MiB bucket on its
own, the slabs hold more than the buckets they replace. torch's
`ZeroRedundancyOptimizer` assigns whole tensors to ranks, so the rank that
gets that layer holds its whole optimizer state at every world size, and it
keeps full gradients and DDP's buckets; gradsync cuts every bucket evenly.
ZeRO-3 and FSDP2 shard all three parts, 16 bytes a parameter over the world
size, and both peak inside backward: gradsync's with a block whole, the one
before it prefetched whole, the block's gradients before its reduce-scatter
and two unit-sized slabs; FSDP2's with a block whole, the next all-gather's
output, the block's unsharded gradients and its reduce-scatter input, and
the gradient shards of the blocks reduced so far (gradsync's gradient
shards are one persistent buffer). A record made before the
`parameters` and `torch-fsdp2` rows existed shows no such rows;
`gradsync bench memory` measures them by default. The RSS column counts
more than the tensors: every page of the shm arena a rank touched (its
peers' slots included), torch itself, the activations and the allocator's
free lists. A world of 1 runs 2 threads per rank and the others 1, as
`bench train`; on a machine shared with other programs, 2 threads that wait
for each other at every parallel region slow down most. On these 2 shared
cores a world of 4 runs its ranks in turn, so samples/s compares the
implementations' costs on the same cores rather than their scaling.

""" + DEEPSPEED_NOTE,
}

MEMORY_TITLES = {"memory": "Memory per rank: ZeRO-1, ZeRO-2 and ZeRO-3 against torch's ZeroRedundancyOptimizer "
                           "and FSDP2"}
