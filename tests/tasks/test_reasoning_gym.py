"""reasoning-gym datasets by name (covey/tasks/reasoning_gym.py): loading, the generator's options, the
seeded split, the dataset's score_answer as the reward and the held-out metric, and a short CLI run.
Skipped where reasoning-gym is not installed (it is in the `test` extra), but for the missing-package error."""

import functools
import json
import sys
from importlib.util import find_spec
from types import SimpleNamespace

import pytest
import yaml

from covey.cli.main import main
from covey.config import ConfigError, config_yaml, load_config
from covey.rewards.rules import correctness_reward
from covey.rewards.scoring import example_columns
from covey.tasks.data import load_run_data, load_task_data
from covey.tasks.reasoning_gym import read_answer, reasoning_gym_splits
from covey.training.evaluate import Judge
from tests.helpers import tiny_overrides

needs_rg = pytest.mark.skipif(find_spec("reasoning_gym") is None, reason="needs reasoning-gym (covey[reasoning-gym])")
CHAIN = ["task.name=reasoning_gym:chain_sum", "task.train_size=12", "task.eval_size=6"]
TWO_DIGITS = {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1}
"""chain_sum with two one-digit terms: a in 0..9, b in 0..9, + or -: 10 * 10 * 2 = 200 distinct questions."""


def terms(prompt: str) -> list[str]:
    """'State the final answer to the following arithmetic problem: 4 - 1 - 7 =' -> ['4', '-', '1', '-', '7']."""
    return prompt.rsplit(":", 1)[1].removesuffix("=").split()


@needs_rg
def test_a_dataset_loads_by_name_and_its_answers_are_right():
    cfg, data = load_run_data(load_config(None, CHAIN))
    assert (len(data.train), len(data.eval), cfg.eval.metric) == (12, 6, "reasoning_gym")  # auto -> its scorer
    for ex in data.train + data.eval:
        parts = terms(ex.prompt)
        value = int(parts[0])
        for op, x in zip(parts[1::2], parts[2::2]):
            value += int(x) if op == "+" else -int(x)
        assert ex.answer == str(value)  # recomputed from the question's own numbers
        assert ex.meta["reasoning_gym"]["entry"]["question"] == ex.prompt
        assert ex.meta["reasoning_gym"]["dataset"] == "chain_sum"


@needs_rg
@pytest.mark.parametrize("given", [
    [f"task.reasoning_gym.{k}={v}" for k, v in TWO_DIGITS.items()],
    ["task.reasoning_gym={min_terms: 2, max_terms: 2, min_digits: 1, max_digits: 1}"],
])
def test_the_generators_options_pass_through(given, tmp_path):
    cfg = load_config(None, [*CHAIN, *given])
    assert cfg.task.reasoning_gym == TWO_DIGITS
    for ex in load_task_data(cfg.task, 0).train:
        parts = terms(ex.prompt)
        assert len(parts) == 3 and all(len(x) == 1 for x in parts[::2])  # two one-digit terms, as asked
    # the run's config.yaml holds them as a mapping and reads back the same (covey eval RUN_DIR)
    path = tmp_path / "config.yaml"
    path.write_text(config_yaml(cfg))
    assert yaml.safe_load(path.read_text())["task"]["reasoning_gym"] == TWO_DIGITS
    assert load_config(str(path)).task.reasoning_gym == TWO_DIGITS
    mine = tmp_path / "mine.yaml"
    mine.write_text("task:\n  name: reasoning_gym:chain_sum\n  reasoning_gym:\n    min_terms: 2\n    max_terms: 2\n")
    assert load_config(str(mine), ["task.reasoning_gym.max_digits=1"]).task.reasoning_gym == {
        "min_terms": 2, "max_terms": 2, "max_digits": 1}


@needs_rg
@pytest.mark.parametrize("overrides, message", [
    (["task.reasoning_gym.min_term=2"], "task.reasoning_gym.min_term: reasoning-gym's chain_sum has no option "
                                        "'min_term' (did you mean min_terms?); its options: allow_negation, "
                                        "max_digits, max_terms, min_digits, min_terms"),
    (["task.reasoning_gym.seed=3"], "task.reasoning_gym.seed: covey sets the seed of reasoning_gym:chain_sum itself "
                                    "(train.seed draws the split)"),
    (["task.reasoning_gym.min_terms=0"], "task.reasoning_gym: reasoning-gym's chain_sum refuses the options "
                                         "{'min_terms': 0}: min_terms must be positive"),
    (["task.name=reasoning_gym:chainsum"], "task.name=reasoning_gym:chainsum: reasoning-gym has no dataset "
                                           "'chainsum' (did you mean chain_sum"),
])
def test_bad_options_are_one_line_naming_the_key_and_the_dataset(overrides, message):
    with pytest.raises(ConfigError) as err:
        load_run_data(load_config(None, [*CHAIN, *overrides]))
    assert str(err.value).startswith(message) and "\n" not in str(err.value)


@pytest.mark.parametrize("overrides, message", [
    (["task.reasoning_gym.min_terms=2"], "task.reasoning_gym is for a reasoning-gym dataset "
                                         "(task.name=reasoning_gym:<dataset>), not task.name=arithmetic"),
    (["eval.metric=reasoning_gym"], "eval.metric=reasoning_gym is for a reasoning-gym dataset "
                                    "(task.name=reasoning_gym:<dataset>), not task.name=arithmetic"),
])
def test_its_keys_are_refused_for_other_tasks(overrides, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        load_run_data(load_config(None, ["task.train_size=4", "task.eval_size=2", *overrides]))


def test_a_missing_package_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "reasoning_gym", None)  # import reasoning_gym now raises ImportError
    with pytest.raises(ConfigError, match=r"needs the optional package reasoning-gym: pip install "
                                          r"'covey\[reasoning-gym\]'$"):
        load_task_data(load_config(None, CHAIN).task, 0)


@needs_rg
def test_the_seed_draws_the_split_held_out_first_and_disjoint():
    train, held = reasoning_gym_splits("reasoning_gym:chain_sum", TWO_DIGITS, 150, 40, seed=0)
    again, held_again = reasoning_gym_splits("reasoning_gym:chain_sum", TWO_DIGITS, 150, 40, seed=0)
    assert [ex.prompt for ex in train] == [ex.prompt for ex in again]  # the same seed, the same problems
    assert [ex.prompt for ex in held] == [ex.prompt for ex in held_again]
    # 190 of the 200 questions there are: distinct within each side, none on both (drawn over several rounds)
    assert len({ex.prompt for ex in train}) == 150 and len({ex.prompt for ex in held}) == 40
    assert not {ex.prompt for ex in train} & {ex.prompt for ex in held}
    _, other = reasoning_gym_splits("chain_sum", TWO_DIGITS, 150, 40, seed=1)
    assert [ex.prompt for ex in other] != [ex.prompt for ex in held]  # another seed, another held-out draw
    _, fewer = reasoning_gym_splits("chain_sum", TWO_DIGITS, 10, 40, seed=0)
    assert [ex.prompt for ex in fewer] == [ex.prompt for ex in held]  # held-out does not move with train_size
    with pytest.raises(ConfigError, match="drew 160 distinct questions of the 161 asked"):  # 200 - 40 held out
        reasoning_gym_splits("chain_sum", TWO_DIGITS, 161, 40, seed=0)


def one_row(dataset: str, question: str, answer: str):
    """An Example of `dataset` with a hand-written entry."""
    from covey.tasks.reasoning_gym import as_example
    return as_example(dataset, {}, {"question": question, "answer": answer, "metadata": {}})


@needs_rg
def test_score_answer_is_the_reward_and_the_held_out_metric():
    # chain_sum scores by decimal value (1 or 0); spell_backward gives partial credit per letter in place;
    # basic_arithmetic keeps reasoning-gym's default: the reference inside a longer answer scores len(ref)/len(answer)
    rows = [one_row("chain_sum", "State the final answer to the following arithmetic problem: 4 - 1 - 7 =", "-4")] * 4
    rows += [one_row("spell_backward", "Spell this word backward (example: sun -> nus): ammonia", "ainomma")] * 3
    rows += [one_row("basic_arithmetic", "Calculate 6 * 7.", "42")]
    completions = [
        "4 - 1 = 3, 3 - 7 = -4. <answer>-4</answer>",  # tagged: 1
        "4 - 1 - 7 = -4",  # the last number, as covey's math tasks read it: 1
        "The answer is -4 or -5.",  # hedged: no answer read, 0
        "4 - 1 - 7 = 10",  # wrong: 0
        "ainomma",  # the whole completion: 1
        "Answer: ainommb",  # 6 of the 7 letters in place: 6/7
        "<answer>ammonia</answer>",  # the 1st, 4th and 7th letters (a, o, a) in place: 3/7
        "The answer is 142.",  # '42' inside '142': 2/3
    ]
    expected = [1.0, 1.0, 0.0, 0.0, 1.0, 6 / 7, 3 / 7, 2 / 3]
    reward = functools.partial(correctness_reward, verifier="reasoning_gym")  # as build_rewarder binds it
    assert reward([ex.prompt for ex in rows], completions, **example_columns(rows)) == pytest.approx(expected)
    out = SimpleNamespace(completions=completions, example_index=list(range(len(rows))))
    passed, values = Judge("reasoning_gym")(out, rows, [ex.prompt for ex in rows])
    assert values == pytest.approx(expected)
    assert passed == [True, True, False, False, True, False, False, False]  # held-out accuracy: scored 1


@needs_rg
def test_read_answer_writes_a_number_as_the_reference_does():
    assert read_answer("<answer> 1,234 </answer>", "1234") == "1234"
    assert read_answer("so it is 4.0", "4") == "4"
    assert read_answer("no number here", "4") is None
    assert read_answer("  \\boxed{138/583} ", "138/583") == "138/583"  # not a number: the marked text


@needs_rg
def test_covey_train_runs_two_steps_and_eval_reads_the_run_back(tiny_model_dir, tmp_path, capsys):
    extra = {"task.name": "reasoning_gym:chain_sum", "task.reasoning_gym.max_terms": 3}
    assert main(["train", *tiny_overrides(tiny_model_dir, tmp_path, **extra)]) == 0
    run = tmp_path / "t"
    recorded = yaml.safe_load((run / "config.yaml").read_text())
    assert recorded["task"]["reasoning_gym"] == {"max_terms": 3} and recorded["eval"]["metric"] == "reasoning_gym"
    steps = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in steps if "reward/correctness" in m] == [1, 2]
    capsys.readouterr()
    assert main(["eval", str(run), "rollout.eval_max_new_tokens=4"]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["metric"] == "accuracy (reasoning_gym)" and result["eval/n"] == 4
