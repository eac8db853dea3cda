"""The simulator's records: ``gradsync bench record sim_*`` wraps calibrate / simulate's JSON with its metadata,
``gradsync bench report`` renders them into docs/benchmarks.md and docs/simulator.md's generated section,
``simulate --validate`` reports every measured figure with its spread (synthetic rows, known answers; fast)."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import pytest

from gradsync.bench import report
from gradsync.bench.sim_validation import ValidationRow, format_rows, summarize, with_runs
from gradsync.bench.sim_validation_picks import auto_picks
from gradsync.cli import build_parser, main


def _validation_rows() -> list[dict]:
    """Two points of 3 repetitions: errors known by hand (predicted 100 us)."""
    return [ValidationRow.of_runs("ring", 2**20, 2, 1, 100.0, [80.0, 125.0, 100.0]).as_dict(),  # +25%, -20%, 0%
            ValidationRow.of_runs("shm", 2**20, 2, 1, 100.0, [50.0, 40.0, 200.0]).as_dict()]    # +100, +150, -50%


def _document(name: str, rows: list[dict], options: dict, command: str) -> dict:
    return {"format": 1, "bench": name, "command": command, "options": options, "repeat": options.get("repeat"),
            "date": "2026-01-02T03:04:05Z", "duration_s": 61.0, "load_before": [1.5, 1.0, 0.5],
            "load_after": [2.5, 2.0, 1.0], "machine": {"platform": "Linux", "cpu_model": "Test CPU", "cpu_count": 2,
                                                       "usable_cpus": 2, "memory_gib": 8.0},
            "versions": {"gradsync": "0.0", "torch": "2.x", "python": "3.x", "git_commit": "abc1234"}, "rows": rows}


def test_validation_rows_carry_the_spread_of_measured_time_and_error():
    """Each repetition's error is formed from its own measured time; median, min and max over them."""
    row = ValidationRow.of_runs("ring", 4096, 2, 1, 100.0, [80.0, 125.0, 100.0])
    assert row.measured_us == 100.0 and row.errors == pytest.approx([0.25, -0.2, 0.0])
    written = row.as_dict()
    assert (written["measured_us"], written["measured_us_min"], written["measured_us_max"]) == (100.0, 80.0, 125.0)
    assert (written["error"], written["error_min"], written["error_max"]) == pytest.approx((0.0, -0.2, 0.25))
    assert ValidationRow.from_dict(written) == row
    assert "100.0 (80.0-125.0)" in format_rows([row]) and "+0.0% (-20.0-+25.0)" in format_rows([row])


def test_validation_summary_takes_each_figure_within_a_repetition():
    """median |error| of repetition k over the rows, then the median and extremes over k."""
    rows = [ValidationRow.from_dict(row) for row in _validation_rows()]
    summary = summarize(rows)
    per_repetition = [statistics.median([0.25, 1.0]), statistics.median([0.2, 1.5]), statistics.median([0.0, 0.5])]
    assert summary.repetitions == 3
    assert summary.median_abs_error == pytest.approx(statistics.median(per_repetition))
    assert summary.figures["median_abs_error_min"] == pytest.approx(0.25)
    assert summary.figures["median_abs_error_max"] == pytest.approx(statistics.median([0.2, 1.5]))
    # shm: |median error| 100% (errors +100, +150, -50%) against max(25%, spread (200 - 40) / 50 = 320%): passes
    assert summary.failing == () and not summary.meets_goal
    # auto's pick (shm: predicted equal, measured fastest by median) against ring, within each repetition
    pick, = auto_picks(rows)
    assert (pick.predicted, pick.measured) == ("ring", "shm")
    assert pick.slowdowns == pytest.approx((80 / 50, 125 / 40, 100 / 200))


def test_with_runs_keeps_every_repetitions_time():
    rows = with_runs([{"algorithm": "ring", "nbytes": 4, "world_size": 2, "time_us": 2.0,
                       "time_us_reps": [3.0, 1.0, 2.0]},
                      {"algorithm": "tree", "nbytes": 4, "world_size": 2, "time_us": 5.0}])
    assert [row["runs_us"] for row in rows] == [[3.0, 1.0, 2.0], [5.0]]
    assert ValidationRow.of_runs("ring", 4, 2, 1, 1.0, rows[0]["runs_us"]).measured_us == 2.0
    with pytest.raises(ValueError, match="without a time"):
        with_runs([{"algorithm": "ring"}])


@pytest.mark.parametrize("argv", [["--repeat", "0"], ["--repeat", "-2"]])
def test_validate_refuses_a_bad_repeat_before_calibrating(argv, capsys, monkeypatch):
    """--repeat is checked first: nothing is calibrated or launched."""
    from gradsync.bench import sim_validation_run

    monkeypatch.setattr(sim_validation_run, "calibrate", lambda **kw: pytest.fail("calibrated"))
    assert main(["simulate", "--validate", *argv]) == 2
    assert "--repeat must be an integer >= 1" in capsys.readouterr().err


def test_validate_has_no_repetitions_or_rounds_option(capsys):
    assert build_parser().parse_args(["simulate", "--validate"]).repeat == 5
    assert build_parser().parse_args(["simulate", "train", "--validate"]).repeat == 5
    for argv in (["simulate", "--validate", "--repetitions", "3"], ["simulate", "train", "--rounds", "3"]):
        with pytest.raises(SystemExit):
            main(argv)
    capsys.readouterr()


def test_record_runs_the_simulator_command_and_keeps_its_repeat(tmp_path):
    """record sim_validate runs `simulate --validate OPTIONS --json F` (a stand-in here) and wraps F's rows."""
    from gradsync.bench.record import record

    calls = []

    def fake_main(argv):
        calls.append(argv)
        Path(argv[argv.index("--json") + 1]).write_text(json.dumps(_validation_rows()))
        if "--plot" in argv:
            plot = Path(argv[argv.index("--plot") + 1])
            plot.parent.mkdir(parents=True, exist_ok=True)  # as claim_json_path does
            plot.write_bytes(b"png")
        return 0

    cli = {"parse": build_parser().parse_args, "run": fake_main}
    path = record("sim_validate", ["--repeat", "3", "--no-hosts"], tmp_path, **cli)
    assert calls[-1][:5] == ["simulate", "--validate", "--repeat", "3", "--no-hosts"]
    document = json.loads(path.read_text())
    assert document["command"] == "gradsync simulate --validate --repeat 3 --no-hosts"
    assert document["repeat"] == 3 and document["options"]["validate_sizes"] == "4K,64K,1M,16M,64M"
    assert document["rows"] == _validation_rows() and path.name == "sim_validate.json"
    record("sim_calibrate", ["--settings", "tiny"], tmp_path, **cli)
    assert calls[-1][:3] == ["calibrate", "--settings", "tiny"] and "--out" in calls[-1]  # the profile: scratch
    assert json.loads((tmp_path / "sim_calibrate.json").read_text())["repeat"] is None
    record("sim_scale", ["--gpus", "8"], tmp_path, **cli)
    assert calls[-1][0] == "simulate" and "--validate" not in calls[-1]
    assert json.loads((tmp_path / "sim_scale.json").read_text())["repeat"] is None  # --repeat is --validate's
    assert (tmp_path / "simulate_scale.png").read_bytes() == b"png"  # the plot is kept beside the JSON
    for name, option in (("sim_validate", "--json"), ("sim_calibrate", "--out"), ("sim_scale", "--plot=x.png")):
        with pytest.raises(ValueError, match=option.partition("=")[0]):
            record(name, [option, "x"], tmp_path, **cli)


def _sim_documents(folder: Path) -> None:
    figures = [{"profile": "this-machine", "figure": "intra alpha", "field": "intra.alpha_s", "value": 31.25,
                "unit": "us"}]
    reproduce = [{"source": "8xH100-NVLS", "system": "1 node", "nbytes": 2**20, "published_busbw_gbps": 50.0,
                  "predicted_busbw_gbps": 55.0, "error_pct": 10.0, "candidate": "ring/LL", "method": "event"}]
    scale = [{"gpus": 8, "algorithm": name, "nbytes": 4096, "time_us": time_us, "algbw_gbps": 0.1, "busbw_gbps": 0.1,
              "method": method, "wall_s": 0.0} for name, time_us, method in (("ring", 20.0, "event"),
                                                                          ("tree", 12.5, "formula"))]
    documents = {"sim_calibrate": (figures, {"settings": "full"}, "gradsync calibrate --settings full"),
                 "sim_validate": (_validation_rows(), {"repeat": 3}, "gradsync simulate --validate --repeat 3"),
                 "sim_reproduce": (reproduce, {}, "gradsync simulate --reproduce"),
                 "sim_scale": (scale, {"profile": "h100-ib", "repeat": 5}, "gradsync simulate --gpus 8")}
    for name, (rows, options, command) in documents.items():
        document = _document(name, rows, options, command)
        document["repeat"] = 3 if name == "sim_validate" else None  # as record writes it
        (folder / f"{name}.json").write_text(json.dumps(document))


def test_report_renders_the_simulator_records_on_both_pages(tmp_path):
    """benchmarks.md and simulator.md's section show the same tables and metadata; --check checks both."""
    _sim_documents(tmp_path)
    page = report.render(tmp_path)
    section = report.render_simulator_section(tmp_path)
    for text in (page, section):
        assert "| repetitions | 3 (`--repeat 3`: each figure the median, with min-max) |" in text
        assert text.count("| repetitions | 1 run |") == 3 and "| commit | abc1234 |" in text
        assert "before 1.50 / 1.00 / 0.50; after 2.50 / 2.00 / 1.00" in text and "| took | 61 s |" in text
        assert "intra alpha" in text and "31.25" in text                              # calibrate's figures
        assert "50.0 (40.0-200.0)" in text and "+0.0% (-20.0-+25.0)" in text         # --validate's spread
        assert "1.60x (0.50-3.12)" in text                                           # auto's pick, paired
        assert "8xH100-NVLS: 1 node" in text and "+10.0%  ring/LL (event)" in text   # --reproduce
        assert "12.5*" in text and "tree" in text.split("12.5*")[1].splitlines()[0]  # scale: formula, fastest
    assert "Not measured yet" in page and "Not measured yet" not in section  # the benchmarks are not here
    assert "The records above took 4 min together" in page
    simulator = tmp_path / "simulator.md"
    simulator.write_text(f"# Sim\n\nhand-written\n\n{report.SIM_BEGIN}\nold figures\n{report.SIM_END}\n\nmore\n")
    out = tmp_path / "benchmarks.md"
    assert report.stale(tmp_path, out, simulator) == [str(out), str(simulator)]
    report.write(tmp_path, out, simulator)
    assert report.stale(tmp_path, out, simulator) == []
    text = simulator.read_text()
    assert text.startswith("# Sim\n\nhand-written\n\n") and text.endswith("\n\nmore\n") and "old figures" not in text
    assert section in text and out.read_text() == page
    simulator.write_text("# no markers\n")
    with pytest.raises(ValueError, match="--simulator-page .*no generated section"):
        report.write(tmp_path, out, simulator)


def test_profile_figures_are_in_the_units_they_are_read_in():
    from gradsync.bench.sim_report import format_figures, profile_figures
    from gradsync.collectives.cost.profile import Link, Profile

    profile = Profile(name="p", description="", intra=Link(2e-5, 1.5e9, True), inter=None, gamma_s_per_byte=2.5e-10,
                      copy_s_per_byte=1e-10, ranks_per_host=2, cores_per_host=2, call_overhead_s=4e-6)
    figures = {row["field"]: (row["value"], row["unit"]) for row in profile_figures(profile)}
    assert figures["intra.alpha_s"] == pytest.approx((20.0, "us")) or figures["intra.alpha_s"][0] == pytest.approx(20)
    assert figures["intra.bandwidth_bytes_per_s"][0] == pytest.approx(1.5)
    assert figures["gamma_s_per_byte"] == (pytest.approx(0.25), "ns/B") and "inter.alpha_s" not in figures
    assert "shm.barrier_s" not in figures and "call overhead" in format_figures(profile_figures(profile))
