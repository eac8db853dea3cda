"""``gradsync bench record NAME [OPTIONS...]``: run one benchmark and keep its rows with when, where and how.

Writes ``docs/bench/NAME.json``: the rows ``gradsync bench NAME OPTIONS
--json FILE`` wrote (for the simulator's records, ``gradsync calibrate``,
``gradsync simulate --validate``, ``--reproduce`` or the scale sweep with
``--json FILE``), with the date, the machine, the load average before and
after, the command and every option (defaults included), the repetitions
(``--repeat``), the gradsync, torch and Python versions, the git commit and
the seconds taken. ``make bench`` runs it once per record;
:mod:`~gradsync.bench.report` renders the pages.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import shutil
import subprocess
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable

from gradsync.bench.report import PLOTS, BENCHES, DEFAULT_BENCH_DIR, FORMAT_VERSION, command_of
from gradsync.bench.sim_report import SIM_CHOSEN, SIM_COMMANDS, SIM_REPEATED

Parse = Callable[[list[str]], argparse.Namespace]
Run = Callable[[list[str]], int]
_WITH_OUT = ("compression", "modes", "faults", "bitwise", "fit", "large-batch")   # benches whose run folders go to --out
_DROPPED_KEYS = ("run_folder",)   # paths of run folders that are deleted after recording
_NOT_OPTIONS = ("command", "bench", "simulate", "json", "out", "plot")  # parser keys that are no options of the run


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
    # the recorded results themselves (docs/) do not make the code that measured them dirty
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--", ":(top)",
                            ":(top,exclude)docs"], capture_output=True,
                           text=True, timeout=10, cwd=Path(__file__).parent).stdout.strip()
    return result.stdout.strip() + ("-dirty" if dirty else "")


def versions() -> dict:
    import torch

    import gradsync

    return {"gradsync": gradsync.__version__, "torch": torch.__version__, "python": platform.python_version(),
            "git_commit": _git_commit()}


def _files(name: str, scratch: Path) -> list[str]:
    """The options record chooses for ``name``: ``--json`` (the rows), and where a run writes more
    (run folders, a profile, a plot) a place in ``scratch``."""
    extra = ["--json", str(scratch / "rows.json")]
    if command_of(name)[0] == "bench" and command_of(name)[1] in _WITH_OUT:
        extra += ["--out", str(scratch / "out")]
    elif name == "sim_calibrate":
        extra += ["--out", str(scratch / "profile.json")]
    elif PLOTS.get(name) and name in SIM_CHOSEN:
        extra += ["--plot", str(scratch / "out" / PLOTS[name])]
    return extra


def _repeat_of(name: str, options: dict) -> int | None:
    """The record's ``--repeat``, None where the command ignores it (simulate's computations, faults without
    --elastic)."""
    if (name in SIM_COMMANDS and name not in SIM_REPEATED) or (name == "faults" and not options.get("elastic")):
        return None
    return options.get("repeat")


def record(name: str, bench_args: list[str], bench_dir: str | Path, *, parse: Parse, run: Run) -> Path:
    """Run ``gradsync bench NAME *bench_args`` (or the simulator command of ``NAME``,
    :data:`gradsync.bench.sim_report.SIM_COMMANDS`) and write ``bench_dir/NAME.json`` (rows + metadata).

    ``parse`` and ``run`` are the command line's parser and entry point
    (``gradsync.cli`` hands in its own: this module sits below it). Plots the
    command writes (compression, modes, the scale sweep) are copied beside the JSON.

    Raises:
        ValueError: unknown record name, or an option record chooses itself among the options
            (``--json``; ``--out`` of the benches and calibrate; ``--plot`` of the scale sweep).
        RuntimeError: the command exited with an error (nothing is written).
    """
    if name not in BENCHES:
        raise ValueError(f"unknown bench {name!r}; choose from {', '.join(BENCHES)}")
    if name == "sim_scale" and {"--validate", "--reproduce", "train"} & set(bench_args):
        raise ValueError("sim_scale records the scale sweep: --validate, --reproduce and train are other records")
    for option in SIM_CHOSEN.get(name, ("--json", "--out")):
        if any(arg == option or arg.startswith(option + "=") for arg in bench_args):
            raise ValueError(f"{option} is chosen by record; leave it out of the options")
    command = command_of(name)
    parsed = vars(parse([*command, *bench_args]))
    options = {key: value for key, value in parsed.items() if key not in _NOT_OPTIONS}
    bench_dir = Path(bench_dir)
    try:
        bench_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ValueError(f"--bench-dir {bench_dir} cannot be created: {exc.strerror or exc}") from None
    where, what = machine(), versions()  # before the run: the code that ran
    with tempfile.TemporaryDirectory(prefix=f"gradsync-bench-{name}-") as scratch:
        json_path = Path(scratch) / "rows.json"
        date = datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
        load_before, started = _load(), time.perf_counter()
        code = run([*command, *bench_args, *_files(name, Path(scratch))])
        duration_s, load_after = time.perf_counter() - started, _load()
        if code != 0:
            raise RuntimeError(f"gradsync {' '.join(command)} exited with code {code}; "
                               f"{bench_dir / name}.json not written")
        rows = json.loads(json_path.read_text())
        plot = PLOTS.get(name)
        if plot and (Path(scratch) / "out" / plot).exists():
            shutil.copyfile(Path(scratch) / "out" / plot, bench_dir / plot)
    rows = [{key: value for key, value in row.items() if key not in _DROPPED_KEYS} for row in rows]
    document = {"format": FORMAT_VERSION, "bench": name,
                "command": shlex.join(["gradsync", *command, *bench_args]), "options": options,
                "repeat": _repeat_of(name, options),
                "date": date, "duration_s": round(duration_s, 1),
                "load_before": load_before, "load_after": load_after, "machine": where, "versions": what,
                "rows": rows}
    path = bench_dir / f"{name}.json"
    path.write_text(json.dumps(document, indent=2) + "\n", encoding="utf-8")
    print(f"# wrote {path} ({duration_s:.0f} s)", flush=True)
    return path


def add_parser(benches: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add ``gradsync bench record`` to the ``bench`` sub-commands."""
    parser = benches.add_parser("record", help="run `gradsync bench NAME OPTIONS` (sim_*: the simulator's "
                                "command) and write DIR/NAME.json with date, machine, load and versions (what "
                                "`make bench` runs)")
    parser.add_argument("--bench-dir", default=DEFAULT_BENCH_DIR, help="folder of the JSON files, given before "
                        "NAME (everything after NAME goes to the bench) (default %(default)s)")
    parser.add_argument("name", choices=BENCHES)
    parser.add_argument("bench_args", nargs=argparse.REMAINDER, help="options of gradsync bench NAME (of "
                        "gradsync calibrate, simulate --validate, simulate --reproduce, simulate for sim_calibrate, "
                        "sim_validate, sim_reproduce, sim_scale)")
    return parser
