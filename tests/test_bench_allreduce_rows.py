"""``gradsync bench allreduce`` rows from synthetic per-repetition times: paired ratios with their spread,
``auto`` against the fastest candidate by median, and the tables with and without spread fields."""

from __future__ import annotations

import pytest

from gradsync.bench.allreduce import tables_text
from gradsync.bench.allreduce_rows import format_table, row_figures
from gradsync.bench.auto_rows import AUTO_GOAL, annotate_auto_rows, auto_candidates, auto_rows, format_auto_table

US = 1e-6


def test_row_figures_pair_each_repetition_with_native_and_mpi():
    """Native and ring both slow in repetition 2 (shared noise): the paired ratios stay at 2.0/2.0/2.5."""
    times = {"ring": [10 * US, 40 * US, 8 * US], "native": [20 * US, 80 * US, 20 * US],
             "mpi": [5 * US, 20 * US, 4 * US]}
    figures = row_figures(times, nbytes=4000, world_size=4)
    ring = figures["ring"]
    assert ring["time_us_reps"] == pytest.approx([10.0, 40.0, 8.0])
    assert (ring["time_us"], ring["time_us_median"], ring["time_us_min"], ring["time_us_max"]) == \
        pytest.approx((10.0, 10.0, 8.0, 40.0))
    assert (ring["ratio_to_native"], ring["ratio_to_native_min"], ring["ratio_to_native_max"]) == \
        pytest.approx((2.0, 2.0, 2.5))  # 20/10, 80/40, 20/8
    assert (ring["ratio_to_mpi"], ring["ratio_to_mpi_min"], ring["ratio_to_mpi_max"]) == pytest.approx((0.5, 0.5, 0.5))
    # 4000 B / 10 us = 0.4 GB/s; slowest 40 us -> 0.1, fastest 8 us -> 0.5; busbw x 2(4-1)/4 = 1.5
    assert (ring["algbw_gbps"], ring["algbw_gbps_median"], ring["algbw_gbps_min"], ring["algbw_gbps_max"]) == \
        pytest.approx((0.4, 0.4, 0.1, 0.5))
    assert (ring["busbw_gbps"], ring["busbw_gbps_min"], ring["busbw_gbps_max"]) == pytest.approx((0.6, 0.15, 0.75))
    assert figures["native"]["ratio_to_native"] == 1.0 and figures["native"]["ratio_to_mpi"] == pytest.approx(0.25)
    assert figures["mpi"]["ratio_to_mpi"] is None and figures["mpi"]["ratio_to_native"] == pytest.approx(4.0)


def test_row_figures_with_an_even_repeat_keep_bandwidth_and_time_consistent():
    """Two repetitions: the median time is their mean, and algbw is the bytes over that time."""
    figures = row_figures({"ring": [1 * US, 3 * US], "native": [2 * US, 3 * US]}, nbytes=2000, world_size=2)
    ring = figures["ring"]
    assert ring["time_us"] == pytest.approx(2.0) and ring["algbw_gbps"] == pytest.approx(1.0)
    assert ring["ratio_to_native"] == pytest.approx(1.5) and ring["ratio_to_native_min"] == pytest.approx(1.0)
    assert "ratio_to_mpi" not in ring  # no mpi column in this run


def test_row_figures_refuse_unpaired_repetitions():
    with pytest.raises(ValueError, match="pairs"):
        row_figures({"ring": [1 * US, 2 * US], "native": [1 * US]}, nbytes=8, world_size=2)


def _row(algorithm, reps_us, nbytes=4096, hosts=1, world_size=4):
    median = sorted(reps_us)[len(reps_us) // 2]
    return {"algorithm": algorithm, "nbytes": nbytes, "world_size": world_size, "hosts": hosts,
            "time_us": median, "time_us_reps": reps_us}


def _slow(names, reps=3, **layout):
    """Candidates of auto measured far slower than the rest (so that every candidate is measured)."""
    return [_row(name, [1e6] * reps, **layout) for name in names]


def test_auto_is_set_against_the_candidate_with_the_least_median_time():
    """shm has the least median (not the least single repetition: tree's 50); native and pretend-node
    hierarchical are not auto's candidates on one host; the paired ratios are 105/100, 126/120, 104/100."""
    rows = [_row("tree", [50.0, 200.0, 200.0]), _row("shm", [100.0, 120.0, 100.0]),
            _row("native", [10.0, 10.0, 10.0]), _row("hierarchical", [20.0, 20.0, 20.0]),
            _row("auto", [105.0, 126.0, 104.0])] + _slow(["ring", "double_binary_tree", "halving_doubling"])
    (judged,) = auto_rows(rows)
    assert judged["fastest"] == "shm" and judged["fastest_us"] == 100.0 and judged["auto_us"] == 105.0
    assert (judged["auto_vs_fastest"], judged["auto_vs_fastest_median"], judged["auto_vs_fastest_min"],
            judged["auto_vs_fastest_max"]) == pytest.approx((1.05, 1.05, 1.04, 1.05))
    assert judged["verdict"] == "met"  # 1.04..1.05: all of it under 1.10


@pytest.mark.parametrize("auto_reps, expected", [
    ([105.0, 125.0, 100.0], "met, straddles"),   # ratios 1.05, 1.25, 1.0: median under, max over 1.10
    ([120.0, 100.0, 115.0], "missed, straddles"),  # 1.2, 1.0, 1.15
    ([130.0, 150.0, 120.0], "missed"),           # 1.3, 1.5, 1.2
])
def test_auto_verdict_against_the_goal_says_when_it_straddles(auto_reps, expected):
    rows = [_row("ring", [100.0, 100.0, 100.0]), _row("auto", auto_reps)]
    rows += _slow(["tree", "double_binary_tree", "halving_doubling", "shm"])
    assert auto_rows(rows)[0]["verdict"] == expected and AUTO_GOAL == 1.10


def test_auto_across_hosts_takes_hierarchical_not_shm_and_keeps_layouts_apart():
    assert "hierarchical" in auto_candidates(2) and "shm" not in auto_candidates(2)
    assert "shm" in auto_candidates(1) and "native" not in auto_candidates(1) + auto_candidates(2)
    rows = [_row("hierarchical", [50.0], hosts=2), _row("ring", [80.0], hosts=2), _row("auto", [60.0], hosts=2),
            _row("ring", [10.0], hosts=1), _row("ring", [70.0], nbytes=65536, hosts=2)]
    rows += _slow(["tree", "double_binary_tree", "halving_doubling"], reps=1, hosts=2)
    (judged,) = auto_rows(rows)
    assert (judged["fastest"], judged["auto_vs_fastest"], judged["hosts"]) == ("hierarchical", pytest.approx(1.2), 2)


def test_auto_rows_recorded_without_repetitions_give_the_bare_ratio():
    rows = [{"algorithm": a, "nbytes": 4096, "world_size": 4, "time_us": t} for a, t in (("shm", 100.0),
                                                                                        ("auto", 119.0),
                                                                                        ("ring", 1e6), ("tree", 1e6),
                                                                                        ("double_binary_tree", 1e6),
                                                                                        ("halving_doubling", 1e6))]
    (judged,) = auto_rows(rows)
    assert judged["auto_vs_fastest"] == pytest.approx(1.19) and "auto_vs_fastest_min" not in judged
    assert judged["verdict"] == "missed" and "1.19x" in format_auto_table([judged])


def test_annotate_gives_the_auto_row_its_figures_for_the_json():
    rows = annotate_auto_rows([_row("ring", [100.0, 100.0, 100.0]), _row("auto", [105.0, 125.0, 100.0])]
                              + _slow(["tree", "double_binary_tree", "halving_doubling", "shm"]))
    assert rows[0].get("fastest") is None
    assert rows[1]["fastest"] == "ring" and rows[1]["auto_verdict"] == "met, straddles"
    assert (rows[1]["auto_vs_fastest_min"], rows[1]["auto_vs_fastest_max"]) == pytest.approx((1.0, 1.25))


def _full_row(algorithm, reps_us, native_us, nbytes=4096):
    figures = row_figures({algorithm: [t * US for t in reps_us], "native": [t * US for t in native_us]}, nbytes, 2)
    return {"algorithm": algorithm, "world_size": 2, "nbytes": nbytes, "bytes_sent_per_call": 2048.0,
            "repeat": len(reps_us), "iterations": 1, "hosts": 1, "nproc_per_host": 2, **figures[algorithm]}


def test_table_shows_median_and_min_max_of_time_and_ratio():
    rows = [_full_row("ring", [10.0, 12.0, 30.0], [20.0, 18.0, 33.0]), _full_row("native", [20.0, 18.0, 33.0],
                                                                                 [20.0, 18.0, 33.0])]
    header, rule, ring, native = format_table(rows).splitlines()
    assert len(header) == len(rule) == len(ring) == len(native)  # the widths fit the wider cells
    assert "12.0 (10.0-30.0)" in ring and "1.50x (1.10-2.00)" in ring  # 18/12, 33/30, 20/10
    assert "1.00x (1.00-1.00)" in native and "vs mpi" not in header


def test_table_of_rows_recorded_without_spread_is_unchanged():
    """A committed row of before the spread: bare values, the old widths, vs mpi from the mpi row's time."""
    old = [{"algorithm": a, "world_size": 2, "nbytes": 4096, "time_us": t, "algbw_gbps": 0.1, "busbw_gbps": 0.1,
            "ratio_to_native": r, "bytes_sent_per_call": 0.0, "repetitions": 5, "iterations": 1}
           for a, t, r in (("shm", 50.0, 2.0), ("mpi", 25.0, 4.0), ("native", 100.0, 1.0))]
    lines = format_table(old).splitlines()
    assert lines[0] == ("    size [B]         algorithm   time [us]  algbw [GB/s]  busbw [GB/s]  vs native "
                        " sent/size   vs mpi")
    assert lines[2].split() == ["4096", "shm", "50.0", "0.100", "0.100", "2.00x", "0.000", "0.50x"]
    assert lines[3].split()[-1] == "-"


def test_tables_text_adds_the_auto_table_with_its_goal():
    rows = [_full_row("shm", [10.0, 10.0, 10.0], [20.0, 20.0, 20.0]),
            _full_row("auto", [10.5, 12.0, 10.0], [20.0, 20.0, 20.0])]
    rows += [_full_row(name, [1e3] * 3, [20.0] * 3)
             for name in ("ring", "tree", "double_binary_tree", "halving_doubling")]
    text = tables_text(rows)
    assert text.startswith(format_table(rows)) and "goal <= 1.10x" in text
    assert "1.05x (1.00-1.20)" in text and "met, straddles" in text  # 10.5/10, 12/10, 10/10
    assert "goal" not in tables_text(rows[:1])


def test_each_algorithm_takes_every_place_of_the_order_over_as_many_repetitions():
    from gradsync.bench.allreduce import rotated

    names = ["ring", "shm", "native", "auto"]
    orders = [rotated(names, k) for k in range(len(names))]
    assert all(sorted(order) == sorted(names) for order in orders)
    for place in range(len(names)):
        assert sorted(order[place] for order in orders) == sorted(names)
    assert rotated(names, len(names)) == names
