"""The options and entry points of ``gradsync simulate [train]``, ``calibrate`` and ``explain`` (argparse only).

``gradsync.cli`` registers them. Each entry point imports what it runs when it runs.
"""

from __future__ import annotations

import argparse

from gradsync.bench.spread import DEFAULT_REPEAT, add_repeat_option
from gradsync.sim import PROFILE_NAMES, SIMULATED


def add_parsers(commands) -> None:
    """Add the simulator's commands to the ``gradsync`` subcommand group ``commands``."""
    simulate = commands.add_parser(
        "simulate", help="predict AllReduce and training-step time on a modelled cluster (8-4096 GPUs)",
        description="Run gradsync's own AllReduce algorithms on a virtual clock over a hardware profile and "
                    "print an nccl-tests-style table (time, algbw, busbw) per GPU count, size and algorithm; "
                    "--validate checks the model against measurements here, --reproduce against published "
                    "nccl-tests curves.")
    _add_scale_options(simulate)
    kinds = simulate.add_subparsers(dest="simulate", required=False, parser_class=type(simulate))
    _add_train_options(kinds.add_parser(
        "train", help="predict step time and exposed communication of data-parallel training at scale",
        description="Predict the step time of data-parallel training from 8 to 4096 GPUs: the model's "
                    "compute per layer, DataParallel's real bucket assignment, each bucket's AllReduce "
                    "simulated per algorithm, bucket size and compressor, on a published profile."))
    calibrate = commands.add_parser(
        "calibrate", help="measure alpha, beta, gamma and the cores here and write a profile",
        description="Measure the link latency and bandwidth of point-to-point messages (loopback, shared "
                    "memory, and the shaped links of emulated hosts with --hosts), the time to add and copy "
                    "a byte and the usable cores, from micro-benchmarks, and write a profile JSON file.")
    _add_calibrate_options(calibrate)
    explain = commands.add_parser(
        "explain", help="the scaling claims with the simulator's numbers; with ALG, how it moves the data",
        description="Without ALG: print how a flat ring's small messages grow from 8 to 64 to 4096 GPUs, where "
                    "hierarchical and double_binary_tree overtake it, and a 10B-parameter model's communication "
                    "share on 4096 GPUs under each lever (buckets, overlap, hierarchical, fp16, PowerSGD, ZeRO), "
                    "computed by the simulator. With ALG: run it on simulated ranks and print each step's "
                    "segments, who sends them to whom, and the alpha-beta-gamma terms that add up to the "
                    "predicted time.")
    _add_explain_options(explain)


# -- gradsync simulate (the at-scale table; --validate; --reproduce) ------------------------------------
# The at-scale table's options and --validate's own, with their defaults: --reproduce uses none of them but
# --json (it prices the published curves' own systems and sizes), the table none of --validate's.
SCALE_OPTIONS = {"profile": "h100-ib", "gpus": "8,64,512,4096", "sizes": "4K-1G", "algorithms": None, "plot": None,
                 "event_budget_s": 60.0, "event_total_s": 120.0}
VALIDATE_OPTIONS = {"validate_sizes": "4K,64K,1M,16M,64M", "inter_host_gbit": 1.0, "no_hosts": False}


def _add_scale_options(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    add("--profile", default=SCALE_OPTIONS["profile"], help=f"a profile name ({', '.join(PROFILE_NAMES)}) or a "
        "profile file from `gradsync calibrate` (default %(default)s)")
    add("--gpus", default=SCALE_OPTIONS["gpus"], help="comma-separated GPU (rank) counts (default %(default)s)")
    add("--sizes", default=SCALE_OPTIONS["sizes"], help="message sizes: a list (4K,1M) or a range doubling by 4x "
        "from the first to the last (4K-1G) (default %(default)s)")
    add("--algorithms", default=None, help="comma-separated: ring, tree, double_binary_tree, halving_doubling, "
        "hierarchical, nccl (NCCL's own choice by its tuning model, for a profile with NCCL's constants) "
        "(default ring,double_binary_tree,hierarchical,nccl)")
    add("--plot", default=None, metavar="PNG", help="also draw time against GPU count per algorithm")
    add("--json", default=None, metavar="FILE", help="also write the rows as a JSON list")
    add("--event-budget-s", type=float, default=SCALE_OPTIONS["event_budget_s"], metavar="S", help="run the event "
        "simulation for a point only where its estimated wall time is at most S seconds, else the formula "
        "(default %(default)s)")
    add("--event-total-s", type=float, default=SCALE_OPTIONS["event_total_s"], metavar="S", help="estimated wall "
        "seconds of all event runs together, cheapest points first (default %(default)s)")
    add("--validate", action="store_true", help="calibrate here on points disjoint from the validated ones, "
        "then measure every simulated algorithm's all_reduce, reduce_scatter and all_gather (ws 2-4 on one host "
        "and 2x2 emulated hosts; native is not modelled) and print predicted against measured time with the "
        "error, each point's own spread and its verdict")
    add("--reproduce", action="store_true", help="compare predictions with published nccl-tests curves")
    add("--validate-sizes", default=VALIDATE_OPTIONS["validate_sizes"], help="--validate: message sizes of the "
        "measured sweep (default %(default)s)")
    add("--inter-host-gbit", type=float, default=VALIDATE_OPTIONS["inter_host_gbit"], help="--validate: the test "
        "hosts' link rate (Gbit/s, default %(default)s)")
    add("--no-hosts", action="store_true", help="--validate: one host only (no test hosts)")
    add_repeat_option(parser, what="--validate: repetitions of every measured point (the algorithms "
                      "interleaved at each size, as bench allreduce --repeat)")


def _given(args: argparse.Namespace, defaults: dict) -> list[str]:
    """The options of ``defaults`` given on the command line (a value other than the default), as --names."""
    return [f"--{name.replace('_', '-')}" for name, default in defaults.items()
            if getattr(args, name, default) != default]


def refuse_unused(args: argparse.Namespace) -> None:
    """Refuse, in one line, an option the chosen `gradsync simulate` command would silently ignore.

    Raises:
        ValueError: a table or --validate option with --reproduce; a --validate option without it.
    """
    if getattr(args, "simulate", None) == "train" or args.validate:
        return
    if args.reproduce:
        given = _given(args, {**SCALE_OPTIONS, **VALIDATE_OPTIONS})
        if given:
            raise ValueError(f"{given[0]} has no effect with --reproduce: it prices each published curve's own "
                             f"system, sizes and profile (only --json applies)")
        return
    given = _given(args, VALIDATE_OPTIONS)
    if given:
        raise ValueError(f"{given[0]}: only --validate uses it (the at-scale table is computed, not measured)")


def simulate(args: argparse.Namespace) -> int:
    if args.validate and getattr(args, "reproduce", False):
        raise ValueError("--validate and --reproduce are two commands: give one")
    refuse_unused(args)
    if not args.validate and args.repeat != DEFAULT_REPEAT:
        raise ValueError(f"--repeat {args.repeat}: only --validate repeats a measurement (the rest is computed)")
    if getattr(args, "simulate", None) == "train" and args.validate:
        from gradsync.bench.train_validation import run as run_train_validation
        return run_train_validation(args)
    if getattr(args, "simulate", None) == "train":
        from gradsync.bench.simulate_train import run as run_train
        return run_train(args)
    if args.validate:
        from gradsync.bench.sim_validation_run import run as run_validation
        return run_validation(args)
    if args.reproduce:
        from gradsync.bench.reproduce import run as run_reproduce
        return run_reproduce(args)
    from gradsync.bench.scale import run as run_scale
    return run_scale(args)


# -- gradsync simulate train ---------------------------------------------------------------------------
def _add_train_options(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    add("--profile", default=None, help="a profile name or file (default h100-ib; this-machine with --validate)")
    add("--gpus", default="8,64,512,4096", help="comma-separated GPU counts (default %(default)s)")
    add("--json", default=None, metavar="FILE", help="also write the rows as a JSON list")
    add("--model", default=None, help="one of gradsync.train.models (cnn, mlp, logreg); default cnn "
        "unless --params is given")
    add("--params", default=None, help="a parameter count (10B, 350M, ...) in --layers transformer blocks "
        "instead of --model")
    add("--layers", type=int, default=48, help="blocks of --params (default %(default)s)")
    add("--layer-ms", type=float, default=None, help="forward + backward ms per layer (with --params)")
    add("--tokens-per-gpu", default=None, help="tokens (samples for our models) per GPU per step, comma-"
        "separated: compute = 6*params*tokens / (peak FLOP/s * MFU)")
    add("--mfu", type=float, default=0.4, help="model FLOPs utilisation (default %(default)s)")
    add("--peak-tflops", type=float, default=None, help="peak dense TFLOP/s of one GPU (default: the "
        "profile's GPU datasheet, gradsync.sim.compute.PEAK_TFLOPS)")
    add("--algorithms", default=None, help="comma-separated AllReduce algorithms (default ring,tree,"
        "halving_doubling,hierarchical; ring,tree,halving_doubling,shm with --validate)")
    add("--bucket-mb", default="25", help="comma-separated DataParallel bucket_cap_mb values (default "
        "%(default)s)")
    add("--compression", default="none", help="comma-separated: none, fp16, bf16, onebit (default %(default)s)")
    add("--ranks-per-host", type=int, default=None, help="GPUs per host (default: the profile's)")
    add("--event-max-gpus", type=int, default=64, help="run the real algorithm code on simulated ranks up "
        "to this many GPUs, closed-form formulas beyond (default %(default)s)")
    add("--layout", choices=("rebuilt", "initial"), default="rebuilt", help="DataParallel's buckets after "
        "its rebuild on the first backward (ready order, a new bucket after a pause > 2 ms), or as built "
        "at construction, which set_layout keeps (default %(default)s)")
    add("--two-phase-events", action="store_true", help="run the compressors' all_to_all and all_gather "
        "on simulated ranks too (up to --event-max-gpus; default: their formula)")
    add("--bucket-view", action="store_true", help="gradient_as_bucket_view=True: no copies into and out "
        "of the buckets")
    add("--validate", action="store_true", help="predict the CNN's and MLP's step here (this-machine "
        "profile, compute timed on one process) and compare with a gradsync bench train run")
    add("--nproc", default="2,4", help="--validate: world sizes (default %(default)s)")
    add("--steps", type=int, default=30, help="--validate: timed CNN steps per measurement, MLP steps // 5 "
        "(default %(default)s)")
    add_repeat_option(parser, what="--validate: alternating rounds of the measured `gradsync bench train` run")


# -- gradsync calibrate --------------------------------------------------------------------------------
def _add_calibrate_options(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    add("--out", default=None, help="profile file to write (default profile.json; with --hosts the shipped "
        "test-hosts profile, src/gradsync/collectives/cost/data/test-hosts.json, which auto decides across "
        "hosts from)")
    add("--hosts", type=int, default=None, help="calibrate the emulated test hosts: H hosts (network "
        "namespaces, needs root); also measures the link between hosts")
    add("--nproc", type=int, default=2, help="ranks per test host with --hosts (default %(default)s)")
    add("--inter-host-gbit", type=float, default=None, help="shape each test host's link to this rate "
        "(Gbit/s, tc tbf), as `gradsync bench allreduce --hosts` does")
    add("--settings", choices=("full", "quick", "tiny"), default="full", help="how long the micro-benchmarks "
        "run: full (about a minute), quick (the one --validate uses), tiny (seconds; rough numbers)")
    add("--name", default=None, help="the profile's name (default: this-machine, or test-hosts with --hosts)")
    add("--json", default=None, metavar="FILE", help="also write the profile's figures (alpha, bandwidth, gamma, "
        "...) as a JSON list of rows")


def calibrate(args: argparse.Namespace) -> int:
    from gradsync.bench.calibrate import run as run_calibrate
    return run_calibrate(args)


# -- gradsync explain ----------------------------------------------------------------------------------
def _add_explain_options(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    add("algorithm", metavar="ALG", nargs="?", choices=SIMULATED, default=None,
        help=f"one of {', '.join(SIMULATED)} (none: the scaling claims)")
    add("--nproc", type=int, default=4, help="ranks (default %(default)s)")
    add("--hosts", type=int, default=1, help="hosts the ranks are spread over, in blocks (default %(default)s)")
    add("--size", default="1M", help="message bytes, e.g. 4096, 64K, 1M (default %(default)s)")
    add("--profile", default=None, help="a profile name or file (default this-machine with ALG, h100-ib "
        "without)")
    add("--segment-bytes", type=int, default=None, help="ring and tree pipelining unit (default: the "
        "algorithm's)")


def explain(args: argparse.Namespace) -> int:
    if args.algorithm is None:
        given = [f"--{name.replace('_', '-')}" for name, default in (("nproc", 4), ("hosts", 1), ("size", "1M"),
                                                                    ("segment_bytes", None))
                 if getattr(args, name) != default]
        if given:
            raise ValueError(f"{', '.join(given)}: options of one algorithm's run; give ALG (gradsync explain ring "
                             f"{' '.join(given)} ...), or none of them for the scaling claims")
        from gradsync.bench.claims import run as run_claims
        return run_claims(args)
    from gradsync.bench.explain import run as run_explain
    return run_explain(args)


ENTRY_POINTS = {"simulate": simulate, "calibrate": calibrate, "explain": explain}
