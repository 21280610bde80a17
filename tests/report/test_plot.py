import json

from covey.cli.main import main
from covey.report.plots import OPTIONAL_PANELS, PANELS, curve, default_output, panels_for
from tests.report.report_fixtures import assert_valid_png


def write_run(folder, rows):
    folder.mkdir(parents=True)
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return folder


def test_curve_keeps_only_rows_that_logged_the_key():
    rows = [{"step": 0, "eval/accuracy": 0.3}, {"step": 1, "reward/mean": 0.5},
            {"step": 2, "eval/accuracy": None}, {"step": 4, "eval/accuracy": 0.4}]
    assert curve(rows, "eval/accuracy") == [(0, 0.3), (4, 0.4)]


def test_learned_reward_panels_appear_only_when_logged():
    plain = {"a": [{"step": 1, "reward/mean": 0.5}]}
    assert panels_for(plain) == PANELS
    with_rm = {"a": plain["a"], "b": [{"step": 1, "rm/agreement": 0.75}, {"step": 2, "prm/agreement": None}]}
    assert panels_for(with_rm) == PANELS + [OPTIONAL_PANELS[0]]


def test_default_output_names(tmp_path):
    assert default_output([tmp_path / "x"]) == tmp_path / "x" / "curves.png"
    assert default_output([tmp_path / "x", tmp_path / "y"]) == tmp_path / "curves_x_vs_y.png"


def test_plot_cli_one_run_and_two_runs_overlaid(tmp_path, capsys):
    rows = [{"step": s, "reward/mean": 0.1 * s, "accuracy": 0.2, "kl/ref": 0.01 * s, "rm/agreement": 0.5 + 0.1 * s,
             "time/step": 30.0} for s in range(1, 5)] + [{"step": 0, "eval/accuracy": 0.3},
                                                          {"step": 4, "eval/accuracy": 0.4, "final": 1}]
    fixed = write_run(tmp_path / "rm_fixed", rows)
    iterative = write_run(tmp_path / "rm_iter",
                          [{**r, "rm/agreement": 0.9} if "rm/agreement" in r else r for r in rows])
    assert main(["plot", str(fixed)]) == 0
    assert capsys.readouterr().out.strip() == str(fixed / "curves.png")
    assert_valid_png(fixed / "curves.png")
    assert main(["plot", str(fixed), str(iterative)]) == 0
    assert_valid_png(tmp_path / "curves_rm_fixed_vs_rm_iter.png")
    assert main(["plot", str(fixed), str(iterative), "--out", str(tmp_path / "both.png")]) == 0
    assert_valid_png(tmp_path / "both.png")


def test_plot_cli_errors_are_one_line(tmp_path, capsys):
    assert main(["plot", str(tmp_path / "absent")]) == 2
    assert capsys.readouterr().err.strip() == (f"covey plot: error: {tmp_path / 'absent'}: no metrics.jsonl there "
                                               "(not a covey run folder)")
    a, b = write_run(tmp_path / "one" / "run", [{"step": 1}]), write_run(tmp_path / "two" / "run", [{"step": 1}])
    assert main(["plot", str(a), str(b)]) == 2
    assert "runs are told apart by folder name" in capsys.readouterr().err


def test_episode_and_mismatch_panels_appear_when_logged():
    rows = [{"step": 1, "reward/mean": 0.5, "episode/tool_calls_mean": 1.5, "tools/errors": 2,
             "episode/turns_mean": 2.0, "episode/cut_off_frac": 0.25, "sampler/log_ratio_max": 0.7}]
    keys = [key for key, _ in panels_for({"agent": rows})]
    assert keys[len(PANELS):] == ["episode/tool_calls_mean", "tools/errors", "episode/turns_mean",
                                  "episode/cut_off_frac", "sampler/log_ratio_max"]
