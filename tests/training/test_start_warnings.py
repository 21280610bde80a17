"""What a run says at start about its data and its measure, before any model loads."""

from pathlib import Path

from covey.config import load_config
from covey.tasks.base import Example
from covey.tasks.data import TaskData
from covey.training.plan import make_plan
from covey.training.setup import choose_verifier, print_header


def data(answers_train, answers_eval, overlap=0):
    return TaskData([Example(f"q{i}", a) for i, a in enumerate(answers_train)],
                    [Example(f"h{i}", a) for i, a in enumerate(answers_eval)], overlap=overlap)


def test_auto_reads_numbers_with_math_and_text_with_normalized(capsys):
    assert choose_verifier(make_plan(load_config(None, [])), data(["12", "7"], ["3"])) == "math"
    assert capsys.readouterr().out == "covey: held-out metric: accuracy by the math verifier (eval.metric=auto)\n"
    assert choose_verifier(make_plan(load_config(None, [])), data(["Paris", "7"], ["Rome"])) == "normalized"
    assert "warning" not in capsys.readouterr().out


def test_math_on_text_answers_warns_with_the_count(capsys):
    assert choose_verifier(make_plan(load_config(None, ["eval.metric=math"])), data(["Paris", "7"], ["Rome"])) == "math"
    lines = capsys.readouterr().out.splitlines()
    assert lines == ["covey: held-out metric: accuracy by the math verifier",
                     "covey: warning: 2 of 3 reference answers are not numbers, which the math verifier scores 0 "
                     "whatever the model writes: set eval.metric=normalized, exact or contains"]


def test_reward_metric_names_its_threshold(capsys):
    cfg = load_config(None, ["eval.metric=reward", "eval.reward_threshold=0.5"])
    assert choose_verifier(make_plan(cfg), data(["12"], ["3"])) == "math"  # the correctness reward's verifier
    assert capsys.readouterr().out == "covey: held-out metric: reward >= 0.5 (eval.metric=reward)\n"


def test_held_out_rows_seen_in_training_are_announced(capsys):
    print_header(Path("runs/x"), "file", data(["1", "2", "3"], ["1", "2"], overlap=2))
    out = capsys.readouterr().out.splitlines()
    assert out[-1] == ("covey: warning: 2 of 2 held-out examples are also training examples (same prompt "
                       "and answer): held-out accuracy overstates what was learned")


def test_a_missing_model_is_one_line_before_anything_is_printed(tmp_path, capsys):
    from covey.cli.main import main
    code = main(["train", "model.path=/no/such/model", f"train.output_dir={tmp_path}", "train.steps=1"])
    out, err = capsys.readouterr()
    assert code == 2 and out == "", out  # no device, run folder or task line before the error
    assert err.strip() == "covey train: error: model path not found: /no/such/model"
