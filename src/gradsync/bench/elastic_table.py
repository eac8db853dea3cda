"""The tables of ``gradsync bench faults --elastic``: what each failure cost, then throughput and correctness."""

from __future__ import annotations

from gradsync.bench.output import format_rows
from gradsync.bench.spread import fmt_spread

REFERENCE_FAULTS = ("none", "chaos-none")


def is_reference(row: dict) -> bool:
    """A fault-free run that the others are compared with (rows recorded before ``reference`` by their name)."""
    return bool(row.get("reference")) or row.get("fault") in REFERENCE_FAULTS


def comparative(name: str, spec: str):
    """A cell of a figure compared with a reference: "-" on a reference row, else median (min-max)."""
    return lambda row: "-" if is_reference(row) else fmt_spread(row, name, spec)


def per_failure(name: str, spec: str):
    """A cell of a per-failure figure: "-" on a reference row and on rows recorded before the common
    definitions of :mod:`gradsync.bench.elastic_metrics` (they lack ``steps_redone``)."""
    return lambda row: "-" if is_reference(row) or "steps_redone" not in row else fmt_spread(row, name, spec)


def _flag(name: str):
    return lambda row: "-" if is_reference(row) or row.get(name) is None else str(row[name])


def _count(name: str):
    return lambda row: "-" if row.get(name) is None else f"{row[name]:d}"


def format_table(rows: list[dict]) -> str:
    """Both tables with their notes (rows of old recordings without the new fields show "-")."""
    common = [("system", 8, lambda r: r.get("system", "gradsync")), ("fault", 10, "{fault}"),
              ("runs", 4, lambda r: f"{r.get('runs', 1)}")]
    failures = format_rows(rows, common + [
        ("n", 2, lambda r: f"{r.get('nproc', 0)}"), ("failures", 8, lambda r: f"{r.get('failures') or 0}"),
        ("detect s", 21, per_failure("detect_s", ".3f")), ("recover s", 21, per_failure("recover_s", ".3f")),
        ("joiner s", 21, per_failure("joiner_s", ".3f")), ("steps redone", 12, per_failure("steps_redone", "g"))])
    throughput = format_rows(rows, common + [
        ("samples/s", 18, lambda r: fmt_spread(r, "samples_per_s", ".0f")),
        ("kept", 19, comparative("throughput_kept", ".3f")),
        ("lost", 5, _count("samples_lost")), ("dup", 4, _count("samples_duplicated")),
        ("replicas=", 9, lambda r: "-" if r.get("replicas_equal") is None else str(r["replicas_equal"])),
        ("bitwise=", 8, _flag("bitwise_equal_to_fault_free")),
        ("test acc", 8, lambda r: "-" if r.get("final_test_accuracy") is None else f"{r['final_test_accuracy']:.4f}")])
    notes = ("# per failure, seconds from the kill (or hang), median (min-max) over every failure of every run: "
             "detect: the first survivor step that failed or saw a changed membership; recover: the first step "
             "committed after that; joiner: the relaunched worker's first committed step; steps redone: committed "
             "steps lost + the step in flight, once per failed try. none / chaos-none: the fault-free references "
             "(nothing to compare, '-').\n"
             "# samples/s: committed from the first committed step (torchft: first full quorum) on, start-up left "
             "out, median (min-max) over the runs; kept: chaos samples/s over the fault-free samples/s of the same repetition, median (min-max) over "
             "the repetitions; lost/dup: samples per id over all runs; bitwise=: final model against the "
             "fault-free run's")
    return "\n".join([failures, "", throughput, notes])
