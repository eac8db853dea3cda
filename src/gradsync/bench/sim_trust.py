"""How far to trust each number the simulator prints: its errors where it was checked, from the records.

The simulator is checked twice, and only there can an error be given:

* against this machine (``sim_validate``: ``gradsync simulate --validate``, 2-4 ranks on one host and
  2 x 2 test hosts, Gloo over loopback and a shaped veth link): the measured time of the very code it
  runs;
* against published nccl-tests curves (``sim_reproduce``: ``gradsync simulate --reproduce``, 8 and 32
  GPUs, NCCL's own choice priced by NCCL's model).

Everything beyond (the scale sweep and ``gradsync explain`` at 64-4096 GPUs) is an extrapolation of the
same model with a GPU profile's constants: no measurement exists to give its error, so the table says
which check it rests on instead. :func:`trust_rows` computes each row from the records' rows;
:func:`format_trust` prints them (``docs/simulator.md``'s generated section ends with it).
"""

from __future__ import annotations

import statistics

from gradsync.bench.output import format_rows

SMALL_BYTES = 64 * 2**10  # the validation's and the reproduction's size regions split here
LARGE_CURVE_BYTES = 64 * 2**20


def _row(scope: str, evidence: str, errors: list[float], within: int | None = None, note: str = "") -> dict:
    """One table row from absolute errors in percent (empty: not measured)."""
    return {"scope": scope, "evidence": evidence, "rows": len(errors),
            "median": statistics.median(errors) if errors else None, "worst": max(errors) if errors else None,
            "within": "-" if within is None else f"{within}/{len(errors)}", "note": note}


def _validation_rows(rows: list[dict]) -> list[dict]:
    from gradsync.bench.sim_validation import ValidationRow

    validated = [ValidationRow.from_dict(row) for row in rows if row.get("role", "validate") == "validate"]
    out = []
    for hosts, scope in ((1, "this machine, 1 host x 2-4 ranks"), (2, "2 x 2 test hosts (shaped veth)")):
        for small, region in ((True, "< 64 KiB"), (False, ">= 64 KiB")):
            members = [row for row in validated if (row.hosts > 1) == (hosts > 1) and (row.nbytes < SMALL_BYTES) == small]
            out.append(_row(f"{scope}, {region}", "measured here (sim_validate)",
                            [100 * abs(row.error) for row in members], sum(row.passes for row in members),
                            "sim_validate's within: rows whose |median error| <= their bound (max(25%, "
                            "spread) from 64 KiB, max(40%, spread) below)"))
    return out


def _reproduce_rows(rows: list[dict]) -> list[dict]:
    out = []
    for source in dict.fromkeys(row["source"] for row in rows):
        members = [row for row in rows if row["source"] == source]
        for start, limit, region in ((4096, 20.0, ">= 4 KiB"), (LARGE_CURVE_BYTES, 10.0, ">= 64 MiB")):
            errors = [abs(row["error_pct"]) for row in members if row["nbytes"] >= start]
            out.append(_row(f"{source}, {region}", "published nccl-tests (sim_reproduce)", errors,
                            sum(error <= limit for error in errors), "sim_reproduce's within: points within the region's goal (20% from 4 KiB, 10% "
                            "from 64 MiB)"))
    return out


def trust_rows(documents: dict) -> list[dict]:
    """The rows of the trust table from the loaded records (``documents``: record name -> its JSON; a
    record missing gives no rows of its own)."""
    rows = []
    if "sim_validate" in documents:
        rows += _validation_rows(documents["sim_validate"]["rows"])
    if "sim_reproduce" in documents:
        rows += _reproduce_rows(documents["sim_reproduce"]["rows"])
    rows.append(_row("64-4096 GPUs (sim_scale, gradsync explain)", "none: extrapolated", [],
                     note="64-4096 GPUs: rests on the GPU profiles' constants, checked only by sim_reproduce "
                          "at 8 and 32 GPUs"))
    return rows


def _percent(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}%"


def format_trust(documents: dict) -> str:
    """The trust table (text) of :func:`trust_rows`, then what "within" counts for each kind of row."""
    rows = trust_rows(documents)
    table = format_rows(rows, [
        ("scope", 46, "{scope}"), ("evidence", 38, "{evidence}"), ("rows", 4, "{rows}"),
        ("median |error|", 14, lambda row: _percent(row["median"])),
        ("worst |error|", 13, lambda row: _percent(row["worst"])), ("within", 7, "{within}")])
    notes = dict.fromkeys(f"# {row['note']}" for row in rows if row["note"])
    return table + "\n" + "\n".join(notes)


TITLE = "How far to trust each number"
ABOUT = """Each figure the simulator prints is as good as the check behind it. This table is computed from the
records above (`gradsync bench report` regenerates it): the |error| of the validation against this
machine, by layout and size region, and of the reproduction of each published curve, by the goal's
regions. A scale or `gradsync explain` figure at 64-4096 GPUs has no measurement to compare with: it
extrapolates the model that the reproduction checks at 8 and 32 GPUs, so read it as the model's
statement (which algorithm wins, by what order of magnitude, which term dominates), not a measured time."""
