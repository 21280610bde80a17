"""A user's reward functions work as TRL calls them or fail at once, in one line, before any model loads.

Calls run in the main thread (math_verify's signal.alarm works there) under a watchdog that stops a
hung call at reward.timeout_s even around math_verify's own alarms; `async def` functions run; the
first line of an error is shown whole and its traceback kept in the errors log. Before the model
loads each function is checked: its signature against the data's columns, and one call on the
first training example. Weights follow TRL's reward_weights; a name of covey's own terms becomes
user:<name>.
"""

from __future__ import annotations

import asyncio
import threading
import time
from types import SimpleNamespace

import pytest

import covey
from covey.cli.main import main
from covey.config import load_config
from covey.rewards.build import RewardOptions, build_rewarder, check_user_rewards, user_terms
from covey.rewards.combine import Rewarder, RewardError, RewardTerm
from covey.tasks.base import Example
from covey.training import (
    inputs,
    loop,  # noqa: F401 - imported before timing a run: the check is timed, not torch's import
    setup,
)
from covey.training.plan import make_plan
from tests.helpers import tiny_overrides

math_verify = pytest.importorskip("math_verify")


def rewards(*keys: str) -> RewardOptions:
    """The plan's reward section of the default config with `keys`."""
    return make_plan(load_config(None, list(keys))).rewards


def in_main_thread(completions, **kwargs):
    return [float(threading.current_thread() is threading.main_thread())] * len(completions)


def verified(completions, answer, **kwargs):
    """math_verify with its default timeouts (signal.alarm: main thread only)."""
    return [float(math_verify.verify(math_verify.parse(a), math_verify.parse(c))) for c, a in zip(completions, answer)]


def hang(completions, **kwargs):
    time.sleep(30)
    return [1.0] * len(completions)


def parse_then_hang(completions, **kwargs):
    math_verify.parse("$1$")  # sets and then cancels its own SIGALRM
    time.sleep(30)
    return [1.0] * len(completions)


async def async_reward(completions, **kwargs):
    await asyncio.sleep(0)
    return [float(len(c)) for c in completions]


def score_one(fn, timeout_s: float = 30.0, **extra):
    rewarder = Rewarder([RewardTerm(fn.__name__, fn, 1.0)], on_error="zero", timeout_s=timeout_s, **extra)
    return rewarder.run_term(rewarder.terms[0], ["What is 1 + 1?"], ["The answer is $2$."], {"answer": ["2"]})


@pytest.mark.parametrize("timeout_s", [30.0, 0.0])
def test_functions_run_in_the_main_thread_so_math_verify_works(timeout_s):
    assert score_one(in_main_thread, timeout_s) == ([1.0], [None])
    assert score_one(verified, timeout_s) == ([1.0], [None])


def test_a_hung_call_is_stopped_even_after_math_verify_cancelled_its_alarm():
    """One SIGALRM timer would be replaced by math_verify's alarm(5) and cancelled by its alarm(0)."""
    t0 = time.perf_counter()
    assert score_one(parse_then_hang, timeout_s=0.3) == ([0.0], ["timed out after 0.3s (reward.timeout_s)"])
    assert time.perf_counter() - t0 < 3


def test_outside_the_main_thread_a_hung_call_is_left_behind_at_the_timeout():
    """As in the reward server's handler threads, where no signal handler can be installed."""
    out = {}
    worker = threading.Thread(target=lambda: out.update(result=score_one(hang, timeout_s=0.3)))
    t0 = time.perf_counter()
    worker.start()
    worker.join(10)
    assert out["result"] == ([0.0], ["timed out after 0.3s (reward.timeout_s)"]) and time.perf_counter() - t0 < 3


def test_async_functions_are_run_also_under_a_running_event_loop():
    assert score_one(async_reward) == ([18.0], [None])

    async def notebook_cell():  # a notebook runs its cells inside an event loop
        return score_one(async_reward)

    assert asyncio.run(notebook_cell()) == ([18.0], [None])


def test_the_first_line_is_whole_and_the_traceback_is_in_the_log(tmp_path):
    first = "no verifier for this answer: " + "x" * 300

    def long_error(completions, **kwargs):
        raise ValueError(first + "\nsecond line")

    log = tmp_path / "reward_errors.log"
    _, faults = score_one(long_error, errors_log=log)
    assert faults == [f"raised ValueError: {first} (traceback in {log})"]
    text = log.read_text()
    assert text.startswith(f"reward function 'long_error' raised ValueError: {first}\n"
                           "Traceback (most recent call last)")
    assert "in long_error\n    raise ValueError(first" in text and text.rstrip().endswith("second line")


# --------------------------------------------------------------------------- checked before the model loads


def data_with(**columns) -> SimpleNamespace:
    return SimpleNamespace(train=[Example(prompt="What is 2 + 3?", answer="5", meta=columns)], eval=[])


def needs_solution(completions, solution, **kwargs):
    return [1.0] * len(completions)


def positional_only(completions, /, **kwargs):
    return [1.0] * len(completions)


def named_columns_only(completions, topic):
    return [float(t == "sums") for t in topic]


def raises_key_error(completions, **kwargs):
    return [kwargs["score"] for _ in completions]


def scalar(completions, **kwargs):
    return 1.0


def test_a_parameter_that_is_no_column_is_one_line():
    with pytest.raises(ValueError) as err:
        check_user_rewards(rewards(), [needs_solution], data_with(topic="sums"))
    assert str(err.value) == (
        "reward function 'needs_solution' takes 'solution', which is not a column of the training data nor a keyword "
        "covey passes (answer, completion_ids, completion_lengths, completions, prompts, topic, trainer_state): "
        "rename it, give it a default, or read it from **kwargs")
    terms = check_user_rewards(rewards(), [needs_solution], data_with(solution="5"))
    assert terms[0].name == "needs_solution"


def test_a_positional_only_parameter_is_one_line():
    with pytest.raises(ValueError, match=r"^reward function 'positional_only' takes 'completions' by position only"):
        check_user_rewards(rewards(), [positional_only], data_with())


def test_a_function_without_kwargs_gets_only_what_it_names():
    terms = check_user_rewards(rewards(), named_columns_only, data_with(topic="sums"))  # one callable
    assert terms[0].keywords == {"completions", "topic"}
    assert Rewarder(terms)(["p"] * 2, ["a", "b"], {"answer": ["1", "1"], "topic": ["sums", "x"]}).total.tolist() == [
        1.0, 0.0]


@pytest.mark.parametrize("fn, fault", [
    (raises_key_error, "raised KeyError: 'score'"),
    (scalar, "returned float, not a list of 1 values"),
])
def test_the_call_before_training_names_the_function_and_the_error(fn, fault):
    with pytest.raises(RewardError) as err:
        check_user_rewards(rewards(), [fn], data_with())
    assert str(err.value) == (f"reward function '{fn.__name__}' {fault}, called before training on the first "
                              "training prompt ('What is 2 + 3?') with the completion 'The answer is 5.'")


def test_weights_as_trls_reward_weights():
    def f(completions, **kwargs):
        return [1.0] * len(completions)

    def g(completions, **kwargs):
        return [2.0] * len(completions)

    terms = user_terms([f, g, "tests.helpers:varied_reward"], [1.0, 0.5, 2])
    assert [(t.name, t.weight) for t in terms] == [("f", 1.0), ("g", 0.5), ("varied_reward", 2.0)]
    assert Rewarder(terms[:2])(["p"], ["c"], {}).total.tolist() == [2.0]  # 1 * 1 + 0.5 * 2
    with pytest.raises(ValueError, match=r"^reward_weights \[1.0\] must hold one finite number for each of the 2 "):
        user_terms([f, g], [1.0])
    with pytest.raises(ValueError, match="has a weight in its name and one in reward_weights: give it once"):
        user_terms(["tests.helpers:varied_reward:3"], [1.0])


def test_a_function_named_like_a_builtin_term_is_user_colon_name():
    def format(completions, **kwargs):  # noqa: A001 - the clash under test
        return [0.0] * len(completions)

    rewarder = build_rewarder(rewards("reward.format=0.5"), extra=[format])
    assert [t.name for t in rewarder.terms] == ["correctness", "format", "user:format"]


def broken_reward(completions, **kwargs):
    raise KeyError("score")


def test_a_broken_function_fails_in_seconds_before_any_model_loads(tiny_model_dir, tmp_path, capsys, monkeypatch):
    loaded = []
    monkeypatch.setattr(inputs, "resolve_model_path", lambda *a, **k: loaded.append("found"))
    monkeypatch.setattr(setup, "load_policy", lambda *a, **k: loaded.append("loaded"))
    t0 = time.perf_counter()
    code = main(["train", *tiny_overrides(tiny_model_dir, tmp_path, **{
        "reward.functions": "tests.rewards.test_reward_checks:broken_reward"})])
    seconds = time.perf_counter() - t0
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and loaded == [] and seconds < 5, (err, loaded, seconds)
    assert err[0].startswith("covey train: error: reward function 'tests.rewards.test_reward_checks:broken_reward' "
                             f"raised KeyError: 'score' (traceback in {tmp_path / 't' / 'reward_errors.log'}), "
                             "called before training on the first training prompt (")


def test_one_callable_is_a_list_of_one_and_is_checked_first(tiny_model_dir, tmp_path, monkeypatch):
    monkeypatch.setattr(setup, "load_policy", lambda *a, **k: pytest.fail("a model was loaded"))
    cfg = load_config(None, tiny_overrides(tiny_model_dir, tmp_path))
    with pytest.raises(ValueError, match=r"^reward function 'needs_solution' takes 'solution', which is not a column"):
        covey.train(cfg, reward_funcs=needs_solution)
