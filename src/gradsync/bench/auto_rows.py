"""``auto`` against the fastest algorithm measured beside it in one ``gradsync bench allreduce`` run."""

from __future__ import annotations

from gradsync.bench.output import format_rows

AUTO_RIVALS = ("ring", "tree", "halving_doubling", "hierarchical", "shm")  # what auto may choose from


def auto_rows(rows: list[dict]) -> list[dict]:
    """For every (layout, size) with an ``auto`` row: auto's time over the best rival measured in the same
    run (``auto_vs_best`` <= 1.10 is the model's goal at >= 64 KiB), and which rival that was."""
    out = []
    for auto in (row for row in rows if row["algorithm"] == "auto"):
        same = [row for row in rows if row["algorithm"] in AUTO_RIVALS and row["nbytes"] == auto["nbytes"]
                and row["world_size"] == auto["world_size"] and row.get("hosts", 1) == auto.get("hosts", 1)]
        if same:
            best = min(same, key=lambda row: row["time_us"])
            out.append({"hosts": auto.get("hosts", 1), "world_size": auto["world_size"], "nbytes": auto["nbytes"],
                        "auto_us": auto["time_us"], "best": best["algorithm"], "best_us": best["time_us"],
                        "auto_vs_best": auto["time_us"] / best["time_us"]})
    return out


def format_auto_table(rows: list[dict]) -> str:
    """``auto`` against the fastest algorithm measured beside it (rows of :func:`auto_rows`)."""
    return format_rows(rows, [
        ("hosts", 6, lambda row: f"{row['hosts']}x{row['world_size'] // row['hosts']}"),
        ("size [B]", 12, "{nbytes}"), ("auto [us]", 11, "{auto_us:.1f}"), ("best", 17, "{best}"),
        ("best [us]", 11, "{best_us:.1f}"), ("auto/best", 10, "{auto_vs_best:.2f}x")])
