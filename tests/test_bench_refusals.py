"""What a new user tried against the benches of issue 37: each refused in one line before any process starts,
and auto never judged against only some of what it may choose."""

import json

import pytest

from gradsync.bench.allreduce_rows import bound_spread
from gradsync.bench.auto_rows import auto_rows, format_auto_table
from gradsync.bench.report import render
from _cli import run_cli


def _main(argv, capsys):
    return run_cli(argv, capsys)


@pytest.mark.parametrize("argv, needle", [
    (["bench", "allreduce", "--nproc", "2", "--sizes", "4K", "--algorithms", "shm,shm"], "shm given more than once"),
    (["bench", "allreduce", "--nproc", "2", "--sizes", "4K", "--algorithms", "shm,native,native"], "native given"),
    (["bench", "allreduce", "--nproc", "2", "--sizes", "4K,4K"], "--sizes: 4096 given more than once"),
    (["bench", "allreduce", "--nproc", "2", "--sizes", "4K", "--algorithms", "shm", "--shm-cells", "1M,1M"],
     "shm@1M given more than once"),
    (["bench", "allreduce", "--nproc", "2", "--sizes", "4K", "--algorithms", "shm", "--mpi-settings", "defaults"],
     "--mpi-settings defaults: the mpi column is not measured"),
    (["bench", "allreduce", "--hosts", "2", "--nproc", "2", "--mpi", "mpich"], "MPI does not run across --hosts"),
    (["simulate", "--repeat", "2", "--gpus", "8", "--sizes", "4K"], "only --validate repeats"),
    (["simulate", "--validate", "--reproduce"], "give one"),
    (["bench", "record", "--bench-dir", "{tmp}", "sim_scale", "--validate"], "other records"),
])
def test_a_contradictory_or_repeated_option_is_one_line_before_anything_runs(argv, needle, capsys, tmp_path):
    result = _main([arg.format(tmp=tmp_path) for arg in argv], capsys)
    assert result.returncode == 2, result
    assert needle in result.stderr and "Traceback" not in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr


def _timed(algorithm, times_us):
    return {"algorithm": algorithm, "world_size": 2, "nbytes": 4096, "hosts": 1, "time_us": sorted(times_us)[1],
            "time_us_reps": times_us}


def test_auto_against_some_candidates_only_gets_no_verdict():
    rows = [_timed("auto", [50.0, 60.0, 70.0]), _timed("ring", [1000.0, 1100.0, 1200.0])]
    (judged,) = auto_rows(rows)
    assert judged["verdict"] == "incomplete"
    assert judged["missing"] == ["tree", "double_binary_tree", "halving_doubling", "shm"]
    assert ("incomplete: double_binary_tree, halving_doubling, shm, tree not measured"
            in format_auto_table([judged]))
    every = rows + [_timed(name, [55.0, 60.0, 65.0])
                    for name in ("tree", "double_binary_tree", "halving_doubling", "shm")]
    (complete,) = auto_rows(every)
    assert complete["missing"] == [] and complete["verdict"] == "met"  # 1.00 (0.91-1.08) against tree


def test_the_memory_bound_fraction_carries_its_spread():
    figures = {"time_us": 200.0, "time_us_min": 100.0, "time_us_max": 400.0}
    spread = bound_spread(0.5, figures)  # the bound's time is 100 us
    assert spread == pytest.approx({"bound_fraction_median": 0.5, "bound_fraction_min": 0.25,
                                    "bound_fraction_max": 1.0})
    assert bound_spread(None, figures) == {}


def test_a_record_with_rows_its_bench_does_not_write_is_named_not_a_traceback(tmp_path):
    document = {"format": 1, "bench": "replicas", "command": "gradsync bench replicas", "options": {},
                "date": "2026-12-07T00:00:00Z", "duration_s": 1.0, "load_before": [1.0, 1.0, 1.0],
                "load_after": [1.0, 1.0, 1.0], "machine": {"cpu_count": 2}, "versions":
                {"gradsync": "0", "torch": "0", "python": "3"}, "rows": [{"foo": 1}]}
    (tmp_path / "replicas.json").write_text(json.dumps(document))
    with pytest.raises(ValueError, match=r"replicas.json: its rows are not what `gradsync bench replicas` writes"):
        render(tmp_path)


def test_the_restart_faults_bench_is_one_run_whatever_its_parsed_repeat():
    from gradsync.bench.record import _repeat_of
    from gradsync.bench.report import repetitions

    assert _repeat_of("faults", {"elastic": False, "repeat": 5}) is None
    assert _repeat_of("faults_elastic", {"elastic": True, "repeat": 3}) == 3
    assert repetitions({"bench": "faults", "repeat": 5, "options": {"elastic": False, "repeat": 5}}) == (1, "1 run")
    assert repetitions({"bench": "faults_elastic", "repeat": 3, "options": {"elastic": True}})[0] == 3


@pytest.mark.parametrize("argv, needle", [
    # --reproduce prices the published curves' own systems and sizes: an option it would ignore is refused
    (["simulate", "--reproduce", "--profile", "h200-ib"], "--profile has no effect with --reproduce"),
    (["simulate", "--reproduce", "--profile", "nosuch"], "--profile has no effect with --reproduce"),
    (["simulate", "--reproduce", "--gpus", "16"], "--gpus has no effect with --reproduce"),
    (["simulate", "--reproduce", "--sizes", "4K"], "--sizes has no effect with --reproduce"),
    (["simulate", "--reproduce", "--algorithms", "ring"], "--algorithms has no effect with --reproduce"),
    (["simulate", "--reproduce", "--plot", "{tmp}/r.png"], "--plot has no effect with --reproduce"),
    (["simulate", "--gpus", "8", "--sizes", "4K", "--validate-sizes", "4K"], "--validate-sizes: only --validate"),
    (["simulate", "--gpus", "8", "--sizes", "4K", "--no-hosts"], "--no-hosts: only --validate"),
    (["simulate", "--gpus", "8", "--sizes", "4K", "--inter-host-gbit", "5"], "--inter-host-gbit: only --validate"),
    # the at-scale table: empty, repeated or impossible lists and budgets, before any row is printed
    (["simulate", "--gpus", "8", "--sizes", "4K", "--algorithms", ""], "--algorithms: no algorithm given"),
    (["simulate", "--gpus", "8", "--sizes", "4K", "--algorithms", "ring,ring"], "ring given more than once"),
    (["simulate", "--gpus", "8,8", "--sizes", "4K"], "--gpus: 8 given more than once"),
    (["simulate", "--gpus", "8", "--sizes", "4K,4K"], "--sizes: 4096 given more than once"),
    (["simulate", "--gpus", "8", "--sizes", "4K", "--event-budget-s", "nan"], "--event-budget-s must be >= 0"),
    (["simulate", "--gpus", "8", "--sizes", "4K", "--event-total-s", "-1"], "--event-total-s must be >= 0"),
    (["simulate", "--profile", "this-machine", "--gpus", "2,4", "--sizes", "4K"], "--gpus 4: profile 'this-machine'"),
    # gradsync explain without ALG: the claims need a multi-host GPU profile; never point at a missing option
    (["explain", "--profile", "test-hosts"], "--profile test-hosts: the claims need"),
    (["explain", "--profile", "this-machine"], "--profile this-machine: the claims need"),
    # gradsync explain ALG traces every message: a run of minutes (1M in 4-byte segments: 1.5M messages; a ring of
    # 4096 ranks: 33M) is refused up front instead of looking hung
    (["explain", "double_binary_tree", "--segment-bytes", "3"], "messages to trace"),
    (["explain", "ring", "--nproc", "4096", "--hosts", "512", "--size", "4K", "--profile", "h100-ib"],
     "messages to trace"),
    # simulate train prices gradsync's algorithms only, refused before its header
    (["simulate", "train", "--params", "10B", "--tokens-per-gpu", "4096", "--algorithms", "ring,nccl"],
     "--algorithms nccl: simulate train runs"),
])
def test_simulate_and_explain_refuse_what_they_would_ignore_or_cannot_price(argv, needle, capsys, tmp_path):
    result = _main([arg.format(tmp=tmp_path) for arg in argv], capsys)
    assert result.returncode == 2, result
    assert needle in result.stderr and "Traceback" not in result.stderr, result.stderr
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert result.stdout == "", result.stdout       # refused before any row is printed
    assert "--peak-tflops" not in result.stderr      # explain has no such option
