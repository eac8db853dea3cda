"""``gradsync bench fit``'s verdicts and command lines, on rows made up here (the bench itself trains for minutes)."""

from __future__ import annotations

from pathlib import Path

from gradsync.bench import does_not_fit
from gradsync.cli import main


def _row(shard, limit, outcome, loss=None, steps=None, line=None):
    return {"shard": shard, "memory_limit_mib": limit, "outcome": outcome, "final_test_loss": loss, "steps": steps,
            "estimate_mib": None, "measured_peak_mib": None, "line": line, "wall_s": 1.0}


def test_the_goals_are_met_only_by_a_refusal_and_a_loss_within_two_percent_of_the_reference_median():
    refused = _row("none", 300, "refused", line="gradsync preflight: one rank needs 500 MiB ...")
    references = [_row("none", None, "trained", loss, 100) for loss in (2.00, 2.40, 1.90)]  # median 2.00
    good = [references[0], refused, _row("parameters", 300, "trained", 2.03, 100), *references[1:]]
    assert [": met (" in line for line in does_not_fit.judge(good)] == [True, True]
    assert "the 3 reference runs span 1.9000 to 2.4000, 25.0% of their median" in does_not_fit.judge(good)[1]
    too_far = [references[0], refused, _row("parameters", 300, "trained", 2.05, 100), *references[1:]]
    assert "MISSED (ratio 1.0250 to the median 2.0000" in does_not_fit.judge(too_far)[1]
    against_one = [references[1], refused, good[2]]  # one reference run: its loss is the median
    assert "MISSED (ratio 0.8458 to the median 2.4000" in does_not_fit.judge(against_one)[1]
    fewer_steps = [references[0], refused, _row("parameters", 300, "trained", 2.00, 99)]
    assert "MISSED" in does_not_fit.judge(fewer_steps)[1]
    trained_anyway = [references[0], _row("none", 300, "trained", 2.0, 100), good[2]]
    assert "MISSED (trained" in does_not_fit.judge(trained_anyway)[0]
    table = does_not_fit.format_table(good)
    assert "refused" in table and "2.0300" in table and "# none under 300 MiB: gradsync preflight" in table


def test_the_reference_runs_first_and_again_after_the_limited_settings():
    assert does_not_fit._order(3) == [("none", False), ("none", True), ("parameters", True), ("none", False),
                                      ("none", False)]
    assert does_not_fit._order(1) == list(does_not_fit.SETTINGS)


def test_every_setting_runs_the_same_training_but_its_shard_and_limit():
    options = {"memory_limit_mib": 300, "nproc": 4, "width": 64, "depth": 8, "heads": 4, "context": 32,
               "global_batch_size": 32}
    argvs = [does_not_fit.train_argv(options, shard, 300 if limited else None, Path("/x"))
             for shard, limited in does_not_fit.SETTINGS]
    assert argvs[1][-2:] == ["--memory-limit-mib", "300"] and "--memory-limit-mib" not in argvs[0]
    assert argvs[2][argvs[2].index("--shard") + 1] == "parameters"
    strip = lambda argv: [a for a in argv if a not in ("none", "parameters", "--memory-limit-mib", "300")]
    assert strip(argvs[0]) == strip(argvs[1]) == strip(argvs[2])


def test_a_bad_limit_is_refused_in_one_line(capsys):
    assert main(["bench", "fit", "--memory-limit-mib", "0"]) != 0
    assert "--memory-limit-mib must be a positive int" in capsys.readouterr().err
    assert main(["bench", "fit", "--reference-runs", "0"]) != 0
    assert "--reference-runs must be an int >= 1" in capsys.readouterr().err
