"""Benchmark results kept in the repository: ``make bench`` records them, ``gradsync bench report`` renders them.

Two steps, so that no number in ``docs/benchmarks.md`` is ever typed by hand:

* record (``python -m gradsync.bench.report record NAME [OPTIONS...]``, what
  ``make bench`` runs once per benchmark): runs ``gradsync bench NAME
  OPTIONS --json FILE`` in this process and writes ``docs/bench/NAME.json``:
  the rows the benchmark wrote, wrapped with when, where and how they were
  measured (date, machine, load average before and after, the command and
  every option, gradsync, torch and Python versions, seconds taken).
* render (``gradsync bench report``): reads those files and writes
  ``docs/benchmarks.md``, each benchmark's tables formatted by the
  benchmark's own ``format_*`` functions (the tables it prints), a table of
  its metadata, and text that explains how to read the table but quotes no
  measured number. Rendering depends on the JSON files only, so a test can
  check that the committed page equals the rendering of the committed JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

BENCHES = ("allreduce", "train", "compression", "modes", "faults")
DEFAULT_BENCH_DIR = "docs/bench"
DEFAULT_OUT = "docs/benchmarks.md"
FORMAT_VERSION = 1
_WITH_OUT = ("compression", "modes", "faults")   # benches whose run folders go to --out
_PLOTS = {"compression": "compression_accuracy.png", "modes": "modes_accuracy.png"}  # written into --out
_DROPPED_KEYS = ("run_folder",)   # paths of run folders that are deleted after recording


# ---------------------------------------------------------------- record


def machine() -> dict:
    """Platform, CPU model, core counts and memory of this machine (Linux /proc where available)."""
    cpu_model = platform.processor() or None
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as file:
            cpu_model = next((line.split(":", 1)[1].strip() for line in file if line.startswith("model name")),
                             cpu_model)
    except OSError:
        pass
    memory_gib = None
    try:
        with open("/proc/meminfo", encoding="utf-8") as file:
            kib = next(int(line.split()[1]) for line in file if line.startswith("MemTotal:"))
        memory_gib = round(kib / 2**20, 1)
    except (OSError, StopIteration, ValueError):
        pass
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {"platform": platform.platform(), "machine": platform.machine(), "cpu_model": cpu_model,
            "cpu_count": os.cpu_count(), "usable_cpus": usable, "memory_gib": memory_gib}


def _load() -> list[float] | None:
    try:
        return [round(value, 2) for value in os.getloadavg()]
    except OSError:
        return None


def _git_commit() -> str | None:
    try:
        result = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=10,
                                cwd=Path(__file__).parent)
    except (OSError, subprocess.SubprocessError):
        return None
    if result.returncode != 0 or not result.stdout.strip():
        return None
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                           text=True, timeout=10, cwd=Path(__file__).parent).stdout.strip()
    return result.stdout.strip() + ("-dirty" if dirty else "")


def versions() -> dict:
    import torch

    import gradsync

    return {"gradsync": gradsync.__version__, "torch": torch.__version__, "python": platform.python_version(),
            "git_commit": _git_commit()}


def record(name: str, bench_args: list[str], bench_dir: str | Path = DEFAULT_BENCH_DIR) -> Path:
    """Run ``gradsync bench NAME *bench_args`` and write ``bench_dir/NAME.json`` (rows + metadata).

    Plots the benchmark writes (compression, modes) are copied beside the JSON.

    Raises:
        ValueError: unknown bench, or ``--json`` / ``--out`` among the options (record chooses them).
        RuntimeError: the benchmark exited with an error (nothing is written).
    """
    from gradsync.cli import build_parser, main

    if name not in BENCHES:
        raise ValueError(f"unknown bench {name!r}; choose from {', '.join(BENCHES)}")
    for option in ("--json", "--out"):
        if any(arg == option or arg.startswith(option + "=") for arg in bench_args):
            raise ValueError(f"{option} is chosen by record; leave it out of the options")
    parsed = vars(build_parser().parse_args(["bench", name, *bench_args]))
    options = {key: value for key, value in parsed.items() if key not in ("command", "bench", "json", "out")}
    bench_dir = Path(bench_dir)
    bench_dir.mkdir(parents=True, exist_ok=True)
    where, what = machine(), versions()  # before the run: the code that ran
    with tempfile.TemporaryDirectory(prefix=f"gradsync-bench-{name}-") as scratch:
        json_path = Path(scratch) / "rows.json"
        extra = ["--json", str(json_path)] + (["--out", str(Path(scratch) / "out")] if name in _WITH_OUT else [])
        date = datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
        load_before, started = _load(), time.perf_counter()
        code = main(["bench", name, *bench_args, *extra])
        duration_s, load_after = time.perf_counter() - started, _load()
        if code != 0:
            raise RuntimeError(f"gradsync bench {name} exited with code {code}; {bench_dir / name}.json not written")
        rows = json.loads(json_path.read_text())
        plot = _PLOTS.get(name)
        if plot and (Path(scratch) / "out" / plot).exists():
            shutil.copyfile(Path(scratch) / "out" / plot, bench_dir / plot)
    rows = [{key: value for key, value in row.items() if key not in _DROPPED_KEYS} for row in rows]
    document = {"format": FORMAT_VERSION, "bench": name,
                "command": shlex.join(["gradsync", "bench", name, *bench_args]), "options": options,
                "date": date, "duration_s": round(duration_s, 1), "load_before": load_before,
                "load_after": load_after, "machine": where, "versions": what, "rows": rows}
    path = bench_dir / f"{name}.json"
    path.write_text(json.dumps(document, indent=2) + "\n", encoding="utf-8")
    print(f"# wrote {path} ({duration_s:.0f} s)", flush=True)
    return path


# ---------------------------------------------------------------- render

_INTRO = """\
# Benchmarks

<!-- Generated by `gradsync bench report` from docs/bench/*.json. Do not edit: run `make bench`. -->

This page is generated. `make bench` runs every benchmark once and writes its
rows to `docs/bench/<name>.json` together with the date, the machine, the load
average before and after, the exact command and options, and the gradsync and
torch versions; `gradsync bench report` renders this page from those files
(tests/test_docs.py checks that the two agree). To refresh it, run `make bench`
on an otherwise idle machine if you can, and commit `docs/bench/` and this page
together. After changing only a table's formatting, `gradsync bench report`
re-renders the page without running anything.

The numbers come from one run on a small shared machine: the load columns say
how busy it was, and runs move by tens of percent from one to the next.
Compare ratios within one table (every benchmark interleaves or alternates the
things it compares so they see the same noise), not absolute times across
tables or machines.

`make bench` uses smaller options than the benchmarks' defaults so that the
whole set fits in about a quarter of an hour on 2 cores; the defaults take
about twice as long, most of it in the compression and modes benchmarks,
which train the full 15-epoch main job once per setting (`make bench` trains
fewer epochs, so their accuracies are below the main job's). Each section
shows the command it ran and how long it took; run a benchmark with its
defaults (`gradsync bench compression`, ...) for the full-length measurement.
"""

_ABOUT = {
    "allreduce": """\
An nccl-tests-style sweep: every algorithm at every message size across local
processes (Gloo over loopback TCP, float32, one thread per rank), interleaved
with the backend's native `all_reduce` inside every repetition. Columns: the
median time per call of the slowest rank; algbw = bytes / time and busbw =
algbw · 2(p−1)/p (the nccl-tests definitions); `vs native` = native time /
time (above 1: faster than Gloo's own call); `sent/size` = payload bytes this
rank sent per call over the message size (`native` is the backend's own call,
whose traffic gradsync cannot count). `shm_zero_copy` is `shm` on data that
already lies in the shared arena, as `DataParallel`'s zero-copy buckets do.
`hierarchical` runs on pretend nodes (`--ranks-per-node`, 2 by default at an
even world size of 4 or more). With `pip install -e '.[mpi]'` an `mpi` column
(MPI_Allreduce in the same processes) is added.""",
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
    "train": """\
gradsync `DataParallel` (one row per algorithm), torch
`DistributedDataParallel` (Gloo, the same 25 MiB buckets) and a compute-only
baseline train each model on the same initial weights, fixed random batches,
world size and thread count, alternating in every round; samples/s is the
median over rounds. `cnn` is the MNIST-1D CNN of `gradsync train` (batch 128
per rank), `mlp` a 1024-4096-4096-1024-10 MLP (~25.2M parameters, batch 64 per
rank). `comm_ms/step` is gradsync's AllReduce time (overlapped or not),
`exposed_ms/step` the part backward waited for, `step overhead %` = 1 −
compute-only step / step (comparable across implementations; DDP does not
report its communication time, so its comm columns are empty). The second
table is the peak resident memory per rank with `gradient_as_bucket_view` off
and on, each in a fresh world of 2.""",
    "train_after": """\
How to read it. On the MLP most gradient bytes (the 4096×4096 layer and the
first layer) become ready at the very end of backward, so much of the
communication is exposed whatever the engine; only a faster transport or
compression shrinks it. On the small CNN a step is a few milliseconds of
compute and one small AllReduce, so per-call overhead decides: `native`
and `shm` pay one call, `ring` pays Python-driven point-to-point hops through
Gloo.""",
    "compression": """\
Two parts. Accuracy: the main job (MNIST-1D CNN, AdamW lr 1e-2 cosine) once
per compressor, each after the exact warm-up steps shown in the command
(1-bit Adam's warm-up stage); `bytes/step` is the median over steps of the
bytes rank 0's transport sent (the compressed steady state), `mean bytes/step`
includes the warm-up. Throughput: every compressor on the ~25M-parameter MLP
of `bench train`, alternating over rounds. `break-even Gb/s` is the link speed
under which the bytes saved would pay for the compressor's extra work per step
(communication not hidden by compute).""",
    "compression_after": """\
How to read it. On one machine "the network" is a memory copy, so the work of
compressing usually costs more than the bytes it saves; the break-even
column says on which links it would pay off. On the
small CNN, OneBit saves a little less than its nominal 28.4× because each chunk
carries a reference scale and the unused-parameter flags travel exactly, a
constant that large buckets amortise.""",
    "modes": """\
The main job (MNIST-1D CNN, AdamW lr 1e-2 cosine) in sync mode, async mode
(parameter server, one more process) per staleness bound (`s<=S`; `lr/s`
divides the lr by the staleness), and local SGD per H, each without and with
worker rank 1 slowed down (`straggler`). `s to 85%` is the wall time at the
first evaluation at or above the target accuracy; staleness is 0 for sync,
the server versions a gradient missed for async, and the local steps since the
last average for local SGD.""",
    "modes_after": """\
How to read it. With a straggler, fast async workers take the straggler's
share of the batches while sync and local SGD wait for it (local SGD only at
each average). Async runs are not deterministic (arrival order); plain
Downpour async (no bound, full lr) is fragile with AdamW at this lr and may
stay near chance. When compute is a small part of a sync step, as on these
shared cores, a compute straggler slows sync less than its factor, and its
sleep frees a core for the others.""",
    "faults": """\
The main job with checkpoints and `--max-restarts 1`, three times: without a
fault, with a worker killed (`--fail-at`) and with a worker hung (`--hang-at`),
at the step before a checkpoint so the most work is lost. From the workers'
`events.jsonl` (wall clock): `detect s` is fault → the first worker that
raised for it, `recover s` fault → the restarted workers have loaded the
checkpoint and start the next step; `recomputed` is the steps lost with the
failed attempt; `params equal` compares the final parameters with the run
without a fault, bit for bit.""",
    "faults_after": """\
How to read it. A killed worker is noticed at once (its peers' sockets
close); a hang costs the timeout plus the 1.5 s in which the live ranks
compare notes, and then every rank names the hung one. Most of the time from
detection to training again is start-up: the agent stops the workers and
starts new Python processes, each of which imports torch before it joins the
group and loads the checkpoint.""",
}

_TITLES = {"allreduce": "AllReduce sweep", "train": "Training: gradsync DataParallel against torch DDP",
           "compression": "Gradient compression", "modes": "Sync, async and local SGD",
           "faults": "Faults: a killed and a hung worker"}


def load(bench_dir: str | Path = DEFAULT_BENCH_DIR) -> dict[str, dict]:
    """The recorded documents in ``bench_dir``, by bench name (missing benches are absent)."""
    documents = {}
    for name in BENCHES:
        path = Path(bench_dir) / f"{name}.json"
        if path.exists():
            documents[name] = json.loads(path.read_text(encoding="utf-8"))
    return documents


def tables(name: str, rows: list[dict]) -> list[str]:
    """The text tables ``gradsync bench NAME`` prints for ``rows``, made by the bench's own formatters."""
    if name == "allreduce":
        from gradsync.bench.allreduce import format_table
        return [format_table(rows)]
    if name == "train":
        from gradsync.bench.train import format_memory_table, format_table
        throughput = [row for row in rows if row.get("kind", "throughput") == "throughput"]
        memory = [row for row in rows if row.get("kind") == "memory"]
        return [format_table(throughput)] + ([format_memory_table(memory)] if memory else [])
    if name == "compression":
        from gradsync.bench.compression import format_accuracy_table, format_throughput_table
        accuracy = [row for row in rows if row["kind"] == "accuracy"]
        throughput = [row for row in rows if row["kind"] == "throughput"]
        return (([format_accuracy_table(accuracy)] if accuracy else [])
                + ([format_throughput_table(throughput)] if throughput else []))
    if name == "modes":
        from gradsync.bench.modes import format_table
        return [format_table(rows)]
    from gradsync.bench.faults import format_table
    return [format_table(rows)]


def _fmt_load(load_avg: list[float] | None) -> str:
    return "-" if not load_avg else " / ".join(f"{value:.2f}" for value in load_avg)


def _metadata(document: dict) -> str:
    m, v = document["machine"], document["versions"]
    memory = "-" if m.get("memory_gib") is None else f"{m['memory_gib']:g} GiB"
    cores = f"{m.get('cpu_count')} cores" + (f" ({m['usable_cpus']} usable)"
                                             if m.get("usable_cpus") not in (None, m.get("cpu_count")) else "")
    commit = f", commit {v['git_commit']}" if v.get("git_commit") else ""
    lines = ["| | |", "|---|---|",
             f"| command | `{document['command']}` |",
             f"| date (UTC) | {document['date']} |",
             f"| took | {document['duration_s']:.0f} s |",
             f"| machine | {m.get('cpu_model') or '-'}, {cores}, {memory}; {m.get('platform')} |",
             f"| load average (1 / 5 / 15 min) | before {_fmt_load(document.get('load_before'))}; "
             f"after {_fmt_load(document.get('load_after'))} |",
             f"| versions | gradsync {v['gradsync']}, torch {v['torch']}, Python {v['python']}{commit} |"]
    return "\n".join(lines)


def _summary(documents: dict[str, dict]) -> str:
    lines = ["| bench | measured (UTC) | took | load average before → after (1 min) | machine |",
             "|---|---|---|---|---|"]
    for name in BENCHES:
        document = documents.get(name)
        if document is None:
            lines.append(f"| `{name}` | not yet | | | |")
            continue
        before, after = document.get("load_before") or ["-"], document.get("load_after") or ["-"]
        m = document["machine"]
        lines.append(f"| `{name}` | {document['date']} | {document['duration_s']:.0f} s | {before[0]} → {after[0]} "
                     f"| {m.get('cpu_model') or '-'}, {m.get('cpu_count')} cores |")
    return "\n".join(lines) + "\n"


def render(bench_dir: str | Path = DEFAULT_BENCH_DIR) -> str:
    """The markdown of ``docs/benchmarks.md`` for the documents in ``bench_dir`` (deterministic)."""
    documents = load(bench_dir)
    parts = [_INTRO, _summary(documents)]
    for name in BENCHES:
        parts.append(f"## {_TITLES[name]} (`gradsync bench {name}`)\n")
        parts.append(_ABOUT[name] + "\n")
        document = documents.get(name)
        if document is None:
            parts.append(f"Not measured yet: run `make bench` (or `python -m gradsync.bench.report record {name}`).\n")
            continue
        parts.append(_metadata(document) + "\n")
        for table in tables(name, document["rows"]):
            parts.append("```text\n" + table + "\n```\n")
        plot = _PLOTS.get(name)
        if plot and (Path(bench_dir) / plot).exists():
            parts.append(f"![{_TITLES[name]}](bench/{plot})\n")
        parts.append(_ABOUT[name + "_after"] + "\n")
    return "\n".join(parts)


def write(bench_dir: str | Path = DEFAULT_BENCH_DIR, out: str | Path = DEFAULT_OUT) -> Path:
    """Render ``bench_dir`` into ``out``; returns ``out``."""
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(render(bench_dir), encoding="utf-8")
    return Path(out)


# ---------------------------------------------------------------- command line


def add_parser(benches: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add ``gradsync bench report`` to the ``bench`` sub-commands."""
    parser = benches.add_parser(
        "report", help="render docs/benchmarks.md from the JSON that `make bench` writes into docs/bench/",
        description="Render the markdown page of benchmark results from the JSON files that `make bench` "
                    "(python -m gradsync.bench.report record NAME ...) wrote, with each run's date, machine "
                    "and load.")
    parser.add_argument("--bench-dir", default=DEFAULT_BENCH_DIR, help="folder of the JSON files "
                        "(default %(default)s)")
    parser.add_argument("--out", default=DEFAULT_OUT, help="markdown file to write (default %(default)s)")
    parser.add_argument("--check", action="store_true", help="write nothing; exit 1 if --out differs from "
                        "the rendering")
    return parser


def run(args: argparse.Namespace) -> int:
    """``gradsync bench report``: write (or with ``--check`` compare) the rendered page; returns the exit code."""
    if not Path(args.bench_dir).is_dir():
        raise ValueError(f"--bench-dir {args.bench_dir} is not a folder (run `make bench` first)")
    if args.check:
        current = Path(args.out).read_text(encoding="utf-8") if Path(args.out).exists() else None
        if current != render(args.bench_dir):
            print(f"{args.out} is not the rendering of {args.bench_dir}: run `gradsync bench report`",
                  file=sys.stderr)
            return 1
        return 0
    print(f"wrote {write(args.bench_dir, args.out)} from {args.bench_dir}")
    return 0


def main(argv: list[str] | None = None) -> int:
    """``python -m gradsync.bench.report record [--bench-dir DIR] NAME [BENCH OPTIONS...]``."""
    parser = argparse.ArgumentParser(prog="python -m gradsync.bench.report",
                                     description="Run one benchmark and record its JSON with metadata.")
    commands = parser.add_subparsers(dest="command", required=True)
    rec = commands.add_parser("record", help="run `gradsync bench NAME OPTIONS` and write DIR/NAME.json")
    rec.add_argument("--bench-dir", default=DEFAULT_BENCH_DIR, help="(default %(default)s)")
    rec.add_argument("name", choices=BENCHES)
    rec.add_argument("bench_args", nargs=argparse.REMAINDER, help="options of gradsync bench NAME")
    args = parser.parse_args(argv)
    try:
        record(args.name, args.bench_args, args.bench_dir)
    except (ValueError, RuntimeError) as exc:
        print(f"gradsync bench report record: error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
