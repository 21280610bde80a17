"""Steps without learning signal are said out loud: the cause named at the first one (under the progress bar
too), counted in the run's last line, and DAPO's overlong filter warned about before training."""

from __future__ import annotations

import pytest

from covey.cli.main import main
from covey.training.signal_watch import SignalWatch, no_signal_cause
from tests.helpers import tiny_overrides

KEYS = {"max_new_tokens": 8, "mask_truncated": True, "episodes": False}


def step(**metrics) -> dict:
    return {"signal/trained_tokens": 40, "signal/advantage_abs_max": 0.0, "signal/samples": 8,
            "reward/mean": 0.0, "reward/std": 0.0, **metrics}


@pytest.mark.parametrize("metrics, keys, expected", [
    (step(**{"signal/advantage_abs_max": 0.7}), KEYS, None),  # a token with A != 0: signal
    (step(**{"signal/trained_tokens": 0, "response/truncated_frac": 1.0}), KEYS,
     "every reply hit rollout.max_new_tokens=8 and algo.mask_truncated took all of them out of the loss"),
    (step(**{"reward/errors": 8}), KEYS, "8 reward calls failed"),
    (step(**{"reward/unscored": 8}), KEYS, "every reward function returned None"),
    (step(**{"tools/calls": 0}), {**KEYS, "episodes": True}, "no episode called a tool"),
    (step(), KEYS, "every group's rewards are equal (all 0)"),
])
def test_each_cause_is_named(metrics, keys, expected):
    cause = no_signal_cause(metrics, keys)
    assert cause is None if expected is None else expected in cause


def test_the_first_step_is_said_once_and_every_step_counted():
    watch = SignalWatch(KEYS)
    lines = [watch.observe(s, step()) for s in (1, 2)] + [watch.observe(3, step(**{"signal/advantage_abs_max": 1}))]
    assert lines[0].startswith("covey: step 1 has no learning signal: ") and lines[1:] == [None, None]
    assert watch.summary(3) == "; 2 of 3 steps without learning signal"


def test_overlong_filtering_with_every_reply_cut_is_said_before_training_and_at_the_first_step(
        tiny_model_dir, tmp_path, capsys):
    # the random tiny model almost never writes its end token within 4 tokens: every reply is truncated
    code = main(["train", *tiny_overrides(tiny_model_dir, tmp_path, **{
        "algo.mask_truncated": "true", "rollout.max_new_tokens": 4, "rollout.eval_max_new_tokens": 4,
        "train.progress": "true"})])
    out = capsys.readouterr()
    text = out.out + out.err
    assert code == 0
    assert "of the untrained policy's held-out answers hit their token budget, and algo.mask_truncated" in text
    assert ("covey: step 1 has no learning signal: every reply hit rollout.max_new_tokens=4 and "
            "algo.mask_truncated took all of them out of the loss") in text
    assert text.count("has no learning signal") == 1
    assert "; 2 of 2 steps without learning signal" in text


def test_a_reward_function_that_fails_on_every_real_reply_is_said(tiny_model_dir, tmp_path, capsys):
    # passes the check before loading (its placeholder reply starts with "The answer"), fails on every real one
    (tmp_path / "picky.py").write_text(
        "def picky(completions, **kwargs):\n"
        "    if not all(c.startswith('The answer') for c in completions):\n"
        "        raise ValueError('unexpected reply')\n"
        "    return [1.0 for _ in completions]\n")
    code = main(["train", *tiny_overrides(tiny_model_dir, tmp_path, **{
        "reward.functions": f"{tmp_path / 'picky.py'}:picky", "reward.correctness": 0.0,
        "reward.on_error": "zero"})])
    text = capsys.readouterr().out
    assert code == 0
    assert "covey: step 1 has no learning signal: every group's rewards are equal and" in text
    assert "reward calls failed" in text and "; 2 of 2 steps without learning signal" in text
