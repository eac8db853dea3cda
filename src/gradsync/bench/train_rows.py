"""``bench train``'s rows from per-repetition times: medians with spread, ratios to compute-only and DDP, tables.

Each implementation is measured once per repetition (the implementations
alternate inside it), so every ratio pairs two measurements of one
repetition (:func:`gradsync.bench.spread.paired_ratios`), then is summarised
as its median with min and max. Two ratios per row:

* ``step_vs_compute_only``: the step's time over the ``compute-only`` step's
  (the same model, data, world size, processes and threads, every rank
  stepping at once with no gradient synchronisation: the limit);
* ``ratio_to_ddp``: samples/s over those of the torch DDP row configured as
  this row is: DDP with ``gradient_as_bucket_view=True`` for a gradsync row
  whose gradients are views of its buckets (``shm_zero_copy``), plain DDP
  otherwise (and for the compute-only row: how far DDP is from the limit).
  DDP rows are not compared with themselves (None).

``cpu_vs_compute_only`` pairs the CPU seconds of the processes the same way:
what a step costs the machine's cores, less sensitive than the wall clock to
other programs sharing them; with every core busy computing (one rank per
core), the communication's CPU time cannot hide behind compute, so a step's
wall time is at least about its CPU time.
"""

from __future__ import annotations

from typing import Sequence

from gradsync.bench.output import fmt_optional, format_rows, host_layout
from gradsync.bench.spread import fmt_spread, paired_ratios, spread_cell, verdict, with_spread

COMPUTE_ONLY = "compute-only"
ZERO_COPY = "shm_zero_copy"  # DataParallel(algorithm="shm", gradient_as_bucket_view=True)
# Issue 37's goal: auto's step at most 1.15x compute-only's (median) on the MLP at world size 2, one host.
GOAL = {"model": "mlp", "world_size": 2, "algorithm": "auto", "name": "step_vs_compute_only", "at_most": 1.15}

Key = tuple  # (impl, algorithm, gradient_as_bucket_view): one measured implementation


def measured_keys(algorithms: Sequence[str]) -> list[Key]:
    """What one repetition measures, in order: compute-only, gradsync per algorithm, DDP, and DDP with
    ``gradient_as_bucket_view`` when some gradsync row uses bucket views (``shm_zero_copy``).

    >>> measured_keys(["auto", "shm_zero_copy"])[-2:]
    [('ddp', 'native', False), ('ddp', 'native', True)]
    """
    keys = [(COMPUTE_ONLY, "none", False)] + [("gradsync", name, name == ZERO_COPY) for name in algorithms]
    keys.append(("ddp", "native", False))
    if any(view for impl, _, view in keys if impl == "gradsync"):
        keys.append(("ddp", "native", True))
    return keys


def ddp_peer(key: Key, keys: Sequence[Key]) -> Key | None:
    """The DDP row that ``key``'s ``ratio_to_ddp`` is formed against: DDP with the same
    ``gradient_as_bucket_view`` where measured, else plain DDP; None for a DDP row (no self-comparison)."""
    impl, _, view = key
    if impl == "ddp":
        return None
    same = ("ddp", "native", view)
    return same if same in keys else ("ddp", "native", False)


def _spread_or_none(name: str, values: list[float] | None) -> dict:
    return {name: None} if values is None else with_spread(name, values)


def _comm_fields(runs: list[dict], steps: int) -> dict:
    """gradsync's communication seconds per step and the exposed share, each with its spread."""
    comm = [run["comm_s"] / steps for run in runs]
    exposed = [run["exposed_comm_s"] / steps for run in runs]
    fractions = None if min(comm) <= 0 else paired_ratios(exposed, comm)
    return {**with_spread("comm_s_per_step", comm), **with_spread("exposed_comm_s_per_step", exposed),
            **_spread_or_none("exposed_comm_fraction", fractions)}


def _cpu_fields(results: dict[Key, list[dict]], key: Key, steps: int) -> dict:
    """CPU seconds per step and rank, and their multiple of compute-only's (paired; None without ``cpu_s``)."""
    if any("cpu_s" not in run for runs in results.values() for run in runs):
        return {"cpu_s_per_step": None, "cpu_vs_compute_only": None}
    cpu = [run["cpu_s"] / steps for run in results[key]]
    compute = [run["cpu_s"] / steps for run in results[(COMPUTE_ONLY, "none", False)]]
    return {**with_spread("cpu_s_per_step", cpu),
            **_spread_or_none("cpu_vs_compute_only", None if key[0] == COMPUTE_ONLY else paired_ratios(cpu, compute))}


def throughput_rows(results: dict[Key, list[dict]], steps: int, samples_per_step: int, base: dict,
                    ddp_settings: dict[bool, dict] | None = None) -> list[dict]:
    """One row per measured key from its repetitions (``results[key][k]``: repetition k's ``elapsed_s``,
    slowest rank, of ``steps`` steps; ``comm_s`` and ``exposed_comm_s``, gradsync's seconds over them;
    ``cpu_s``, optional, the CPU seconds of a rank's process over them, mean over ranks).

    ``base``: fields every row gets (model, world size, batch...); ``ddp_settings``: DDP's constructor
    settings by ``gradient_as_bucket_view``, written on the DDP rows. Times are seconds.

    Raises:
        ValueError: no compute-only or plain DDP key, or keys with different repetition counts.
    """
    keys = list(results)
    for needed in ((COMPUTE_ONLY, "none", False), ("ddp", "native", False)):
        if needed not in results:
            raise ValueError(f"no {needed[0]} measurement to compare with: got {keys}")
    step_times = {key: [run["elapsed_s"] / steps for run in runs] for key, runs in results.items()}
    compute = step_times[(COMPUTE_ONLY, "none", False)]
    rows = []
    for key in keys:
        impl, algorithm, view = key
        steps_s = step_times[key]
        peer = ddp_peer(key, keys)
        row = {"kind": "throughput", **base, "impl": impl, "algorithm": algorithm,
               "gradient_as_bucket_view": view, "repeat": len(steps_s),
               **with_spread("samples_per_s", [samples_per_step / t for t in steps_s]),
               **with_spread("step_s", steps_s), **with_spread("compute_only_step_s", compute),
               **_spread_or_none("step_vs_compute_only",
                                 None if impl == COMPUTE_ONLY else paired_ratios(steps_s, compute)),
               **_spread_or_none("ratio_to_ddp", None if peer is None else paired_ratios(step_times[peer], steps_s)),
               "ddp_peer": None if peer is None else f"ddp, gradient_as_bucket_view={peer[2]}",
               **_cpu_fields(results, key, steps)}
        if impl == "gradsync":
            row.update(_comm_fields(results[key], steps))
        else:
            row.update(comm_s_per_step=None, exposed_comm_s_per_step=None, exposed_comm_fraction=None)
        if impl == "ddp" and ddp_settings:
            row["ddp_settings"] = ddp_settings[view]
        rows.append(row)
    return rows


def is_goal_row(row: dict) -> bool:
    """Whether ``row`` is the one issue 37's goal (:data:`GOAL`) judges: auto on the MLP, ws 2, one host."""
    return (row.get("impl") == "gradsync" and row.get("algorithm") == GOAL["algorithm"]
            and row.get("model") == GOAL["model"] and row.get("world_size") == GOAL["world_size"]
            and row.get("hosts", 1) == 1)


def add_goal(rows: list[dict]) -> None:
    """Write ``goal`` and ``goal_verdict`` (met/missed, straddles) on the goal's row, when measured."""
    for row in rows:
        if is_goal_row(row) and row.get(GOAL["name"]) is not None:
            row["goal"] = f"{GOAL['name']} <= {GOAL['at_most']}"
            row["goal_verdict"] = verdict(row, GOAL["name"], GOAL["at_most"])


def goal_lines(rows: list[dict]) -> list[str]:
    """The verdict line of each goal row that has ``step_vs_compute_only`` (old rows have none)."""
    return [f"# goal: auto's step <= {GOAL['at_most']:.2f}x compute-only's (median) on the MLP at world size "
            f"{row['world_size']}: {fmt_spread(row, GOAL['name'], '.2f', 'x')}: "
            f"{verdict(row, GOAL['name'], GOAL['at_most'])}"
            for row in rows if is_goal_row(row) and row.get(GOAL["name"]) is not None]


def _ms(name: str):
    """A cell: the row's seconds ``name`` (with its spread when recorded) in milliseconds."""
    def cell(row: dict) -> str:
        scaled = {key: None if row.get(key) is None else row[key] * 1e3
                  for key in (name, f"{name}_min", f"{name}_max") if key in row}
        return fmt_spread(scaled, name, ".2f")
    return cell


def _vs_compute_only(row: dict) -> str:
    """``step_vs_compute_only`` with its spread; rows recorded before it: step_s / local_step_s."""
    if "step_vs_compute_only" in row or row.get("local_step_s") is None:
        return fmt_spread(row, "step_vs_compute_only", ".2f", "x")
    return f"{row['step_s'] / row['local_step_s']:.2f}x"


def _view(row: dict) -> str:
    view = row.get("gradient_as_bucket_view")
    return "-" if view is None else ("yes" if view else "no")


def ddp_lines(rows: list[dict]) -> list[str]:
    """DDP's settings as the table's footer: one line per distinct setting but gradient_as_bucket_view, whose
    values measured are listed together (the view column says which row has which).

    >>> ddp_lines([{"ddp_settings": {"backend": "gloo", "gradient_as_bucket_view": v}} for v in (False, True)])
    ['# ddp: torch DistributedDataParallel, backend gloo, gradient_as_bucket_view False/True (column view)']
    """
    groups: dict[tuple, list] = {}
    for row in rows:
        settings = dict(row.get("ddp_settings") or {})
        if settings:
            view = settings.pop("gradient_as_bucket_view", None)
            views = groups.setdefault(tuple(settings.items()), [])
            if view not in views:
                views.append(view)
    return ["# ddp: torch DistributedDataParallel, " + ", ".join(
        [f"{key} {value}" for key, value in settings] +
        [f"gradient_as_bucket_view {'/'.join(str(view) for view in views)} (column view)"])
        for settings, views in groups.items()]


def format_table(rows: list[dict]) -> str:
    """Render throughput rows (times per step in ms, each median (min-max) over the repetitions; rows
    recorded without a spread show the bare value), then DDP's settings and the goal's verdict."""
    multi = any(row.get("hosts", 1) > 1 for row in rows)
    columns = [("hosts", 6, host_layout)] if multi else []
    columns += [("model", 5, "{model}"), ("ws", 3, "{world_size}"), ("impl", 12, "{impl}"),
                ("algorithm", 13, "{algorithm}"), ("view", 4, _view),
                ("samples/s", 19, spread_cell("samples_per_s", ".0f")), ("step ms", 23, _ms("step_s")),
                ("x compute-only", 17, _vs_compute_only),
                ("cpu x compute-only", 18, spread_cell("cpu_vs_compute_only", ".2f", "x")),
                ("ratio_to_ddp", 17, spread_cell("ratio_to_ddp", ".2f", "x")),
                ("comm ms/step", 20, _ms("comm_s_per_step")), ("exposed ms/step", 20, _ms("exposed_comm_s_per_step")),
                ("exposed/comm", 16, spread_cell("exposed_comm_fraction", ".2f"))]
    lines = [format_rows(rows, columns)]
    old = {(row["model"], row["world_size"]): row["local_step_s"] for row in rows if "local_step_s" in row}
    lines += [f"# local compute-only step ({model}, world_size {ws}): {seconds * 1e3:.2f} ms"
              for (model, ws), seconds in old.items()]
    if any("repeat" in row for row in rows):
        lines.append("# view: gradient_as_bucket_view; x compute-only: step / the compute-only step of the same "
                     "repetition (cpu: the processes' CPU seconds, mean over ranks); ratio_to_ddp: samples/s / those of the "
                     "ddp row with the same view, same repetition")
    return "\n".join(lines + ddp_lines(rows) + goal_lines(rows))


def format_memory_table(rows: list[dict]) -> str:
    """Render memory rows: peak RSS per rank (max over ranks), the saving against the False row, and the
    resident MiB after the steps (the steady state, without the transient peaks of the first steps)."""
    base = {(r["model"], r["world_size"]): r["peak_rss_mib"] for r in rows if not r["gradient_as_bucket_view"]}

    def saving(row: dict) -> str:
        peak = base.get((row["model"], row["world_size"]))
        return fmt_optional(None if peak is None else peak - row["peak_rss_mib"], ".1f")

    return format_rows(rows, [
        ("model", 6, "{model}"), ("world_size", 10, "{world_size}"), ("impl", 9, "{impl}"),
        ("gradient_as_bucket_view", 23, "{gradient_as_bucket_view!s}"),
        ("peak RSS [MiB/rank]", 19, "{peak_rss_mib:.1f}"), ("saving vs False [MiB]", 21, saving),
        ("RSS after [MiB/rank]", 20, "{rss_after_mib:.1f}")])
