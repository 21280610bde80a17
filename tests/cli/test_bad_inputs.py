"""What a TRL user brings that cannot work, through `covey train` as they run it: each case ends with
exit status 2, one line on stderr naming what to set, and within seconds. The model path does not
exist, so an error about the case proves it was caught before any model loads (the rows of
docs/your-task.md, "What fails before the model loads")."""

from __future__ import annotations

import json
import time

import pytest

from covey.cli.main import main
from tests.helpers import tiny_overrides

ROWS = [{"prompt": f"What is {i} + {i}?", "solution": str(2 * i)} for i in range(8)]


def write(path, text: str):
    path.write_text(text)
    return path


def prompt_only(tmp_path):
    return write(tmp_path / "prompts.jsonl", "".join(json.dumps({"prompt": r["prompt"]}) + "\n" for r in ROWS))


def with_solution(tmp_path):
    return write(tmp_path / "data.jsonl", "".join(json.dumps(r) + "\n" for r in ROWS))


def raising_reward(tmp_path):
    return write(tmp_path / "my_rewards.py", "def score(completions, **kwargs):\n    raise KeyError('answer')\n")


def needs_a_missing_column(tmp_path):
    return write(tmp_path / "my_rewards.py",
                 "def score(completions, ground_truth):\n    return [0.0 for _ in completions]\n")


CASES = {
    "the answer column named otherwise": (
        lambda t: ["task.name=file", f"task.path={with_solution(t)}"], "task.answer_key=solution"),
    "prompt-only data and no reward function": (
        lambda t: ["task.name=file", f"task.path={prompt_only(t)}"], "reward function"),
    "a reward function that raises": (
        lambda t: ["task.name=file", f"task.path={with_solution(t)}", "task.answer_key=solution",
                   f"reward.functions={raising_reward(t)}:score"], "KeyError"),
    "a reward function naming a column the data lack": (
        lambda t: ["task.name=file", f"task.path={with_solution(t)}", "task.answer_key=solution",
                   f"reward.functions={needs_a_missing_column(t)}:score"], "ground_truth"),
    "TRL's name for the learning rate": (lambda t: ["optim.learning_rate=1e-5"], "optim.lr"),
    "TRL's num_generations under a covey section": (lambda t: ["rollout.num_generations=4"], "rollout.group_size"),
    "a clip bound out of range": (lambda t: ["algo.clip_eps_low=1.5"], "algo.clip_eps_low"),
    "a YAML error keeps its line and column": (
        lambda t: [str(write(t / "my.yaml", "algo:\n  beta: 0.1\n optim: [\n"))], "my.yaml:3:"),
}


@pytest.mark.parametrize("case", CASES)
def test_each_bad_input_is_one_line_and_exit_2_within_seconds(case, tmp_path, capsys):
    items, expected = CASES[case]
    argv = ["train", *items(tmp_path), *tiny_overrides("/no/such/model", tmp_path)]
    if argv[1].endswith(".yaml"):  # a file comes before the key=value overrides
        argv = ["train", argv[1], *argv[2:]]
    started = time.perf_counter()
    code = main(argv)
    seconds = time.perf_counter() - started
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1, err
    assert err.startswith("covey train: error: ") and expected in err, err
    assert "model path not found" not in err  # caught before the model is looked for
    assert seconds < 10, f"{seconds:.1f} s before the error"
