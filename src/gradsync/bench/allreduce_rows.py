"""The AllReduce sweep's figures from each repetition's time (paired ratios with their spread) and its table.

A sweep point (one message size) times every algorithm once per repetition,
interleaved; :func:`row_figures` turns those times into each row's figures:

* ``time_us`` (the median), ``time_us_median``/``_min``/``_max``, and
  ``time_us_reps``: every repetition's time (the slowest rank's, µs), so any
  ratio can be formed again from the JSON;
* ``algbw_gbps`` = bytes / median time and ``busbw_gbps`` = algbw · 2(p-1)/p
  (nccl-tests; (p-1)/p for reduce_scatter and all_gather,
  :mod:`gradsync.bench.sweep_collectives`), with ``_median`` (the same) and ``_min``/``_max`` (from the
  slowest and the fastest repetition);
* ``ratio_to_native``: native's time in repetition k over the row's time in
  repetition k, summarised over k (median, min, max); ``ratio_to_mpi`` the same
  against MPI_Allreduce when an ``mpi`` column was measured (None on the mpi row).
"""

from __future__ import annotations

from gradsync.bench.mpi import MPI_COLUMN
from gradsync.bench.output import fmt_optional, format_rows, host_layout, optional
from gradsync.bench.spread import paired_ratios, spread, spread_cell, with_spread
from gradsync.bench.sweep_collectives import ALL_REDUCE, busbw_factor


def row_figures(times_s: dict[str, list[float]], nbytes: int, world_size: int,
                collective: str = ALL_REDUCE) -> dict[str, dict]:
    """The figures of every algorithm's row at one size, from its per-repetition times.

    Args:
        times_s: algorithm -> the slowest rank's seconds per call in each repetition (all the same length;
            ``"native"`` and ``"mpi"`` among them give the rows their ratios).
        nbytes: the message's bytes (nccl-tests' S: for all_gather the gathered output).
        world_size: ranks (busbw's factor).
        collective: all_reduce (busbw = algbw · 2(p-1)/p), reduce_scatter or all_gather (algbw · (p-1)/p).

    Returns:
        algorithm -> the row fields named in the module docstring.

    Raises:
        ValueError: repetitions of different counts, none, or a time that is not positive.
    """
    factor = busbw_factor(collective, world_size)
    figures = {}
    for name, seconds in times_s.items():
        fields = with_spread("time_us", seconds, scale=1e6)
        fields["time_us_reps"] = [value * 1e6 for value in seconds]
        fields.update(_bandwidths(nbytes, seconds, "algbw_gbps", 1.0))
        fields.update(_bandwidths(nbytes, seconds, "busbw_gbps", factor))
        native = times_s.get("native")
        fields.update(with_spread("ratio_to_native", paired_ratios(native, seconds)) if native
                      else {"ratio_to_native": None})
        if MPI_COLUMN in times_s:
            fields.update(with_spread("ratio_to_mpi", paired_ratios(times_s[MPI_COLUMN], seconds))
                          if name != MPI_COLUMN else {"ratio_to_mpi": None})
        figures[name] = fields
    return figures


def _bandwidths(nbytes: int, seconds: list[float], name: str, factor: float) -> dict[str, float]:
    """``name`` = nbytes · factor / median time (GB/s), its ``_median``, and ``_min``/``_max`` from the
    slowest/fastest repetition (so that the figure and its median agree with ``time_us`` at any count)."""
    middle = spread(seconds).median
    rate = {key: nbytes * factor / value / 1e9 for key, value in
            (("median", middle), ("min", max(seconds)), ("max", min(seconds)))}
    return {name: rate["median"], f"{name}_median": rate["median"], f"{name}_min": rate["min"],
            f"{name}_max": rate["max"]}


def format_table(rows: list[dict]) -> str:
    """Render rows as an aligned text table with units in the header.

    Time, "vs native" and "vs mpi" show the median (min-max) over the repetitions; rows recorded
    before the spread was kept show their bare value. With hosts > 1 also "hosts" (HxL) and
    "link [Gb/s]"; "link %" of the shaped rate when shaped. With an mpi row, "vs mpi" (MPI_Allreduce's
    time / this time at the same size); with shm rows measured against the memory bound, "of bound"
    (:mod:`gradsync.bench.memory_bound`).
    """
    multi = any(row.get("hosts", 1) > 1 for row in rows)
    shaped = any(row.get("link_fraction") is not None for row in rows)
    mpi = {(row["nbytes"], row["world_size"]): row["time_us"] for row in rows if row["algorithm"] == MPI_COLUMN}
    bound = any(row.get("bound_fraction") is not None for row in rows)

    def versus_mpi(row: dict) -> str:
        if "ratio_to_mpi" in row:
            return spread_cell("ratio_to_mpi", ".2f", "x")(row)
        versus = mpi.get((row["nbytes"], row["world_size"]))  # a row recorded before ratio_to_mpi was kept
        return "-" if versus is None or row["algorithm"] == MPI_COLUMN else f"{versus / row['time_us']:.2f}x"

    def link_percent(row: dict) -> str:
        fraction = row.get("link_fraction")
        return fmt_optional(None if fraction is None else 100 * fraction, ".1f")

    time, native = spread_cell("time_us", ".1f"), spread_cell("ratio_to_native", ".2f", "x")
    columns = [("hosts", 6, host_layout)] if multi else []
    columns += [("size [B]", 12, "{nbytes}"), ("algorithm", 17, "{algorithm}"),
                ("time [us]", width(rows, time, 11), time),
                ("algbw [GB/s]", 13, "{algbw_gbps:.3f}"), ("busbw [GB/s]", 13, "{busbw_gbps:.3f}"),
                ("vs native", width(rows, native, 10), native),
                ("sent/size", 10, lambda row: f"{row['bytes_sent_per_call'] / max(row['nbytes'], 1):.3f}")]
    columns += [("link [Gb/s]", 12, optional("link_gbps", ".3f"))] if multi else []
    columns += [("link %", 7, link_percent)] if shaped else []
    columns += [("vs mpi", width(rows, versus_mpi, 8), versus_mpi)] if mpi else []
    columns += [("of bound", 9, optional("bound_fraction", ".2f"))] if bound else []
    return format_rows(rows, columns)


def width(rows: list[dict], cell, least: int) -> int:
    """A column's width: ``least``, or its longest cell's length plus one space."""
    return max([least] + [len(cell(row)) + 1 for row in rows])


def bound_spread(bound: float | None, figures: dict) -> dict:
    """``bound_fraction_median/_min/_max``: the bound's time over the median, slowest and fastest repetition."""
    if bound is None:
        return {}
    median_s = figures["time_us"]
    return {"bound_fraction_median": bound, "bound_fraction_min": bound * median_s / figures["time_us_max"],
            "bound_fraction_max": bound * median_s / figures["time_us_min"]}
