"""The simulator's model of the shm AllReduce: the lean path, cache-sized cells, the memory bound.

Every expected time is written out here from the model's definition (per cell: its overhead, stage the
peers' chunks, barrier, reduce the own chunk, barrier, copy out; 3 DRAM bytes per payload byte), not taken
from the formulas under test.
"""

from __future__ import annotations

import dataclasses
import json

import pytest

from gradsync.collectives.cost.formulas import call_overhead_s, predict_s
from gradsync.collectives.cost.profile import Link, Profile, ShmModel
from gradsync.collectives.cost.profiles import get_profile
from gradsync.collectives.cost.shm_formulas import SHM_MEMORY_BYTES_PER_PAYLOAD_BYTE, shm_cells, shm_lean
from gradsync.collectives.cost.topology import Topology
from gradsync.collectives.shm_setup import DEFAULT_CELL_BYTES, LEAN_MAX_BYTES, ShmState
from gradsync.sim.engine import simulate_all_reduce

COPY, GAMMA, BARRIER, CELL, CALL, LEAN = 1e-10, 2e-10, 1e-6, 5e-6, 30e-6, 10e-6


def _profile(memory_bytes_per_s: float = 1e15, cores: int = 8) -> Profile:
    return Profile("t", "", Link(1e-5, 1e9, True), None, gamma_s_per_byte=GAMMA, copy_s_per_byte=COPY,
                   ranks_per_host=8, cores_per_host=cores, call_overhead_s=CALL,
                   shm=ShmModel(barrier_s=BARRIER, memory_bandwidth_bytes_per_s=memory_bytes_per_s,
                                oversubscribed_barrier_s=4 * BARRIER, cell_overhead_s=CELL,
                                lean_call_overhead_s=LEAN))


def _both(algorithm: str, profile: Profile, p: int, nbytes: int, **options) -> tuple[float, float]:
    """(event simulation, formula) seconds."""
    event = simulate_all_reduce(algorithm, nbytes, profile, Topology((p,)), **options).time_s
    return event, predict_s(algorithm, profile, Topology((p,)), nbytes)


@pytest.mark.parametrize("p", [2, 3, 4])
def test_lean_path_is_one_barrier_and_every_rank_adds_all_rows(p):
    n = LEAN_MAX_BYTES
    expected = LEAN + n * COPY + BARRIER + (p - 1) * n * GAMMA
    assert shm_lean(n) and not shm_lean(n + 4) and not shm_lean(n, public=False) and not shm_lean(0)
    for seconds in _both("shm", _profile(), p, n):
        assert seconds == pytest.approx(expected, rel=1e-9)


def _cell(p: int, c: float, slow: float = 1.0, barrier: float = BARRIER) -> float:
    """One pipelined cell written out: p cell overheads, stage (p-1)/p·c, barrier, reduce the own chunk
    ((p-1)/p·c added, c/p copied into the region), barrier, copy (p-1)/p·c out."""
    share = c / p
    return (slow * (p * CELL + (c - share) * COPY + (p - 1) * share * GAMMA + share * COPY + (c - share) * COPY)
            + 2 * barrier)


@pytest.mark.parametrize("p", [2, 3, 4, 5])
def test_cells_above_the_lean_path(p):
    """A message of 2 full cells and one of 12 bytes, each an owner-reduces reduce-scatter + all-gather."""
    n = 2 * DEFAULT_CELL_BYTES + 12
    assert n > LEAN_MAX_BYTES and shm_cells(n, 4) == [DEFAULT_CELL_BYTES] * 2 + [12]
    expected = CALL + 2 * _cell(p, DEFAULT_CELL_BYTES) + _cell(p, 12)
    for seconds in _both("shm", _profile(), p, n):
        assert seconds == pytest.approx(expected, rel=1e-9)


def test_hierarchical_on_one_host_goes_through_cells_even_when_small():
    """hierarchical's node sum calls shm inside a collective: never the lean path, the full call overhead."""
    event, formula = _both("hierarchical", _profile(), 2, 4)
    expected = CALL + _cell(2, 4)
    assert event == pytest.approx(expected, rel=1e-9) and formula == pytest.approx(expected, rel=1e-9)
    pair = Topology((2,))
    assert call_overhead_s(_profile(), "shm", pair, 4) == LEAN
    assert call_overhead_s(_profile(), "hierarchical", pair, 4) == CALL
    assert call_overhead_s(_profile(), "shm", pair, LEAN_MAX_BYTES + 4) == CALL
    assert call_overhead_s(_profile(cores=2), "shm", Topology((3,)), 4) == pytest.approx(1.5 * LEAN)  # 3 on 2 cores


def test_the_groups_cell_bytes_option_sets_the_cells():
    n = 64 * 2**10 * 8
    few = simulate_all_reduce("shm", n, _profile(), Topology((2,))).time_s
    many = simulate_all_reduce("shm", n, _profile(), Topology((2,)), options=[ShmState(cell_bytes=n // 64)]).time_s
    extra_cells = 64 - len(shm_cells(n, 4))
    assert many - few == pytest.approx(extra_cells * (2 * CELL + 2 * BARRIER), rel=1e-9)


def test_large_messages_are_memory_bound_at_3_bytes_per_payload_byte():
    """With slow memory, the copy-in phase moves 1 DRAM byte per byte and the output's write 2, for all
    p ranks at once: p * 3 * n / bandwidth (the fixed costs per cell apart)."""
    bandwidth, p, n = 1e9, 2, 64 * 2**20
    assert SHM_MEMORY_BYTES_PER_PAYLOAD_BYTE == 3
    cells = len(shm_cells(n, 4))
    expected = CALL + cells * (p * CELL + 2 * BARRIER) + p * 3 * n / bandwidth
    for seconds in _both("shm", _profile(bandwidth), p, n):
        assert seconds == pytest.approx(expected, rel=1e-9)
    small = 2 * DEFAULT_CELL_BYTES  # the same message with fast memory: bound by the CPU terms
    cpu = CALL + 2 * _cell(2, DEFAULT_CELL_BYTES)
    assert predict_s("shm", _profile(1e15), Topology((2,)), small) == pytest.approx(cpu, rel=1e-9)


def test_oversubscribed_ranks_slow_the_cpu_terms_and_the_barrier():
    p, n = 4, DEFAULT_CELL_BYTES + 4 * 2**10  # one full cell and a short one, 4 ranks on 2 cores
    expected = 2 * CALL + sum(_cell(p, c, slow=2.0, barrier=4 * BARRIER) for c in (DEFAULT_CELL_BYTES, 4 * 2**10))
    for seconds in _both("shm", _profile(cores=2), p, n):
        assert seconds == pytest.approx(expected, rel=1e-9)


def test_cells_run_at_the_cache_rates_while_every_rank_has_a_core():
    """With in-cache rates known: cells and the lean round use them when the ranks have a core each, the
    out-of-cache ones (times ranks/cores) when the ranks outnumber the cores."""
    cache_copy, cache_gamma = COPY / 4, GAMMA / 4
    profile = _profile()
    profile = dataclasses.replace(profile, shm=dataclasses.replace(
        profile.shm, cache_copy_s_per_byte=cache_copy, cache_gamma_s_per_byte=cache_gamma))
    n, share = DEFAULT_CELL_BYTES, DEFAULT_CELL_BYTES / 2
    cell = 2 * CELL + (n - share) * cache_copy + share * (cache_copy + cache_gamma) + (n - share) * cache_copy
    for seconds in _both("shm", profile, 2, n):
        assert seconds == pytest.approx(CALL + cell + 2 * BARRIER, rel=1e-9)
    lean = LEAN_MAX_BYTES
    for seconds in _both("shm", profile, 2, lean):
        assert seconds == pytest.approx(LEAN + lean * cache_copy + BARRIER + lean * cache_gamma, rel=1e-9)
    crowded = dataclasses.replace(profile, cores_per_host=2)
    for seconds in _both("shm", crowded, 4, n):
        assert seconds == pytest.approx(2 * CALL + _cell(4, n, slow=2.0, barrier=4 * BARRIER), rel=1e-9)


def test_a_profile_file_without_the_new_shm_terms_still_loads(tmp_path):
    data = get_profile("this-machine").as_dict()
    data.pop("call_overheads_s", None)  # an old file: no per-algorithm call overheads either
    for key in ("cell_overhead_s", "lean_call_overhead_s", "cache_copy_s_per_byte", "cache_gamma_s_per_byte"):
        data["shm"].pop(key, None)
    path = tmp_path / "old.json"
    path.write_text(json.dumps(data))
    from gradsync.collectives.cost.profile import load
    old = load(path)
    assert old.shm.cell_overhead_s == 0.0 and old.shm.lean_call_overhead_s is None
    assert old.shm.cache_copy_s_per_byte is None and old.shm.cache_gamma_s_per_byte is None
    assert call_overhead_s(old, "shm", Topology((2,)), 4) == old.call_overhead_s
    assert dataclasses.replace(old, name="x").shm == old.shm
