"""Reward faults: raises (sys.exit included), NaN/inf, non-number, wrong count, timeout; under raise | zero | drop.
(None is not a fault: it is TRL's "not scored", tested in tests/rewards/test_trl_convention.py.)

Unit tests on `Rewarder` (the call runs in the main thread, where a watchdog stops it at
reward.timeout_s; the first line of an error whole, its traceback in the errors log), then the
training loop: the error names the function and the first bad sample, the counters land in
metrics.jsonl, the previous checkpoint stays intact, and a run whose rewards fail on every step
stops non-zero after reward.max_failed_steps steps.
"""

from __future__ import annotations

import subprocess
import sys
import time

import pytest
import torch

from covey.cli.main import main
from covey.rewards.combine import Rewarder, RewardError, RewardTerm
from covey.runtime.metrics import read_metrics
from covey.training.checkpoint import list_checkpoints
from tests.helpers import tiny_overrides

COMPLETIONS = ["ok one", "bad two\nsecond line", "ok three", "ok four"]
STATE = {"broken": True}


def good(prompts, completions, **_):
    return [1.0] * len(completions)


def _per_sample(bad_value):
    return lambda prompts, completions, **_: [bad_value if "bad" in c else 1.0 for c in completions]


def raises(prompts, completions, **_):
    raise ValueError("remote scorer said no\nwith a traceback line")


def sleeps(prompts, completions, **_):
    time.sleep(3)
    return [1.0] * len(completions)


def one_short(prompts, completions, **_):
    return [1.0] * (len(completions) - 1)


FAULTS = {
    "raises": (raises, "raised ValueError: remote scorer said no", "all"),
    "exits": (lambda prompts, completions, **_: sys.exit(0), "called sys.exit(0)", "all"),
    "nan": (_per_sample(float("nan")), "returned nan", "one"),
    "inf": (_per_sample(float("inf")), "returned inf", "one"),
    "text": (_per_sample("high"), "returned non-number 'high'", "one"),
    "count": (one_short, "returned 3 values for 4 samples", "all"),
    "scalar": (lambda prompts, completions, **_: 1.0, "returned float, not a list of 4 values", "all"),
    "timeout": (sleeps, "timed out after 0.2s (reward.timeout_s)", "all"),
}


def score(fn, on_error):
    terms = [RewardTerm("good", good, 1.0), RewardTerm("flaky", fn, 2.0)]
    return Rewarder(terms, on_error=on_error, timeout_s=0.2)(["p"] * 4, COMPLETIONS, {})


@pytest.mark.parametrize("fault", FAULTS)
def test_raise_names_function_and_first_bad_sample(fault):
    fn, text, scope = FAULTS[fault]
    first = 0 if scope == "all" else 1
    with pytest.raises(RewardError) as info:
        score(fn, "raise")
    message = str(info.value)
    assert message == (f"reward function 'flaky' {text} (first bad sample #{first}: "
                       f"{COMPLETIONS[first]!r})")
    assert "\n" not in message


@pytest.mark.parametrize("fault", FAULTS)
def test_zero_scores_faulty_samples_0_and_counts(fault):
    fn, _, scope = FAULTS[fault]
    out = score(fn, "zero")
    bad = [True] * 4 if scope == "all" else [False, True, False, False]
    # total = 1 * good + 2 * flaky, flaky = 1 where fine, 0 where faulty
    assert out.total.tolist() == [1.0 if b else 3.0 for b in bad]
    assert out.errors == sum(bad) and out.valid.all()


@pytest.mark.parametrize("fault", FAULTS)
def test_drop_marks_faulty_samples_invalid(fault):
    fn, _, scope = FAULTS[fault]
    out = score(fn, "drop")
    bad = [True] * 4 if scope == "all" else [False, True, False, False]
    assert out.valid.tolist() == [not b for b in bad] and out.errors == sum(bad)


def test_tensor_and_array_results_are_accepted():
    import numpy as np
    terms = [RewardTerm("t", lambda prompts, completions, **_: torch.ones(len(completions)), 1.0),
             RewardTerm("a", lambda prompts, completions, **_: np.full(len(completions), 2.0), 1.0)]
    assert Rewarder(terms)(["p"] * 4, COMPLETIONS, {}).total.tolist() == [3.0] * 4


def test_hung_reward_function_does_not_block_process_exit():
    """The sleep is interrupted in the main thread (a hung call elsewhere is left in a daemon thread, which
    does not keep the process alive; a thread-pool worker would be joined at exit)."""
    code = ("from covey.rewards.combine import Rewarder, RewardTerm; import time\n"
            "hang = RewardTerm('hang', lambda prompts, completions, **_: time.sleep(600), 1.0)\n"
            "r = Rewarder([hang], on_error='zero', timeout_s=0.1)\n"
            "print(r(['p'], ['c'], {}).errors)")
    t0 = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stdout.strip() == "1", done.stderr[-1000:]
    assert time.perf_counter() - t0 < 30


# --------------------------------------------------------------------------- in the training loop


def fails_from_step_2(prompts, completions, trainer_state, **_):
    """Fine before training and on step 1, raises from step 2 on while STATE says it is broken."""
    if STATE["broken"] and trainer_state.global_step >= 1:
        raise RuntimeError("verifier crashed")
    return [float(len(c) % 2) for c in completions]


def nan_on_short(prompts, completions, **_):
    return [float("nan") if sum(map(ord, c)) % 2 else 1.0 for c in completions]


def always_raises(prompts, completions, **_):
    raise ConnectionError("reward server down")


@pytest.fixture(autouse=True)
def reset_calls():
    STATE["broken"] = True


def train(model_dir, out, fn: str, on_error: str, **extra) -> int:
    return main(["train", *tiny_overrides(model_dir, out, **{
        "model.threads": 1, "train.save_every": 1, "reward.on_error": on_error,
        "reward.functions": f"tests.training.test_faults_reward:{fn}", **extra})])


def test_raise_stops_with_one_line_and_keeps_the_checkpoint(tiny_model_dir, tmp_path, capsys):
    code = train(tiny_model_dir, tmp_path, "fails_from_step_2", "raise", **{"train.steps": 3})
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert code == 2
    log = tmp_path / "t" / "reward_errors.log"
    assert err.startswith("covey train: error: reward function 'tests.training.test_faults_reward:fails_from_step_2' "
                          f"raised RuntimeError: verifier crashed (traceback in {log}) (first bad sample #0: ")
    assert [p.name for p in list_checkpoints(tmp_path / "t")] == ["step-000001"]
    assert [r["step"] for r in read_metrics(tmp_path / "t")] == [0, 1]
    STATE["broken"] = False  # the function works again: the run continues from step 1
    assert train(tiny_model_dir, tmp_path, "fails_from_step_2", "raise",
                 **{"train.steps": 3, "train.resume": "auto"}) == 0


@pytest.mark.parametrize("on_error, counter", [("zero", "reward/errors"), ("drop", "reward/dropped")])
def test_zero_and_drop_are_counted_in_metrics(tiny_model_dir, tmp_path, on_error, counter):
    assert train(tiny_model_dir, tmp_path, "nan_on_short", on_error, **{"train.steps": 2}) == 0
    steps = [r for r in read_metrics(tmp_path / "t") if "reward/mean" in r]
    assert len(steps) == 2
    # the tiny model writes random text: about half the samples are faulty
    assert all(0 < r[counter] < 8 for r in steps), [r[counter] for r in steps]
    assert all(r["reward/errors"] >= r[counter] for r in steps)
    if on_error == "zero":
        assert all(r["reward/dropped"] == 0 for r in steps)


def fails_in_batches(prompts, completions, **_):
    """Passes the one-completion call made before training, then raises on every training batch."""
    if len(completions) > 1:
        raise ConnectionError("reward server down")
    return [1.0] * len(completions)


def nan_at_even(prompts, completions, **_):
    return [float("nan") if i % 2 == 0 else 1.0 for i in range(len(completions))]


def nan_at_odd(prompts, completions, **_):
    return [float("nan") if i % 2 else 1.0 for i in range(len(completions))]


def never_scores(prompts, completions, **_):
    return [None] * len(completions)


def exits_in_batches(prompts, completions, **_):
    if len(completions) > 1:
        sys.exit(0)
    return [1.0] * len(completions)


def last_error(capsys) -> str:
    return capsys.readouterr().err.strip().splitlines()[-1]


def test_every_sample_dropped_skips_the_step_then_stops(tiny_model_dir, tmp_path, capsys):
    """Two functions that fault on alternate samples: neither fails on every sample, every sample is dropped."""
    code = train(tiny_model_dir, tmp_path, "nan_at_even,tests.training.test_faults_reward:nan_at_odd", "drop",
                 **{"train.steps": 5, "reward.max_failed_steps": 2})
    assert code == 2
    assert last_error(capsys) == (
        "covey train: error: every sample was dropped by reward faults for 2 steps in a row (reward.on_error=drop; "
        "reward/errors in metrics.jsonl): fix the reward functions, or set reward.max_failed_steps higher "
        "(0 = never stop)")
    steps = [r for r in read_metrics(tmp_path / "t") if r["step"] > 0]
    assert [(r["step"], r["optim/skipped_steps"], r["reward/dropped"]) for r in steps] == [(1, 1, 8)]
    assert [p.name for p in list_checkpoints(tmp_path / "t")] == ["step-000001"]


@pytest.mark.parametrize("on_error", ["zero", "drop"])
def test_a_function_failing_on_every_sample_stops_the_run(tiny_model_dir, tmp_path, capsys, on_error):
    code = train(tiny_model_dir, tmp_path, "fails_in_batches", on_error,
                 **{"train.steps": 5, "reward.max_failed_steps": 2})
    assert code == 2
    log = tmp_path / "t" / "reward_errors.log"
    assert last_error(capsys) == (
        "covey train: error: reward function 'tests.training.test_faults_reward:fails_in_batches' failed on every "
        f"sample for 2 steps in a row (reward.on_error={on_error}; last: raised ConnectionError: reward server "
        f"down (traceback in {log})): fix it, or set reward.max_failed_steps higher (0 = never stop)")
    trace = log.read_text()
    assert trace.count("Traceback (most recent call last)") == 1  # the same error is logged once
    assert 'in fails_in_batches\n    raise ConnectionError("reward server down")' in trace
    assert [r["reward/errors"] for r in read_metrics(tmp_path / "t") if r["step"] > 0] == [8]


def test_no_sample_scored_for_k_steps_stops_the_run(tiny_model_dir, tmp_path, capsys):
    code = train(tiny_model_dir, tmp_path, "never_scores", "raise",
                 **{"train.steps": 5, "reward.max_failed_steps": 2, "reward.correctness": 0})
    assert code == 2
    assert last_error(capsys) == (
        "covey train: error: no reward function scored any sample for 2 steps in a row (each returned None): "
        "nothing to learn from; check when the functions return None, or set reward.max_failed_steps higher "
        "(0 = never stop)")


def test_sys_exit_in_a_reward_is_a_reward_error_not_exit_0(tiny_model_dir, tmp_path, capsys):
    code = train(tiny_model_dir, tmp_path, "exits_in_batches", "raise")
    assert code == 2
    log = tmp_path / "t" / "reward_errors.log"
    assert last_error(capsys).startswith(
        "covey train: error: reward function 'tests.training.test_faults_reward:exits_in_batches' called sys.exit(0) "
        f"(traceback in {log}) (first bad sample #0: ")
    assert "SystemExit: 0" in log.read_text()
