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
(`oversubscribed_*`) the same with four ranks on the two cores, two pairs
chaining at once; the call overhead of
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
then measure the AllReduce sweep with `gradsync bench allreduce`'s machinery
(the slowest rank's time per call, `verify=False`) at 2, 3 and 4 ranks on
one host and on 2 × 2 test hosts, `--repeat` times, each repetition one sweep
of every size and algorithm interleaved, and predict each row with the event
simulation of the algorithm's own code on the profile just calibrated.
`error` = (predicted − measured) / measured, within each repetition;
measured times and errors are the median (min–max) over the repetitions.
Goal: median |error| ≤ 10% over all rows and worst |error| ≤ 25% over rows
of 64 KiB and more, each figure taken within a repetition and met when its
median meets it. The second table sets, at each point, the algorithm `auto`'s
model predicts fastest against the one measured fastest: the pick's time over
the fastest's, within each repetition.""",
    "sim_validate_after": """\
How to read it. 3 and 4 ranks on 2 cores are oversubscribed: the model
slows a rank's adds, copies and loopback transfers by ranks / cores, and
small messages are mostly Python and wake-ups, whose cost on a loaded
machine moves from one repetition to the next (the load columns say how
busy it was); a wide min–max on a row is that noise, not the model. Across
the test hosts the shaped 1 Gbit/s link sets the large sizes.""",
    "sim_reproduce": """\
`gradsync simulate --reproduce`: the simulator on the published `h100-ib`
profile (datasheet bandwidths and NCCL's own tuning constants; no number
taken from the curves) against two published nccl-tests `all_reduce_perf`
curves, one node of 8 H100 with NVLink SHARP and 4 nodes × 8 over
InfiniBand: busbw as published and as predicted per size, the error, and
the candidate (algorithm/protocol, or NVLS) the prediction took as NCCL's
choice, the fastest of them. A computation, not a measurement: one run, the
same on any machine.""",
    "sim_reproduce_after": """\
How to read it. Up to 64 KiB the call is latency-bound (NCCL's per-call and
per-hop latencies decide), above it bandwidth-bound. The single-node
curve's large sizes ran NVLS (in-switch reduction), which gradsync has no
algorithm for and prices with a formula; the 4-node curve most likely ran
NVLSTree or Tree, which are not modelled, so its bandwidth region is the
least certain.""",
    "sim_scale": """\
`gradsync simulate` at scale: one AllReduce per GPU count, message size and
algorithm on the profile of the command (8 GPUs per host on the published
profiles), priced by the event simulation of the algorithms' own code where
its time budget allows, else by the closed form (marked `*`). One line per
GPU count and size with each algorithm's time and the fastest; below, where
the ring stops being the fastest and where each algorithm wins. A
computation, not a measurement: one run; `took` is the simulation's wall
time.""",
    "sim_scale_after": """\
How to read it. The flat ring takes 2(p−1) steps one after the other, so
its latency term grows with the GPU count and it keeps up only where the
bandwidth term dominates: the largest sizes on few GPUs. Halving-doubling,
in log2 p steps, takes the small sizes; across hosts the
hierarchical scheme (inside each host over NVLink, then across the hosts,
then inside again) sends over the network only what a host holds, which
decides the large sizes. A time marked `*` is the closed form, which agrees
with the event simulation within 5% where both run.""",
}
SIM_TITLES = {"sim_calibrate": "Simulator: calibration of this machine",
              "sim_validate": "Simulator: predicted against measured here",
              "sim_reproduce": "Simulator: predicted against published nccl-tests curves",
              "sim_scale": "Simulator: AllReduce from 8 to 4096 GPUs"}
