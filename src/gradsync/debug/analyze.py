"""``gradsync debug DIR``: from every rank's flight record, which rank stopped where and what the ranks disagree on.

The report fits one screen::

    gradsync debug: 3 of 4 ranks dumped in runs/x/flight, written within 0.1 s
    rank 2 is in all_reduce #1841 bucket 3; ranks 0, 1 are in broadcast #1842; rank 3 wrote no dump
    disagreement at #1842: ranks 0, 1 reached broadcast #1842; rank 2 did not (last call: all_reduce #1841 bucket 3)
    rank 3 wrote no dump (frozen, killed, or its folder is not this one): ranks 0, 1 were waiting on it in
    broadcast #1842, so it never reached broadcast #1842 or froze inside it; the timeout of rank 2 in
    all_reduce #1841 bucket 3 named it; the last call every rank that dumped finished is all_reduce #1840 bucket 0
      ranks  last call                  state                     entered   host
      2      all_reduce #1841 bucket 3  failed waiting on peer 0  +0.000 s  node1
      0, 1   broadcast #1842            failed waiting on peer 3  +1.000 s  node0
    errors:
      rank 2: CollectiveTimeoutError: all_reduce (algorithm=ring) on rank 2 of 4: peer rank 3 stopped ...
      rank 0 (and 1 more): CollectiveTimeoutError: broadcast (algorithm=tree) on rank 0 of 4: ...

Sequence numbers are the calls' ordinals on their communicator, equal on every
rank of a correct program, so records of one seq on several ranks are one
collective. The calls every rank finished or went on from are settled (an old
mismatch the program caught is not why it stopped); after them, the first seq
whose op, algorithm, dtype, shape or label differ across ranks (or that some
ranks never reached) is the disagreement. A rank
without a dump (frozen, killed, or its file unreadable) is placed by its
peers' records: the ranks whose last call waited on it (and whether they saw
its connection close), those whose timeout named it, and the last call every
other rank finished.
"""

from __future__ import annotations

from pathlib import Path

from gradsync.debug.dumps import Folder, RankDump, load_folder

MAX_ROWS = 12  # groups of ranks shown in the table (the rest are counted): one screen
ERROR_CHARS = 160
_COMPARED = ("op", "algorithm", "dtype", "shape", "label")


class NoDumpsError(ValueError):
    """The folder holds no readable flight record."""


def rank_list(ranks) -> str:
    """``rank 2``, ``ranks 0, 1, 3``; runs of four or more collapse: ``ranks 0-5, 7``."""
    ranks = sorted(ranks)
    parts, start = [], 0
    while start < len(ranks):
        stop = start
        while stop + 1 < len(ranks) and ranks[stop + 1] == ranks[stop] + 1:
            stop += 1
        if stop - start >= 3:
            parts.append(f"{ranks[start]}-{ranks[stop]}")
        else:
            parts.extend(str(rank) for rank in ranks[start:stop + 1])
        start = stop + 1
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(parts)


def _are(ranks) -> str:
    return "is" if len(ranks) == 1 else "are"


def position(record: dict) -> str:
    """``all_reduce #1841 bucket 3``."""
    return f"{record['op']} #{record['seq']}" + (f" {record['label']}" if record["label"] else "")


def state_text(record: dict) -> str:
    """``waiting on peer 2``, ``failed waiting on peer 2``, ``failed``, ``done``, ``started``."""
    state, peer = record["state"], record["peer"]
    if peer is not None and state in ("waiting", "failed"):
        return f"{'failed ' if state == 'failed' else ''}waiting on peer {peer}"
    return state


def _shown(field: str, value) -> str:
    if value is None:
        return "none"
    return f"({', '.join(map(str, value))}{',' if len(value) == 1 else ''})" if field == "shape" else str(value)


def _by_value(values: dict[int, object]) -> list[tuple[object, list[int]]]:
    """(value, ranks) groups, the smallest group first (the odd ones out lead)."""
    groups: dict[object, list[int]] = {}
    for rank, value in sorted(values.items()):
        groups.setdefault(value, []).append(rank)
    return sorted(groups.items(), key=lambda item: (len(item[1]), item[1][0]))


def _difference(present: dict[int, dict]) -> str | None:
    """How the records of one seq differ across ranks (the first differing field), or None."""
    for field in _COMPARED:
        groups = _by_value({rank: record[field] for rank, record in present.items()})
        if len(groups) < 2:
            continue
        if field == "op":
            return f"#{next(iter(present.values()))['seq']}: " + "; ".join(
                f"{rank_list(ranks)} {_are(ranks)} in {position(present[ranks[0]])}" for _, ranks in groups)
        return f"{position(present[groups[-1][1][0]])}: {field}: " + "; ".join(
            f"{rank_list(ranks)} {'has' if len(ranks) == 1 else 'have'} {_shown(field, value)}"
            for value, ranks in groups)
    return None


def _signature(record: dict) -> tuple:
    return tuple(record[field] for field in _COMPARED)


def agreed_seq(dumps: dict[int, RankDump]) -> int:
    """The highest seq that every rank with records finished (done) with equal op, algorithm, dtype,
    shape and label (0: none such in the records)."""
    kept = [dump for dump in dumps.values() if dump.records]
    if not kept:
        return 0
    common = set.intersection(*(set(dump.records) for dump in kept))
    for seq in sorted(common, reverse=True):
        records = [dump.records[seq] for dump in kept]
        if all(record["state"] == "done" for record in records) and len({_signature(r) for r in records}) == 1:
            return seq
    return 0


def settled_seq(dumps: dict[int, RankDump]) -> int:
    """The highest seq that every rank with records finished or left behind (a failure the program went on
    from is settled: an old mismatch is not the cause of the current stop); 0: none such."""
    kept = [dump for dump in dumps.values() if dump.records]
    if not kept:
        return 0
    for seq in sorted(set.intersection(*(set(dump.records) for dump in kept)), reverse=True):
        if all(seq < max(dump.records) or dump.records[seq]["state"] == "done" for dump in kept):
            return seq
    return 0


def disagreement(dumps: dict[int, RankDump], settled: int) -> str | None:
    """The first seq after ``settled`` whose records differ across ranks, or that some ranks never reached."""
    kept = {rank: dump for rank, dump in dumps.items() if dump.records}
    for seq in sorted(seq for seq in set().union(*(dump.records for dump in kept.values())) if seq > settled):
        present = {rank: dump.records[seq] for rank, dump in kept.items() if seq in dump.records}
        differs = _difference(present)
        if differs:
            return f"disagreement at {differs}"
        behind = {rank: dump.last for rank, dump in kept.items() if max(dump.records) < seq}
        if behind:
            groups = _by_value({rank: position(record) for rank, record in behind.items()})
            lasts = (f"last call: {groups[0][0]}" if len(groups) == 1 else
                     "last calls: " + "; ".join(f"{rank_list(ranks)}: {place}" for place, ranks in groups))
            return (f"disagreement at #{seq}: {rank_list(present)} reached {position(next(iter(present.values())))}; "
                    f"{rank_list(behind)} did not ({lasts})")
    return None


def _missing_text(missing: int, dumps: dict[int, RankDump], agreed: int, unreadable: bool) -> str:
    """Where the peers' records place a rank that wrote no (readable) dump; the rank itself is not named."""
    lasts = {rank: dump.last for rank, dump in dumps.items() if dump.last is not None}
    waiters = {rank: record for rank, record in lasts.items() if record["peer"] == missing}
    blamers = {rank: record for rank, record in lasts.items() if record["blamed"] == missing and rank not in waiters}
    closed = [rank for rank, record in waiters.items() if record["timed_out"] is False]
    how = "its dump is unreadable" if unreadable else "frozen, killed, or its folder is not this one"
    if closed:
        how = f"its process died or left: {rank_list(closed)} saw the connection close"
    parts = []
    groups = _by_value({rank: position(record) for rank, record in waiters.items()})
    for place, ranks in groups:
        parts.append(f"{rank_list(ranks)} {'was' if len(ranks) == 1 else 'were'} waiting on it in {place}")
    if len(groups) == 1:
        parts[0] += (f", so it left before or during {groups[0][0]}" if closed else
                     f", so it never reached {groups[0][0]} or froze inside it")
    for place, ranks in _by_value({rank: position(record) for rank, record in blamers.items()}):
        parts.append(f"the timeout of {rank_list(ranks)} in {place} named it")
    text = f"({how}): " + ("; ".join(parts) if parts else "no rank that dumped was waiting on it")
    if agreed:
        record = next(dump.records[agreed] for dump in dumps.values() if agreed in dump.records)
        text += f"; the last call every rank that dumped finished is {position(record)}"
    return text


def _headline(groups, missing: list[int]) -> str:
    parts = []
    for key, ranks, records in groups:
        if key is None:
            parts.append(f"{rank_list(ranks)} recorded no call")
        elif all(record["state"] == "done" for record in records):
            parts.append(f"{rank_list(ranks)} finished {position(records[0])} and started no call after it")
        else:
            parts.append(f"{rank_list(ranks)} {_are(ranks)} in {position(records[0])}")
    if missing:
        parts.append(f"{rank_list(missing)} wrote no dump")
    return "; ".join(parts)


def _groups(dumps: dict[int, RankDump]):
    """[(key, ranks, their last records)] of ranks whose last call is the same (seq, op, label)."""
    by_key: dict[object, list[int]] = {}
    for rank, dump in sorted(dumps.items()):
        last = dump.last
        by_key.setdefault(None if last is None else (last["seq"], last["op"], last["label"]), []).append(rank)
    ordered = sorted(by_key.items(), key=lambda item: (len(item[1]), item[1][0]))
    return [(key, ranks, [dumps[rank].last for rank in ranks]) for key, ranks in ordered]


def _table(groups, dumps: dict[int, RankDump]) -> list[str]:
    starts = [record["start_wall"] for _, _, records in groups for record in records if record and record["start_wall"]]
    origin = min(starts) if starts else None
    rows = [("ranks", "last call", "state", "entered", "host")]
    for key, ranks, records in groups[:MAX_ROWS]:
        if key is None:
            rows.append((rank_list(ranks).split(" ", 1)[1], "-", "no call recorded", "", ""))
            continue
        times = [record["start_wall"] - origin for record in records if record["start_wall"] and origin is not None]
        entered = "" if not times else (f"+{min(times):.3f} s" if max(times) - min(times) < 5e-4 else
                                        f"+{min(times):.3f}..{max(times):.3f} s")
        states = sorted({state_text(record) for record in records})
        hosts = sorted({dumps[rank].hostname or "?" for rank in ranks})
        rows.append((rank_list(ranks).split(" ", 1)[1], position(records[0]),
                     states[0] if len(states) == 1 else "mixed: " + ", ".join(states), entered,
                     ", ".join(hosts[:3]) + (f" (+{len(hosts) - 3})" if len(hosts) > 3 else "")))
    widths = [max(len(row[column]) for row in rows) for column in range(5)]
    lines = ["  " + "  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip() for row in rows]
    if len(groups) > MAX_ROWS:
        lines.append(f"  ... and {len(groups) - MAX_ROWS} more groups of ranks")
    return lines


def _errors(groups, dumps: dict[int, RankDump]) -> list[str]:
    lines = []
    for _, ranks, _ in groups[:MAX_ROWS]:
        raised = [rank for rank in ranks if dumps[rank].error]
        if raised:
            text = dumps[raised[0]].error.strip().splitlines()[0]
            text = text if len(text) <= ERROR_CHARS else text[:ERROR_CHARS - 1] + "…"
            others = f" (and {len(raised) - 1} more)" if len(raised) > 1 else ""
            lines.append(f"  rank {raised[0]}{others}: {text}")
    return ["errors:"] + lines if lines else []


def world_size_of(found: Folder) -> tuple[int, list[str]]:
    """The group's size (what most dumps say; at least the highest rank + 1) and notes on doubts."""
    sizes: dict[int, int] = {}
    for dump in found.dumps.values():
        if dump.world_size:
            sizes[dump.world_size] = sizes.get(dump.world_size, 0) + 1
    highest = max(found.dumps) + 1
    if not sizes:
        return highest, [f"no dump says the world size: assumed {highest} (the highest rank + 1)"]
    size = max(sizes, key=lambda value: (sizes[value], value))
    notes = [] if len(sizes) == 1 else [f"the dumps disagree on the world size ({', '.join(map(str, sorted(sizes)))}):"
                                        f" files of different jobs?"]
    return max(size, highest), notes


def report(found: Folder) -> list[str]:
    """The lines of the one-screen report of ``found`` (at least one dump).

    Raises:
        NoDumpsError: ``found`` has no readable dump.
    """
    dumps = found.dumps
    if not dumps:
        bad = "; ".join(f"{name}: {why}" for name, why in found.bad[:MAX_ROWS])
        raise NoDumpsError(f"no readable flight record in {found.path} (looked for rank-*.json there"
                           + ("" if found.path.name == "flight" else " and in its flight folder") + ")"
                           + (f"; unreadable: {bad}" if bad else ""))
    world_size, notes = world_size_of(found)
    unreadable = {int(name[5:-5]) for name, _ in found.bad if name[5:-5].isdigit()}
    missing = [rank for rank in range(world_size) if rank not in dumps]
    written = [dump.written_wall for dump in dumps.values() if dump.written_wall]
    within = f", written within {max(written) - min(written):.1f} s" if len(written) > 1 else ""
    lines = [f"gradsync debug: {len(dumps)} of {world_size} ranks dumped in {found.path}{within}"]
    groups = _groups(dumps)
    lines.append(_headline(groups, missing))
    agreed = agreed_seq(dumps)
    differs = disagreement(dumps, settled_seq(dumps))
    if differs:
        lines.append(differs)
    elif len(dumps) > 1:
        lines.append("the ranks that dumped agree on every call they recorded" +
                     (": the ranks without a dump are the likely cause" if missing else ""))
    by_text: dict[str, list[int]] = {}
    for rank in missing:
        by_text.setdefault(_missing_text(rank, dumps, agreed, rank in unreadable), []).append(rank)
    lines += [f"{rank_list(ranks)} wrote no dump {text}" for text, ranks in by_text.items()]
    lines += _table(groups, dumps) + _errors(groups, dumps)
    lines += [f"note: {note}" for note in notes]
    lines += [f"note: {dump.path.name}: {note}" for dump in dumps.values() for note in dump.notes]
    lines += [f"unreadable: {name}: {reason}" for name, reason in found.bad]
    return lines


def render(folder: str | Path) -> str:
    """The report of the dumps in ``folder`` (a run folder or its ``flight`` folder), as text.

    Raises:
        ValueError: ``folder`` is not a folder; NoDumpsError: it holds no readable dump.
    """
    return "\n".join(report(load_folder(folder)))


__all__ = ["NoDumpsError", "agreed_seq", "disagreement", "position", "rank_list", "render", "report",
           "settled_seq", "state_text", "world_size_of"]
