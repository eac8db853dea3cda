"""The simulator's records: which command each runs, calibrate's figures as rows, and their tables for the pages.

``make bench`` records ``gradsync calibrate``, ``gradsync simulate --validate``,
``--reproduce`` and the scale sweep like the benchmarks (:mod:`gradsync.bench.record`);
:func:`tables` formats a record's rows with the commands' own formatters for
``docs/benchmarks.md`` and the generated section of ``docs/simulator.md``
(:mod:`gradsync.bench.report`).
"""

from __future__ import annotations

from gradsync.bench.output import format_rows

# record name -> the gradsync command line it runs (before the options)
SIM_COMMANDS = {"sim_calibrate": ("calibrate",), "sim_validate": ("simulate", "--validate"),
                "sim_reproduce": ("simulate", "--reproduce"), "sim_scale": ("simulate",)}
# options of a recorded command that record chooses itself (the files it writes)
SIM_CHOSEN = {"sim_calibrate": ("--json", "--out"), "sim_validate": ("--json",), "sim_reproduce": ("--json",),
              "sim_scale": ("--json", "--plot")}
SIM_PLOTS = {"sim_scale": "simulate_scale.png"}
SIM_REPEATED = ("sim_validate",)  # the records whose --repeat counts (simulate's other forms ignore it)


def _link_figures(label: str, link) -> list[tuple[str, str, float, str]]:
    crowded = link.oversubscribed_hop_alpha_s
    return [(f"{label} alpha", f"{label}.alpha_s", link.alpha_s * 1e6, "us"),
            (f"{label} hop in a schedule", f"{label}.hop_alpha_s",
             None if link.hop_alpha_s is None else link.hop_alpha_s * 1e6, "us"),
            (f"{label} hop, ranks > cores", f"{label}.oversubscribed_hop_alpha_s",
             None if crowded is None else crowded * 1e6, "us"),
            (f"{label} one-way hop", f"{label}.one_way_hop_alpha_s",
             None if link.one_way_hop_alpha_s is None else link.one_way_hop_alpha_s * 1e6, "us"),
            (f"{label} bandwidth", f"{label}.bandwidth_bytes_per_s", link.bandwidth_bytes_per_s / 1e9, "GB/s")]


def profile_figures(profile) -> list[dict]:
    """The measured figures of a :class:`~gradsync.collectives.cost.profile.Profile`, one row each:
    ``figure`` (what it is), ``field`` (the profile's field), ``value`` in ``unit`` (us, GB/s, ns/B,
    or a count); figures the profile does not have are left out."""
    figures = _link_figures("intra", profile.intra) + (_link_figures("inter", profile.inter)
                                                       if profile.inter is not None else [])
    figures += [("gamma (add)", "gamma_s_per_byte", profile.gamma_s_per_byte * 1e9, "ns/B"),
                ("copy", "copy_s_per_byte", profile.copy_s_per_byte * 1e9, "ns/B"),
                ("call overhead", "call_overhead_s", profile.call_overhead_s * 1e6, "us"),
                *((f"call overhead, {name}", f"call_overheads_s.{name}", seconds * 1e6, "us")
                  for name, seconds in profile.call_overheads_s),
                ("cores per host", "cores_per_host", profile.cores_per_host, "cores"),
                ("ranks per host", "ranks_per_host", profile.ranks_per_host, "ranks")]
    shm = profile.shm
    if shm is not None:
        figures += [("shm barrier", "shm.barrier_s", shm.barrier_s * 1e6, "us"),
                    ("shm barrier, ranks > cores", "shm.oversubscribed_barrier_s",
                     None if shm.oversubscribed_barrier_s is None else shm.oversubscribed_barrier_s * 1e6, "us"),
                    ("shm cell overhead", "shm.cell_overhead_s", shm.cell_overhead_s * 1e6, "us"),
                    ("shm lean call overhead", "shm.lean_call_overhead_s",
                     None if shm.lean_call_overhead_s is None else shm.lean_call_overhead_s * 1e6, "us"),
                    ("shm add in cache", "shm.cache_gamma_s_per_byte",
                     None if shm.cache_gamma_s_per_byte is None else shm.cache_gamma_s_per_byte * 1e9, "ns/B"),
                    ("shm copy in cache", "shm.cache_copy_s_per_byte",
                     None if shm.cache_copy_s_per_byte is None else shm.cache_copy_s_per_byte * 1e9, "ns/B"),
                    ("memory bandwidth", "shm.memory_bandwidth_bytes_per_s",
                     shm.memory_bandwidth_bytes_per_s / 1e9, "GB/s")]
    return [{"profile": profile.name, "figure": figure, "field": name, "value": value, "unit": unit}
            for figure, name, value, unit in figures if value is not None]


def format_figures(rows: list[dict]) -> str:
    """The table of :func:`profile_figures` rows."""
    return format_rows(rows, [("figure", 28, "{figure}"), ("value", 10, lambda row: f"{row['value']:.4g}"),
                              ("unit", 6, "{unit}"), ("profile field", 34, "{field}")])


def tables(name: str, rows: list[dict]) -> list[str]:
    """The text tables of the simulator record ``name`` (a key of :data:`SIM_COMMANDS`) for ``rows``.

    Raises:
        ValueError: ``name`` is not a simulator record.
    """
    if name == "sim_calibrate":
        return [format_figures(rows)]
    if name == "sim_validate":
        return validation_record_tables(rows)
    if name == "sim_reproduce":
        from gradsync.bench.reproduce import format_table
        return [format_table(rows)]
    if name == "sim_scale":
        from gradsync.bench.scale_report import crossover_lines, format_fastest, rows_of
        scale = rows_of(rows)
        return [format_fastest(scale), "\n".join(crossover_lines(scale))]
    raise ValueError(f"{name!r} is not a simulator record; choose from {', '.join(SIM_COMMANDS)}")


def describe(profile) -> str:
    """A :class:`~gradsync.collectives.cost.profile.Profile`'s measured terms (what ``gradsync calibrate``
    prints), one a line, in the units one reads them in."""
    lines = [f"# profile {profile.name!r} (digest {profile.digest()}): {profile.description}"]
    for label, link in (("intra", profile.intra), ("inter", profile.inter)):
        if link is not None:
            lines.append(f"{label:>8}: alpha {link.alpha_s * 1e6:8.1f} us   bandwidth "
                         f"{link.bandwidth_bytes_per_s / 1e9:7.3f} GB/s{'  (cpu bound)' if link.cpu_bound else ''}")
            hops = [(text, value) for text, value in (
                ("exchange", link.hop_alpha_s), ("one-way", link.one_way_hop_alpha_s),
                ("exchange, ranks > cores", link.oversubscribed_hop_alpha_s),
                ("one-way, ranks > cores", link.oversubscribed_one_way_hop_alpha_s)) if value is not None]
            if hops:
                lines.append(f"{'':>8}  hop in a schedule: " + ", ".join(f"{text} {value * 1e6:.1f} us"
                                                                         for text, value in hops))
    lines.append(f"{'gamma':>8}: {profile.gamma_s_per_byte * 1e9:8.3f} ns/B ({1 / profile.gamma_s_per_byte / 1e9:.2f} GB/s)"
                 f"   copy {profile.copy_s_per_byte * 1e9:.3f} ns/B ({1 / profile.copy_s_per_byte / 1e9:.2f} GB/s)")
    lines.append(f"{'cores':>8}: {profile.cores_per_host} per host, {profile.ranks_per_host} ranks per host, "
                 f"call overhead {profile.call_overhead_s * 1e6:.1f} us"
                 + "".join(f", {name} {seconds * 1e6:.1f} us" for name, seconds in profile.call_overheads_s))
    if profile.shm is not None:
        crowded = profile.shm.oversubscribed_barrier_s
        lean = profile.shm.lean_call_overhead_s
        lines.append(f"{'shm':>8}: barrier {profile.shm.barrier_s * 1e6:.1f} us"
                     + (f" ({crowded * 1e6:.1f} us when ranks outnumber cores)" if crowded is not None else "")
                     + f", cell overhead {profile.shm.cell_overhead_s * 1e6:.1f} us per rank"
                     + (f", in cache: add {profile.shm.cache_gamma_s_per_byte * 1e9:.3f} copy "
                        f"{profile.shm.cache_copy_s_per_byte * 1e9:.3f} ns/B"
                        if profile.shm.cache_gamma_s_per_byte is not None
                        and profile.shm.cache_copy_s_per_byte is not None else "")
                     + (f", lean call overhead {lean * 1e6:.1f} us" if lean is not None else "")
                     + ", memory "
                     f"{profile.shm.memory_bandwidth_bytes_per_s / 1e9:.2f} GB/s")
    return "\n".join(lines)


def validation_tables(rows) -> list[str]:
    """``simulate --validate``'s tables after its measurement, for its
    :class:`~gradsync.bench.sim_validation.ValidationRow` s: the rows with the goals' lines, the breakdown per
    layout and collective, ``auto``'s picks."""
    from gradsync.bench.sim_validation import (format_breakdown, format_rows as format_validation, format_summary,
                                               summarize)
    from gradsync.bench.sim_validation_picks import auto_picks, format_picks

    return [format_validation(rows) + "\n" + format_summary(summarize(rows)), format_breakdown(rows),
            format_picks(auto_picks(rows))]


def validation_record_tables(rows: list[dict]) -> list[str]:
    """The tables of a recorded ``simulate --validate`` (its ``--json`` rows): the split (when the record kept
    the calibration's points: rows of ``role`` "calibrate"), then :func:`validation_tables`. Older records (no
    ``collective``, no spread fields) read as AllReduce rows; spreads and verdicts come from their
    ``measured_us_runs``."""
    from gradsync.bench.sim_validation import ValidationRow
    from gradsync.bench.sim_validation_points import as_point, format_split, point_of, split_rows

    calibration = [as_point(row) for row in rows if row.get("role") == "calibrate"]
    validation = [ValidationRow.from_dict(row) for row in rows if row.get("role") != "calibrate"]
    split = [format_split(split_rows([point_of(row) for row in validation], calibration))] if calibration else []
    return split + validation_tables(validation)
