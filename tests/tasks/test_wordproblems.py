"""Word problems: seeded stories, a held-out side disjoint by the arithmetic itself, answers that
follow from the story's own numbers, the verifier's near-misses, and the task.word_steps check."""

import ast
import json
import operator
import re
from fractions import Fraction

import pytest

from covey.cli.main import main
from covey.config import ConfigError, load_config
from covey.rewards.rules import correctness_reward
from covey.tasks import Example, generate_wordproblems, wordproblem_splits
from covey.tasks.data import load_task_data
from covey.tasks.wordproblems import held_out, is_correct
from tests.helpers import tiny_overrides

_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}


def _evaluate(node) -> Fraction:
    """An expression of whole numbers and + - * / evaluated exactly (no eval())."""
    if isinstance(node, ast.Expression):
        return _evaluate(node.body)
    if isinstance(node, ast.Constant) and isinstance(node.value, int):
        return Fraction(node.value)
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        return _OPS[type(node.op)](_evaluate(node.left), _evaluate(node.right))
    raise AssertionError(f"unexpected node {ast.dump(node)}")


def _numbers(text: str) -> list[int]:
    return [int(n) for n in re.findall(r"\d+", text)]


# Tom: 3 boxes of 12 apples (36), gives 7 away (29). Intermediate 36, story numbers 3, 12, 7.
EX = Example("Tom has 3 boxes with 12 apples in each box. He gives 7 apples to Anna. "
             "How many apples does Tom have now?", "29",
             {"expression": "3*12 - 7", "numbers": [3, 12, 7], "values": [36, 29], "steps": 2})


def test_generation_is_seeded_and_prompts_are_distinct():
    exs = generate_wordproblems(300, seed=0, steps=2)
    assert exs == generate_wordproblems(300, seed=0, steps=2)
    assert exs != generate_wordproblems(300, seed=1, steps=2)
    assert len({e.prompt for e in exs}) == 300


@pytest.mark.parametrize("steps", [1, 2, 3, 4])
def test_every_answer_follows_from_the_storys_own_numbers(steps):
    for e in generate_wordproblems(200, seed=5, steps=steps):
        expression = e.meta["expression"]
        # the story states exactly the numbers of the expression, in the same order, in digits
        assert _numbers(e.prompt) == _numbers(expression) == e.meta["numbers"]
        # one operator per step (the share's parentheses are not operations)
        assert len(re.findall(r"[-+*/]", expression)) == steps == e.meta["steps"]
        value = _evaluate(ast.parse(expression, mode="eval"))
        assert value.denominator == 1 and str(value.numerator) == e.answer == str(e.meta["values"][-1])
        assert all(v > 0 for v in e.meta["values"]) and len(e.meta["values"]) == steps
        # neither copying a number of the story nor stopping a step early gives the answer
        assert int(e.answer) not in e.meta["numbers"] and int(e.answer) not in e.meta["values"][:-1]
        assert e.prompt.endswith("?")


def test_difficulty_knob_changes_the_problems():
    one, three = generate_wordproblems(50, seed=0, steps=1), generate_wordproblems(50, seed=0, steps=3)
    assert {e.meta["steps"] for e in one} == {1} and {e.meta["steps"] for e in three} == {3}
    assert not {e.prompt for e in one} & {e.prompt for e in three}
    assert sum(len(e.prompt) for e in three) > sum(len(e.prompt) for e in one)
    with pytest.raises(ValueError, match="1 to 4 steps"):
        generate_wordproblems(1, seed=0, steps=5)


@pytest.mark.parametrize("steps", [1, 2])
def test_splits_are_disjoint_by_the_arithmetic_and_eval_ignores_n_train(steps):
    train, held = wordproblem_splits(600, 200, seed=3, steps=steps)
    assert len(train) == 600 and len(held) == 200
    assert not {e.meta["expression"] for e in train} & {e.meta["expression"] for e in held}
    assert not {e.prompt for e in train} & {e.prompt for e in held}
    assert all(held_out(e.meta["expression"], 3) for e in held)
    assert not any(held_out(e.meta["expression"], 3) for e in train)
    assert wordproblem_splits(10, 200, seed=3, steps=steps)[1] == held
    assert wordproblem_splits(10, 200, seed=4, steps=steps)[1] != held


def test_a_request_the_generator_cannot_meet_fails_in_one_line_instead_of_looping(monkeypatch):
    from covey.tasks import wordproblems
    monkeypatch.setattr(wordproblems, "_acceptable", lambda story: False)
    with pytest.raises(ValueError, match="could not draw 5 distinct word problems of 1 step"):
        wordproblem_splits(5, 5, seed=0, steps=1)


@pytest.mark.parametrize("completion", [
    "Tom has 3 x 12 = 36 apples.\nHe gives away 7, so he has 36 - 7 = 29 apples left.\n#### 29\nThe answer is: 29",
    "Answer: 29",
    "3 * 12 = 36, 36 - 7 = 29. The answer is 29 apples.",
    "He has 29 apples now.",                          # no marker: the last number
    "\\boxed{29}",
    "Tom has 1,029 - 1,000 = 29 apples. Answer: 29.",
])
def test_right_answers_score(completion):
    assert is_correct(completion, EX)
    assert correctness_reward([EX.prompt], [completion], [EX.answer]) == [1.0]


@pytest.mark.parametrize("completion", [
    "Answer: 30",                                     # off by one
    "Answer: 28",                                     # off by one
    "He has 29 apples... no wait. The answer is 36.",  # the right number, but not as the final answer
    "The answer is 36. 36 - 7 = 29",                  # marked answer wins over the last number
    "The answer is 29 or 30.",                        # hedging
    "Answer: 29 or 28",                               # hedging
    "Tom has 3 x 12 = 36 apples.",                    # stopped at the intermediate step
    "3 * 12 = 36\n36 - 7 = 29\n#### 36",              # the intermediate step given as the answer
    "Answer: 7",                                      # a number copied from the story
    "3 * 12 - 7",                                     # the expression, not its value
    "Answer: 29.5",                                   # close is not equal
    "",
])
def test_near_misses_score_zero(completion):
    assert not is_correct(completion, EX)
    assert correctness_reward([EX.prompt], [completion], [EX.answer]) == [0.0]


def test_the_task_is_selected_by_name_and_its_knob():
    cfg = load_config(None, ["task.name=wordproblems", "task.word_steps=3", "task.train_size=40", "task.eval_size=20"])
    data = load_task_data(cfg.task, seed=cfg.train.seed)
    assert len(data.train) == 40 and len(data.eval) == 20
    assert {e.meta["steps"] for e in data.train + data.eval} == {3}
    assert data.eval == wordproblem_splits(40, 20, seed=0, steps=3)[1]
    assert load_config(None, ["task.name=wordproblems"]).task.word_steps == 1


@pytest.mark.parametrize("value", ["0", "5", "-1"])
def test_a_bad_knob_is_one_line_naming_the_key(value):
    with pytest.raises(ConfigError) as err:
        load_config(None, ["task.name=wordproblems", f"task.word_steps={value}"])
    assert str(err.value) == f"task.word_steps={value}: word problems take 1 to 4 operations"


@pytest.mark.parametrize("command", ["train", "eval"])
def test_a_bad_knob_fails_before_any_model_loads(command, capsys, tmp_path):
    # model.path names no model: the error must come before covey looks for one
    code = main([command, *tiny_overrides("no-such-model", tmp_path), "task.name=wordproblems", "task.word_steps=9"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and err == f"covey {command}: error: task.word_steps=9: word problems take 1 to 4 operations"


def test_a_tiny_run_trains_and_evaluates_on_word_problems(tiny_model_dir, tmp_path):
    assert main(["train", *tiny_overrides(tiny_model_dir, tmp_path), "task.name=wordproblems",
                 "task.word_steps=2"]) == 0
    rows = [json.loads(line) for line in (tmp_path / "t" / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["final"] == 1 and "eval/accuracy" in rows[-1]
    sample = json.loads((tmp_path / "t" / "samples.jsonl").read_text().splitlines()[0])
    assert "How many" in json.dumps(sample)
