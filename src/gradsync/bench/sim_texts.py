"""The prose of the simulator's records (docs/benchmarks.md and the generated section of docs/simulator.md):
each one's title, what it measures and how to read it."""

SIM_ABOUT = {
    "sim_calibrate": """\
`gradsync calibrate` (full settings) on this machine: two processes, Gloo
over loopback TCP (then four, for the crowded hop). Every figure of the
profile the simulator prices this machine with comes from a micro-benchmark
at sizes `gradsync simulate --validate` never scores (4 KiB, 64 KiB, 1 MiB,
16 MiB and 64 MiB; `calibration_points()` lists every point): α from
ping-pongs of 4 B, 256 B and 2 KiB; the link bandwidth from the slope of the
one-way time over 2, 4, 8 and 12 MiB; the hop inside a schedule
(`hop_alpha_s`) from chains of 1, 2, 4 and 8 dependent 256 B exchanges (a
ring step's receive, send and two waits), the slope per hop in each of 15
batches; the one-way hop (`one_way_hop_alpha_s`, a tree's edge) the same of
relays of as many one-way messages, in the same batches; the crowded hops
(`oversubscribed_*`) the same with four ranks on the two cores in a ring
(ring steps; a relay around it); the call overhead of
each algorithm (`call_overheads_s`) from 256 B `all_reduce` calls of ring,
tree, halving_doubling and hierarchical (shm: 96 KiB, past its lean path; its
lean path: 4 B) in the same batches as the chains, less their simulated cost
with that batch's hop; γ and the copy cost from float32 `add_` and `copy_`
over 48 MiB (out of cache); the shared-memory terms from barriers and
pipelined cells. Each figure is the median of the calibration's own batches,
so the record is one run.""",
    "sim_calibrate_after": """\
How to read it. α, the hop and the call overheads are Python and the wake-up
of a thread on a shared core, not wire latency: a hop inside a schedule costs
several ping-pong α here, and both drift with the machine's load (the fixed
costs are measured side by side for that reason); the loopback bandwidth is a
kernel copy on a core (`cpu bound`: a rank's sends and receives share it).
`gradsync simulate --profile FILE` takes such a profile; the `this-machine`
profile that `auto` uses on one host, and `test-hosts` (`gradsync calibrate
--hosts 2 --nproc 2 --inter-host-gbit 1`, which writes the shipped file), were
written by this command on an earlier day, and `gradsync simulate --validate`
calibrates anew each time.""",
    "sim_validate": """\
`gradsync simulate --validate`: calibrate this machine (and 2 test hosts × 2
ranks with links shaped to 1 Gbit/s, where network namespaces can be made),
then measure with `gradsync bench allreduce`'s machinery (the slowest rank's
time per call, `verify=False`) at 2, 3 and 4 ranks on one host and on 2 × 2
test hosts, as `gradsync bench allreduce --collective C --repeat R` does
(at every size one warm-up call of each algorithm, then R repetitions with
the algorithms' order rotated), and predict each row with the event
simulation of the algorithm's own code on the profile just calibrated. The
rows: every algorithm the simulator runs, for the AllReduce and for the
reduce-scatter and all-gather it runs (ring and halving-doubling; not the
trees, which carry neither, nor shm's own, which the simulator prices for
the AllReduce only). `native` is not modelled: it hands the call to the
backend (Gloo, NCCL), whose calls the simulator's transport refuses, so it
has no rows. The first table is the split: the points the calibration
measures (from `gradsync.bench.calibrate.calibration_points`) and the points
predicted; the run refuses to start when they share one, so no row is scored
on a point its profile was fitted to. `error` = (predicted − measured) /
measured, within each repetition; measured times and errors are the median
(min–max) over the repetitions; `spread` = (max − min) / median of the
measured times, the machine's own noise at that point. A row passes when
|median error| ≤ max(25%, spread) from 64 KiB up and ≤ max(40%, spread)
below (`bound`). Goals: median |error| ≤ 10% over all rows and no row
failing its bound; the breakdown gives both per layout and per collective.
The last table sets, at each AllReduce point, the algorithm `auto`'s model
predicts fastest against the one measured fastest: the pick's time over the
fastest's, within each repetition.""",
    "sim_validate_after": """\
How to read it. 3 and 4 ranks on 2 cores are oversubscribed: the model
slows a rank's adds, copies and loopback transfers by ranks / cores, and
small messages are mostly Python and wake-ups, whose cost on a loaded
machine moves from one repetition to the next (the load columns say how
busy it was); a wide spread widens that row's bound, so a pass there says
the model is within the machine's own noise, not that it is right to the
bound. Across the test hosts the shaped 1 Gbit/s link sets the large sizes.
A record from before the split was kept shows AllReduce rows only and no
split table; its spreads come from its recorded repetitions.""",
    "sim_reproduce": """\
`gradsync simulate --reproduce`: NCCL's own choice against three published
nccl-tests `all_reduce_perf` curves: one node of 8 H100 with NVLink SHARP,
4 nodes x 8 H100 over InfiniBand, one node of 8 A100. The pick is NCCL's
own (`collectives/cost/nccl_tuning.py`, written from NCCL 2.24.3's topology
search and tuning.cc: channels, algorithm x protocol bandwidths and
latencies, the pair with the least time by NCCL's model); its time is
NCCL's model plus the pipeline fill that model leaves out
(`collectives/cost/nccl_pipeline.py`: the first loop's stages of NVLS and
NVLSTree, loops sized by enqueue.cc's chunk rules), on the published GPU
profiles (datasheet hardware and NCCL's tables; no number taken from the
curves). Per size: busbw as published and as predicted, the error, and
NCCL's pick (algorithm/protocol/channels); per curve the issue's goal
(every size from 4 KiB within 20%, from 64 MiB within 10%), met or missed,
and where missed NCCL's latency and bandwidth against the curve's. A
computation, not a measurement: one run, the same on any machine.""",
    "sim_reproduce_after": """\
How to read it. NCCL's model prices a call as latency + bytes / bandwidth,
the steady state of a pipeline. NVLS and NVLSTree run in loops of 16
channels x 8 heads x a chunk of 16-128 KiB, each loop passing through
scatter, reduce and multicast (with NVLSTree a network hop per tree level
up and down) and gather; the first loop's stages before the last are added
as the fill (8-65 us on one node, 30-120 us on 4 nodes). The single-node
H100 curve ran one thread driving 8 GPUs (`-g 8`): nccl-tests issues its
iterations back to back, so a row takes the longer of the thread's issue
time, 33.7 us (another published run, nccl-tests#123, not the curves), and
the call. Where a goal is missed, one line per pick sets NCCL's latency and
bandwidth against those the curve's points imply (a least-squares line, a
diagnosis only): on one node the NVLS calls of 8-32 MiB take 12-33 us more
than NCCL's 25 us latency, the bandwidth and the fill (16 MiB +20.8%); across
nodes the tree/LL latency is 17 us short (no per-hop network cost beyond
NCCL's 5 us is modelled), the curve dips at 256 MiB (+15.5%) and the ring's
bandwidth is 8% high; the A100 log (only 32 MiB to 1 GiB) misses by 11.1% at
128 MiB, where its own curve dips below 64 MiB. The 4-node log does not say
which algorithm ran.""",
    "sim_scale": """\
`gradsync simulate` at scale: one AllReduce per GPU count, message size and
algorithm on the profile of the command (8 GPUs per host on the published
profiles), priced by the event simulation of the algorithms' own code where
its time budget allows, else by the closed form (marked `*`); the `nccl`
column is not gradsync code but the algorithm and protocol NCCL's own
tuning model picks for that call, at the time that model predicts (`nccl
pick`). One line per GPU count and size with each algorithm's time and the
fastest; below, where the ring stops being the fastest of gradsync's
algorithms and where each one wins. A computation, not a measurement: one
run; `took` is the simulation's wall time.""",
    "sim_scale_after": """\
How to read it. The flat ring takes 2(p−1) steps one after the other, so
its latency term grows with the GPU count and it keeps up only where the
bandwidth term dominates: the largest sizes on few GPUs. The double binary
tree, in about 2·log2 p steps with every rank sending about n per phase,
takes the small sizes on one node; across hosts the hierarchical scheme
(inside each host over NVLink, then across the hosts, then inside again)
sends over the network only what a host holds. `gradsync explain` prints
the crossovers and what they mean for a 10B-parameter model's step. A time
marked `*` is the closed form, which agrees with the event simulation
within 5% where both run (the double binary tree's within 8%).""",
}
SIM_TITLES = {"sim_calibrate": "Simulator: calibration of this machine",
              "sim_validate": "Simulator: predicted against measured here",
              "sim_reproduce": "Simulator: predicted against published nccl-tests curves",
              "sim_scale": "Simulator: AllReduce from 8 to 4096 GPUs"}
