"""What the at-scale table shows: the fastest algorithm per point, the crossovers, the PNG.

Where the ring stops being the fastest (its latency term 2(p-1)α overtakes its
bandwidth term 2(p-1)/p·n·β), where hierarchical, the trees and NCCL's choice
win, and the PNG: time against GPU count per algorithm at three sizes, and the
fastest per GPU count and size (matplotlib, Agg backend).

Rows are :class:`~gradsync.bench.scale.ScaleRow` (or anything with ``gpus``, ``algorithm``,
``nbytes``, ``time_us``).
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

from gradsync.bench.output import format_rows
from gradsync.collectives.cost.profile import Profile

ORDER = ("ring", "tree", "double_binary_tree", "halving_doubling", "hierarchical", "nccl")  # columns, legend


def fastest(rows) -> dict[tuple[int, int], object]:
    """``{(gpus, nbytes): the row with the smallest time_us}``."""
    best: dict[tuple[int, int], object] = {}
    for row in rows:
        key = (row.gpus, row.nbytes)
        if key not in best or row.time_us < best[key].time_us:
            best[key] = row
    return best


def ring_overtaken(rows) -> list[tuple[int, int | None, object | None, object | None]]:
    """Per size (ascending): (nbytes, the smallest GPU count from which the ring is never again the
    fastest, the ring's row there, the winner's row there); GPU count None where the ring is fastest
    at the largest count; among gradsync's algorithms (not ``nccl``, NCCL's own choice). Sizes without
    a ring row are left out."""
    best = fastest(ours(rows))
    ring = {(row.gpus, row.nbytes): row for row in rows if row.algorithm == "ring"}
    result = []
    for nbytes in sorted({n for _, n in ring}):
        counts = sorted(g for g, n in ring if n == nbytes)
        lost_from = None
        for count in reversed(counts):
            if best[(count, nbytes)].algorithm == "ring":
                break
            lost_from = count
        if lost_from is None:
            result.append((nbytes, None, None, None))
        else:
            result.append((nbytes, lost_from, ring[(lost_from, nbytes)], best[(lost_from, nbytes)]))
    return result


def ring_latency_crossover_bytes(profile: Profile, gpus: int) -> float:
    """The size below which the flat ring's latency term 2(p-1)α exceeds its bandwidth term
    2(p-1)/p·n/bw, on its slowest link (inter-host once there are hosts): n* = p·α·bw (bytes)."""
    link = profile.intra if gpus <= profile.ranks_per_host or profile.inter is None else profile.inter
    return gpus * link.alpha_s * link.bandwidth_bytes_per_s


def ours(rows) -> list:
    """The rows of gradsync's algorithms (all but ``nccl``, NCCL's own choice)."""
    return [row for row in rows if row.algorithm != "nccl"]


def win_ranges(rows, algorithm: str) -> dict[int, list[int]]:
    """``{gpus: sizes at which algorithm is the fastest}`` (GPU counts where it never wins left out): of
    gradsync's algorithms for one of them, of all rows for ``nccl``."""
    wins: dict[int, list[int]] = {}
    for (count, nbytes), row in sorted(fastest(rows if algorithm == "nccl" else ours(rows)).items()):
        if row.algorithm == algorithm:
            wins.setdefault(count, []).append(nbytes)
    return wins


def format_size(nbytes: int) -> str:
    for unit, scale in (("G", 2**30), ("M", 2**20), ("K", 2**10)):
        if nbytes >= scale and nbytes % scale == 0:
            return f"{nbytes // scale}{unit}"
    return str(nbytes)


def _size(nbytes: float) -> str:
    """4096 -> "4K"; 1.5 MiB -> "1.50M" (sizes that are not whole units get decimals)."""
    whole = nbytes == int(nbytes) and (nbytes < 1024 or int(nbytes) % (2**20 if nbytes >= 2**20 else 1024) == 0)
    if whole:
        return format_size(int(nbytes))
    return f"{nbytes / 2**20:.2f}M" if nbytes >= 2**20 else f"{nbytes / 2**10:.1f}K"


def crossover_lines(rows, profile: Profile | None = None) -> list[str]:
    """The printed summary: ring's crossover per size, the latency term per GPU count (from ``profile``;
    left out without one), and the wins of the others."""
    lines = ["# where the ring stops being the fastest of gradsync's algorithms (from this table):"]
    for nbytes, count, ring, winner in ring_overtaken(rows):
        if count is None:
            lines.append(f"#   {_size(nbytes):>6}: ring is the fastest at the largest GPU count")
        else:
            lines.append(f"#   {_size(nbytes):>6}: from {count} GPUs on: ring {ring.time_us:.1f} us "
                         f"({ring.method}) vs {winner.algorithm} {winner.time_us:.1f} us "
                         f"({ring.time_us / winner.time_us:.1f}x)")
    if profile is not None:
        lines += latency_term_lines(rows, profile)
    present = {row.algorithm for row in rows}
    for algorithm in (name for name in ("hierarchical", "double_binary_tree", "tree", "halving_doubling", "nccl",
                                        "ring") if name in present):
        wins = win_ranges(rows, algorithm)
        if not wins:
            lines.append(f"# {algorithm} is never the fastest")
            continue
        parts = [f"{count} GPUs: " + (f"{_size(sizes[0])}-{_size(sizes[-1])} ({len(sizes)} sizes)" if len(sizes) > 1
                                      else f"{_size(sizes[0])}") for count, sizes in wins.items()]
        lines.append(f"# {algorithm} is the fastest{' of gradsync' if algorithm != 'nccl' else ''} at "
                     + "; ".join(parts))
    if "nccl" in present:
        lines.append(nccl_line(rows))
    return lines


def nccl_line(rows) -> str:
    """How NCCL's own choice compares with gradsync's fastest algorithm at every point both have."""
    mine, theirs = fastest(ours(rows)), {(r.gpus, r.nbytes): r for r in rows if r.algorithm == "nccl"}
    ratios = sorted(mine[key].time_us / theirs[key].time_us for key in theirs if key in mine)
    if not ratios:
        return "# nccl: no point with both NCCL's choice and a gradsync algorithm"
    return (f"# gradsync's fastest / NCCL's choice: {ratios[0]:.2f}x to {ratios[-1]:.2f}x "
            f"(median {ratios[len(ratios) // 2]:.2f}x) over {len(ratios)} points (NCCL's LL/LL128 protocols "
            "and in-switch reduction have no gradsync counterpart)")


def latency_term_lines(rows, profile: Profile) -> list[str]:
    """Per GPU count of ``rows``: the ring's latency term on ``profile`` and the size n* below which it dominates."""
    lines = ["# the ring's latency term 2(p-1)a exceeds its bandwidth term 2(p-1)/p*n/bw below n* = p*a*bw:"]
    for count in sorted({row.gpus for row in rows}):
        link = profile.intra if count <= profile.ranks_per_host or profile.inter is None else profile.inter
        lines.append(f"#   {count:>5} GPUs: latency term {2 * (count - 1) * link.alpha_s * 1e6:.0f} us, "
                     f"n* = {_size(ring_latency_crossover_bytes(profile, count))}")
    return lines


def rows_of(dicts: list[dict]) -> list[SimpleNamespace]:
    """Rows with attributes from the JSON rows of ``gradsync simulate --json`` (what these functions read)."""
    return [SimpleNamespace(**row) for row in dicts]


def format_fastest(rows) -> str:
    """One line per (GPU count, size): every algorithm's time (us; ``*``: the closed form, else the event
    simulation; nccl: its tuning model's, with its pick in ``nccl pick``) and the fastest."""
    algorithms = [name for name in ORDER if any(row.algorithm == name for row in rows)]
    by_point: dict[tuple[int, int], dict[str, object]] = {}
    for row in rows:
        by_point.setdefault((row.gpus, row.nbytes), {})[row.algorithm] = row
    best = fastest(rows)

    def cell(name: str):
        def text(point: dict) -> str:
            row = point["rows"].get(name)
            return "-" if row is None else f"{row.time_us:.1f}" + ("*" if row.method == "formula" else " ")
        return text

    def pick(point: dict) -> str:
        row = point["rows"].get("nccl")
        return getattr(row, "detail", "") or "-"

    points = [{"gpus": gpus, "size": _size(nbytes), "rows": by_point[(gpus, nbytes)],
               "fastest": best[(gpus, nbytes)].algorithm} for gpus, nbytes in sorted(by_point)]
    columns = [("gpus", 5, "{gpus}"), ("size", 6, "{size}")] + [(f"{name} [us]", max(len(name) + 5, 12), cell(name))
                                                                 for name in algorithms]
    columns += [("nccl pick", 18, pick)] if "nccl" in algorithms else []
    if "nccl" in algorithms:
        ours_best = fastest(ours(rows))
        for point in points:
            key = (point["gpus"], next(iter(point["rows"].values())).nbytes)
            point["ours"] = ours_best[key].algorithm if key in ours_best else "-"
        columns += [("fastest of gradsync", 19, "{ours}")]
    return (format_rows(points, columns + [("fastest", 18, "{fastest}")])
            + "\n# time of one all_reduce in us; *: the closed form (beyond the event simulation's budget)"
            + ("; nccl: NCCL's tuning model's time for its pick (algorithm/protocol x channels)"
               if "nccl" in algorithms else ""))


def plot_sizes(sizes: list[int], panels: int = 3) -> list[int]:
    """The smallest, a middle and the largest size (at most ``panels`` distinct sizes)."""
    if len(sizes) <= panels:
        return sorted(sizes)
    ordered = sorted(sizes)
    picks = [ordered[round(i * (len(ordered) - 1) / (panels - 1))] for i in range(panels)]
    return sorted(set(picks))


def plot(rows, path: str, title: str) -> Path:
    """Draw time (us) against GPU count per algorithm, log-log, one panel per chosen size; return the path.

    Raises:
        ValueError: no rows, or the file cannot be written.
    """
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if not rows:
        raise ValueError("nothing to plot")
    sizes = plot_sizes(sorted({row.nbytes for row in rows}))
    figure, axes = plt.subplots(1, len(sizes) + 1, figsize=(5 * (len(sizes) + 1), 4), squeeze=False)
    colors = {name: f"C{index}" for index, name in enumerate(ORDER)}
    for axis, nbytes in zip(axes[0], sizes):
        for algorithm in [name for name in ORDER if any(r.algorithm == name for r in rows)]:
            points = sorted((r.gpus, r.time_us, r.method) for r in rows
                            if r.algorithm == algorithm and r.nbytes == nbytes)
            line, = axis.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=algorithm,
                              color=colors[algorithm])
            formula = [p for p in points if p[2] == "formula"]
            axis.scatter([p[0] for p in formula], [p[1] for p in formula], marker="x", s=60, color="black",
                         zorder=3)
        axis.set_xscale("log", base=2)
        axis.set_yscale("log")
        axis.set_xlabel("GPUs")
        axis.set_ylabel("time (us)")
        axis.set_title(f"{title}: all_reduce {_size(nbytes)}")
        axis.grid(True, which="both", alpha=0.3)
        axis.legend(fontsize=8, title="x: formula", title_fontsize=7)
    _winners(axes[0][-1], rows, colors, title)
    figure.tight_layout()
    target = Path(path)
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        figure.savefig(target, dpi=100)
    except OSError as error:
        raise ValueError(f"--plot {path}: cannot write the PNG: {error.strerror or error}") from None
    finally:
        plt.close(figure)
    return target


def _winners(axis, rows, colors: dict, title: str) -> None:
    """The fastest of gradsync's algorithms per (GPU count, size) as coloured cells; where NCCL's choice is
    in the rows, each cell says how many times NCCL's predicted time gradsync's fastest takes."""
    from matplotlib.patches import Patch, Rectangle

    best = fastest(ours(rows))
    nccl = {(row.gpus, row.nbytes): row for row in rows if row.algorithm == "nccl"}
    counts, sizes = sorted({g for g, _ in best}), sorted({n for _, n in best})
    for x, count in enumerate(counts):
        for y, nbytes in enumerate(sizes):
            row = best[(count, nbytes)]
            axis.add_patch(Rectangle((x - 0.5, y - 0.5), 1, 1, color=colors[row.algorithm]))
            if (count, nbytes) in nccl:
                axis.text(x, y, f"{row.time_us / nccl[(count, nbytes)].time_us:.2f}x", ha="center", va="center",
                          fontsize=7, color="white")
    axis.set_xlim(-0.5, len(counts) - 0.5)
    axis.set_ylim(-0.5, len(sizes) - 0.5)
    axis.set_xticks(range(len(counts)), [str(count) for count in counts])
    axis.set_yticks(range(len(sizes)), [_size(nbytes) for nbytes in sizes])
    axis.set_xlabel("GPUs")
    axis.set_ylabel("all_reduce size")
    axis.set_title(f"{title}: gradsync's fastest" + (" (x: its time / NCCL's choice)" if nccl else ""),
                   fontsize=9)
    present = [name for name in ORDER if any(row.algorithm == name for row in best.values())]
    axis.legend(handles=[Patch(color=colors[name], label=name) for name in present], fontsize=8,
                loc="upper left", bbox_to_anchor=(1.0, 1.0))
