"""The repetition and spread logic of every bench (gradsync.bench.spread) on synthetic timings."""

import argparse
import statistics

import pytest
from hypothesis import given, strategies as st

from gradsync.bench.spread import (add_repeat_option, check_repeat, fmt_spread, paired_ratios, spread, straddles,
                                   verdict, with_spread)

finite = st.floats(min_value=1e-6, max_value=1e6, allow_nan=False, allow_infinity=False)


@given(st.lists(finite, min_size=1, max_size=15))
def test_spread_is_the_median_and_the_extremes(values):
    summary = spread(values)
    ordered = sorted(values)
    middle = len(ordered) // 2
    expected = ordered[middle] if len(ordered) % 2 else (ordered[middle - 1] + ordered[middle]) / 2
    assert summary.median == pytest.approx(expected)
    assert (summary.min, summary.max, summary.n) == (ordered[0], ordered[-1], len(values))
    assert summary.min <= summary.median <= summary.max


def test_with_spread_writes_the_median_and_its_three_fields():
    times_s = [0.003, 0.001, 0.002, 0.010, 0.004]
    fields = with_spread("time_us", times_s, scale=1e6)
    assert fields == pytest.approx({"time_us": 3000.0, "time_us_median": 3000.0, "time_us_min": 1000.0,
                                    "time_us_max": 10000.0})


def test_ratios_pair_the_repetitions_and_are_not_a_ratio_of_medians():
    # native and the algorithm both slowed down in repetition 2 (shared noise): paired ratios stay near 2
    native = [2.0, 20.0, 2.2]
    algorithm = [1.0, 10.0, 1.0]
    ratios = paired_ratios(native, algorithm)
    assert ratios == pytest.approx([2.0, 2.0, 2.2])
    fields = with_spread("ratio_to_native", ratios)
    assert fields["ratio_to_native"] == pytest.approx(2.0)
    assert (fields["ratio_to_native_min"], fields["ratio_to_native_max"]) == pytest.approx((2.0, 2.2))
    assert statistics.median(native) / statistics.median(algorithm) == pytest.approx(2.2)  # what pairing avoids


@pytest.mark.parametrize("numerators, denominators, match", [([1.0], [1.0, 2.0], "pairs"),
                                                             ([1.0, 2.0], [1.0, 0.0], "not positive")])
def test_paired_ratios_refuse_what_does_not_pair(numerators, denominators, match):
    with pytest.raises(ValueError, match=match):
        paired_ratios(numerators, denominators)


@pytest.mark.parametrize("values", [[], [1.0, float("nan")], [float("inf")]])
def test_spread_refuses_no_or_non_finite_values(values):
    with pytest.raises(ValueError):
        spread(values)


@pytest.mark.parametrize("ratios, goal, at_most, expected", [
    ([1.02, 1.05, 1.08], 1.10, True, "met"),            # all below
    ([1.02, 1.05, 1.21], 1.10, True, "met, straddles"),  # median below, max above
    ([0.98, 1.15, 1.30], 1.10, True, "missed, straddles"),
    ([1.15, 1.20, 1.30], 1.10, True, "missed"),
    ([0.7, 0.9, 1.1], 0.8, False, "met, straddles"),    # an at-least goal (throughput kept)
    ([0.7, 0.75, 0.79], 0.8, False, "missed"),
])
def test_a_goal_is_judged_on_the_median_and_a_straddling_row_says_so(ratios, goal, at_most, expected):
    row = with_spread("r", ratios)
    assert verdict(row, "r", goal, at_most) == expected
    assert straddles(row, "r", goal) == ("straddles" in expected)


def test_a_row_without_spread_renders_its_bare_value_and_never_straddles():
    assert fmt_spread({"r": 1.5}, "r", ".2f") == "1.50"
    assert fmt_spread({"r": None}, "r", ".2f") == "-"
    assert fmt_spread({}, "r", ".2f") == "-"
    assert not straddles({"r": 1.1}, "r", 1.1)
    assert verdict({}, "r", 1.1) == "-"
    assert fmt_spread(with_spread("t", [3.0, 1.0, 2.0]), "t", ".1f", " us") == "2.0 us (1.0-3.0)"


@pytest.mark.parametrize("bad", [0, -3, 1.5, True, "5"])
def test_repeat_must_be_a_positive_integer(bad):
    with pytest.raises(ValueError, match="--repeat"):
        check_repeat(bad)
    assert check_repeat(3) == 3


def test_the_repeat_option_defaults_to_five():
    parser = argparse.ArgumentParser()
    add_repeat_option(parser)
    assert parser.parse_args([]).repeat == 5
    assert parser.parse_args(["--repeat", "2"]).repeat == 2
