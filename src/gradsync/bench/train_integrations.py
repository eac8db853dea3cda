"""``gradsync bench train --integrations lightning,ray``: each framework's loop against the plain one (issue 41).

Per repetition every implementation of :data:`~gradsync.bench.integration_jobs.IMPLS` that the named
integrations need runs once, as a whole fresh job, in an order rotated by one each repetition
(:mod:`gradsync.bench.integration_jobs`: the same model, batch, optimizer, threads and timed steps;
the slowest rank's seconds). Two ratios, each formed within a repetition and then summarised as the
median with min and max (:mod:`gradsync.bench.spread`):

* ``vs_gradsync``: samples/s over the plain gradsync loop's (every row; the goal's ratio);
* ``vs_plain``: samples/s over the plain loop of the same reducer (gradsync for ``*-gradsync``, torch
  DDP for ``*-ddp``): what the framework's own per-step work costs.

Goal: each integration with gradsync (``lightning-gradsync``, ``ray-gradsync``) within 3% of the plain
gradsync loop's samples/s (``vs_gradsync`` >= 0.97), median of the repetitions.
"""

from __future__ import annotations

import contextlib

from gradsync.bench.integration_jobs import IMPLS, INTEGRATIONS, RayCluster, run_lightning, run_plain
from gradsync.bench.output import comma_names, format_rows, write_json
from gradsync.bench.spread import fmt_spread, paired_ratios, verdict, with_spread

GOAL_AT_LEAST = 0.97  # issue 41: within 3% of the plain gradsync loop
GOAL_IMPLS = ("lightning-gradsync", "ray-gradsync")


def impls_for(integrations: list[str]) -> list[str]:
    """The plain loops and each named integration's two rows, in :data:`IMPLS` order."""
    wanted = {"gradsync", "ddp"} | {impl for name in integrations for impl in INTEGRATIONS[name]}
    return [impl for impl in IMPLS if impl in wanted]


def plain_peer(impl: str) -> str:
    """The plain loop an implementation's ``vs_plain`` is formed against."""
    return "ddp" if impl.endswith("ddp") else "gradsync"


def _run_once(impl: str, algorithm: str, model: str, world_size: int, steps: int, warmup: int, ray) -> float:
    if impl in ("gradsync", "ddp"):
        return run_plain(impl, algorithm, model, world_size, steps, warmup)
    if impl.startswith("lightning"):
        return run_lightning(impl, algorithm, model, world_size, steps, warmup)
    return ray.run(impl, algorithm, model, steps, warmup)


def measure_all(impls: list[str], algorithm: str, model: str, world_size: int, steps: int, warmup: int,
                repeat: int) -> dict[str, list[float]]:
    """Seconds per step per implementation and repetition (rotated order; each the median window of its
    job, slowest rank)."""
    times: dict[str, list[float]] = {impl: [] for impl in impls}
    needs_ray = any(impl.startswith("ray") for impl in impls)
    with (RayCluster(world_size) if needs_ray else contextlib.nullcontext()) as ray:
        for repetition in range(repeat):
            shift = repetition % len(impls)
            for impl in impls[shift:] + impls[:shift]:
                times[impl].append(_run_once(impl, algorithm, model, world_size, steps, warmup, ray))
                print(f"# repetition {repetition + 1}/{repeat}: {impl} {times[impl][-1]:.4f} s per step", flush=True)
    return times


def integration_rows(times: dict[str, list[float]], base: dict, samples_per_step: int) -> list[dict]:
    """One row per implementation from its seconds per step in each repetition (``times[impl][k]``):
    samples/s, step seconds, ``vs_gradsync`` and ``vs_plain`` with spreads, and the goal's verdict on the
    rows it judges."""
    rate = {impl: [samples_per_step / seconds for seconds in runs] for impl, runs in times.items()}
    rows = []
    for impl, runs in times.items():
        row = {"kind": "integration", **base, "impl": impl, "repeat": len(runs),
               "algorithm": "native" if impl.endswith("ddp") else base["algorithm"],
               **with_spread("samples_per_s", rate[impl]), **with_spread("step_s", runs),
               **with_spread("vs_gradsync", paired_ratios(rate[impl], rate["gradsync"])),
               **with_spread("vs_plain", paired_ratios(rate[impl], rate[plain_peer(impl)])),
               "plain_peer": plain_peer(impl)}
        if impl in GOAL_IMPLS:
            row["goal"] = f"vs_gradsync >= {GOAL_AT_LEAST}"
            row["goal_verdict"] = verdict(row, "vs_gradsync", GOAL_AT_LEAST, at_most=False)
        rows.append(row)
    return rows


def format_integration_table(rows: list[dict]) -> str:
    """The rows as a table (medians with min-max)."""
    rows = [row for row in rows if row.get("kind") == "integration"]
    return format_rows(rows, [
        ("model", 5, lambda r: r["model"]), ("ws", 2, lambda r: str(r["world_size"])),
        ("impl", 18, lambda r: r["impl"]), ("algorithm", 9, lambda r: r["algorithm"]),
        ("samples/s", 20, lambda r: fmt_spread(r, "samples_per_s", ".0f")),
        ("vs gradsync loop", 20, lambda r: fmt_spread(r, "vs_gradsync", ".3f")),
        ("vs own plain loop", 20, lambda r: f"{fmt_spread(r, 'vs_plain', '.3f')} {r['plain_peer']}"),
        ("goal", 22, lambda r: r.get("goal_verdict", "-"))])


def goal_lines(rows: list[dict]) -> list[str]:
    """One line per row the goal judges: the integration, the setting, the verdict and the ratio."""
    return [f"# goal: {row['impl']} within 3% of the plain gradsync loop ({row['model']}, ws {row['world_size']}): "
            f"{row['goal_verdict']} (vs gradsync loop {fmt_spread(row, 'vs_gradsync', '.3f')})"
            for row in rows if "goal_verdict" in row]


def run_integrations(*, integrations: str, nproc: str, models: str, algorithms: str, steps: int, warmup: int,
                     repeat: int, json_path: str | None) -> list[dict]:
    """Validate, measure every (model, world size), print the table, write JSON; returns the rows."""
    from gradsync.bench.train import BATCH_PER_RANK, _parse_options, steps_for

    names = comma_names(integrations, "--integrations", tuple(INTEGRATIONS))
    world_sizes, model_names, algorithm_names = _parse_options(nproc, models, algorithms, steps, warmup, repeat)
    if len(algorithm_names) != 1:
        raise ValueError(f"--integrations compares one gradsync algorithm, got --algorithms {algorithms!r}")
    algorithm, impls = algorithm_names[0], impls_for(names)
    print(f"# gradsync bench train --integrations {','.join(names)}: algorithm {algorithm}; {repeat} "
          f"repetitions, each a fresh job per implementation in a rotated order; median (min-max)", flush=True)
    rows = []
    for world_size in world_sizes:
        for model in model_names:
            timed = steps_for(model, steps)
            times = measure_all(impls, algorithm, model, world_size, timed, warmup, repeat)
            base = {"model": model, "world_size": world_size, "algorithm": algorithm, "steps": timed,
                    "warmup": warmup, "batch_per_rank": BATCH_PER_RANK[model], "threads_per_rank": 1}
            rows += integration_rows(times, base, BATCH_PER_RANK[model] * world_size)
    print(format_integration_table(rows), flush=True)
    print("\n".join(goal_lines(rows)), flush=True)
    if json_path:
        write_json(json_path, rows)
    return rows
