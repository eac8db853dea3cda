"""``gradsync simulate --validate``'s points: which calibrate, which are predicted, and the predictions.

A point is (collective, algorithm, nbytes, world_size, hosts). The calibration's points are
:func:`gradsync.bench.calibrate.calibration_points` (its ping-pongs, compute loops and whole calls);
the validated points are every size of ``--validate-sizes`` x every layout (1 x 2, 1 x 3, 1 x 4 and
2 x 2 test hosts) x every collective x every algorithm the simulator runs for that collective there
(AllReduce: :data:`gradsync.sim.engine.SIMULATED`; reduce-scatter and all-gather: those
:func:`~gradsync.sim.engine.simulate_all_reduce`'s ``collective=`` accepts, asked of the engine itself
so the list follows it). ``native`` is not among them: it hands the call to the backend (Gloo,
NCCL), which the simulator's transport refuses, so there is nothing of gradsync's own to price.

The two sets must be disjoint (:func:`check_disjoint`): a validation scored on the points its
profile was fitted to would measure the fit, not the model.
"""

from __future__ import annotations

from gradsync.bench.output import format_rows as table
from gradsync.bench.sim_validation import HOSTS, ONE_HOST_WORLD_SIZES, RANKS_PER_HOST, ValidationRow
from gradsync.bench.sweep_collectives import COLLECTIVES, message_numel
from gradsync.collectives.cost.profile import Profile
from gradsync.collectives.cost.topology import Topology

NOT_MODELLED = {"native": "hands the call to the backend (Gloo, NCCL), whose calls the simulator's transport "
                          "refuses: no gradsync code to price"}
Point = tuple[str, str, int, int, int]  # collective, algorithm, nbytes, world_size, hosts


def layouts(with_hosts: bool) -> list[tuple[int, int]]:
    """(hosts, world size) of every validated layout: 1 x 2, 1 x 3, 1 x 4, then 2 x 2 ``with_hosts``."""
    return [(1, size) for size in ONE_HOST_WORLD_SIZES] + ([(HOSTS, HOSTS * RANKS_PER_HOST)] if with_hosts else [])


def topology_of(hosts: int, world_size: int) -> Topology:
    return Topology.uniform(hosts, world_size // hosts) if hosts > 1 else Topology((world_size,))


def simulated_algorithms(collective: str, hosts: int, world_size: int, profile: Profile) -> list[str]:
    """The algorithms of ``engine.SIMULATED`` the simulator runs for ``collective`` on ``hosts`` x
    ``world_size // hosts`` ranks with ``profile`` (asked of the engine: a one-float-per-rank call)."""
    from gradsync.sim import engine

    names = []
    for name in engine.SIMULATED:
        try:
            engine.simulate_all_reduce(name, 4 * world_size, profile, topology_of(hosts, world_size),
                                       collective=collective)
        except ValueError:
            continue
        names.append(name)
    return names


def validation_points(sizes: list[int], with_hosts: bool, profiles: dict[int, Profile]) -> list[Point]:
    """Every validated point, ``profiles[hosts]`` (one host: 1, test hosts: ``HOSTS``) deciding what the
    simulator runs there. ``nbytes`` is the message the bench times for each of ``sizes``
    (:func:`gradsync.bench.sweep_collectives.message_numel`: a multiple of p floats for reduce-scatter and
    all-gather)."""
    points = []
    for hosts, world_size in layouts(with_hosts):
        for collective in COLLECTIVES:
            for algorithm in simulated_algorithms(collective, hosts, world_size, profiles[hosts]):
                points += [(collective, algorithm, 4 * message_numel(collective, nbytes, world_size), world_size,
                            hosts) for nbytes in sizes]
    return points


def plan(points: list[Point]) -> dict[tuple[int, int], dict[str, list[str]]]:
    """(hosts, world size) -> collective -> the algorithms measured there, in the points' order."""
    out: dict[tuple[int, int], dict[str, list[str]]] = {}
    for collective, algorithm, _, world_size, hosts in points:
        names = out.setdefault((hosts, world_size), {}).setdefault(collective, [])
        if algorithm not in names:
            names.append(algorithm)
    return out


def as_point(point: dict) -> Point:
    """The tuple of a calibration point's dict (keys collective, algorithm, nbytes, world_size, hosts; a bool
    ``hosts`` is read as across the test hosts: ``HOSTS``, else 1)."""
    hosts = point["hosts"]
    if isinstance(hosts, bool):
        hosts = HOSTS if hosts else 1
    return point["collective"], point["algorithm"], int(point["nbytes"]), int(point["world_size"]), int(hosts)


def check_disjoint(validated: list[Point], calibration: list[Point]) -> None:
    """Refuse a validation scored on a calibration point.

    Raises:
        ValueError: (one line) naming how many validated points the calibration measures, and the first.
    """
    measured = set(calibration)
    shared = [point for point in validated if point in measured]
    if shared:
        collective, algorithm, nbytes, world_size, hosts = shared[0]
        raise ValueError(f"--validate-sizes: {len(shared)} validated point(s) are calibration points (first: "
                         f"{collective} {algorithm} {nbytes} B at {hosts}x{world_size // hosts}); the validation "
                         f"would score what the profile was fitted to: choose other sizes")


def split_rows(validated: list[Point], calibration: list[Point]) -> list[dict]:
    """The split printed at the top of the run and recorded: one row per (role, collective, algorithm, hosts)
    and set of sizes, with the world sizes measured at those sizes (``role``: "calibrate" or "validate";
    a reduce-scatter's sizes at 3 ranks, rounded to a multiple of 3 floats, get a row of their own)."""
    by_world: dict[tuple, set] = {}
    for role, points in (("calibrate", calibration), ("validate", validated)):
        for collective, algorithm, nbytes, world_size, hosts in points:
            by_world.setdefault((role, collective, algorithm, hosts, world_size), set()).add(nbytes)
    groups: dict[tuple, list[int]] = {}
    for (role, collective, algorithm, hosts, world_size), sizes in by_world.items():
        groups.setdefault((role, collective, algorithm, hosts, tuple(sorted(sizes))), []).append(world_size)
    return [{"role": role, "collective": collective, "algorithm": algorithm, "hosts": hosts,
             "world_sizes": sorted(world_sizes), "sizes": list(sizes)}
            for (role, collective, algorithm, hosts, sizes), world_sizes in groups.items()]


def size_text(nbytes: int) -> str:
    """``nbytes`` as ``--validate-sizes`` writes it: ``64K``, ``16M`` for whole KiB / MiB, else bytes.

    >>> size_text(65536), size_text(2**24), size_text(4092), size_text(4)
    ('64K', '16M', '4092', '4')
    """
    for unit, scale in (("M", 2**20), ("K", 2**10)):
        if nbytes >= scale and nbytes % scale == 0:
            return f"{nbytes // scale}{unit}"
    return str(nbytes)


def calibration_rows(calibration: list[Point]) -> list[dict]:
    """The JSON rows of the calibration's points (``role`` "calibrate"), kept in ``--json`` beside the
    validation rows."""
    return [{"role": "calibrate", "collective": collective, "algorithm": algorithm, "nbytes": nbytes,
             "world_size": world_size, "hosts": hosts}
            for collective, algorithm, nbytes, world_size, hosts in calibration]


def point_of(row: ValidationRow) -> Point:
    return row.collective, row.algorithm, row.nbytes, row.world_size, row.hosts


def format_split(rows: list[dict]) -> str:
    """The table of :func:`split_rows`, and the line naming what is not modelled."""
    def sizes(row: dict) -> str:
        return ",".join(size_text(size) for size in row["sizes"])

    text = table(rows, [("role", 9, "{role}"), ("collective", 14, "{collective}"), ("algorithm", 18, "{algorithm}"),
                        ("hosts", 5, "{hosts}"), ("world sizes", 11, lambda r: ",".join(map(str, r["world_sizes"]))),
                        ("sizes", 1, sizes)])
    notes = "".join(f"\n# not modelled, no rows: {name} ({why})" for name, why in NOT_MODELLED.items())
    shared = shared_sizes(rows)
    if shared:
        notes += ("\n# sizes that also calibrate, in other collectives or algorithms (no point shared): "
                  + ", ".join(size_text(size) for size in shared))
    return text + notes


def shared_sizes(rows: list[dict]) -> list[int]:
    """The sizes of :func:`split_rows` ``rows`` both calibrated and validated on the same hosts."""
    def sizes(role: str) -> set:
        return {(row["hosts"], size) for row in rows if row["role"] == role for size in row["sizes"]}

    return sorted({size for _, size in sizes("calibrate") & sizes("validate")})


def predict(rows: list[dict], profile: Profile) -> list[ValidationRow]:
    """A :class:`ValidationRow` per bench row (``gradsync.bench.allreduce.Row`` dicts, with ``runs_us``
    where :func:`~gradsync.bench.sim_validation.with_runs` added them) of a simulated algorithm,
    predicted on ``profile`` with the row's topology (hosts x ranks per host) and collective."""
    from gradsync.sim import engine

    out = []
    for row in rows:
        if row["algorithm"] not in engine.SIMULATED:
            continue
        hosts, collective = row.get("hosts", 1), row.get("collective", "all_reduce")
        result = engine.simulate_all_reduce(row["algorithm"], row["nbytes"], profile,
                                            topology_of(hosts, row["world_size"]), collective=collective)
        out.append(ValidationRow.of_runs(row["algorithm"], row["nbytes"], row["world_size"], hosts,
                                         result.time_s * 1e6, list(row.get("runs_us") or [row["time_us"]]),
                                         collective))
    return out
