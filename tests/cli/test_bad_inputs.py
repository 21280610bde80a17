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
    # no empty run folder is left behind (tiny_overrides names the run "t"); a reward function's traceback keeps one
    assert not (tmp_path / "t").exists() or any((tmp_path / "t").iterdir())


def long_prompt(tmp_path):
    rows = [*ROWS[:5], {"prompt": "word " * 3000, "solution": "1"}, *ROWS[5:]]  # line 6: past a 1024 context
    return write(tmp_path / "long.jsonl", "".join(json.dumps(r) + "\n" for r in rows))


def chat_rows(tmp_path):
    rows = [{"prompt": [{"role": "user", "content": r["prompt"]}], "solution": r["solution"]} for r in ROWS]
    return write(tmp_path / "chat.jsonl", "".join(json.dumps(r) + "\n" for r in rows))


def nan_reward(tmp_path):
    return write(tmp_path / "nan_rewards.py", "def score(completions, **kwargs):\n"
                                              "    return [float('nan') for _ in completions]\n")


def no_template(model_dir, tmp_path):
    """The tiny model's folder without its chat template."""
    import shutil
    folder = shutil.copytree(model_dir, tmp_path / "no_template")
    (folder / "chat_template.jinja").unlink(missing_ok=True)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return str(folder)


MODEL_CASES = {
    "an over-long prompt, named by its file and line": (
        lambda t: ["task.name=file", f"task.path={long_prompt(t)}", "task.answer_key=solution"], None,
        "long.jsonl:6: train prompt is"),
    "chat prompts for a model without a chat template": (
        lambda t: ["task.name=file", f"task.path={chat_rows(t)}", "task.answer_key=solution"], no_template,
        "the task's prompts are chat messages but the model's tokenizer has no chat template"),
    "an unreachable remote scorer": (
        lambda t: ["reward.remote_url=http://127.0.0.1:9"], None,
        "reward.remote_url=http://127.0.0.1:9: no connection"),
    "a reward function that returns NaN on the call before loading": (
        lambda t: [f"reward.functions={nan_reward(t)}:score"], None, "returned nan, called before training"),
}


@pytest.mark.parametrize("case", MODEL_CASES)
def test_checks_that_need_the_tokenizer_or_a_socket_come_before_the_model_loads(case, tiny_model_dir, tmp_path,
                                                                                capsys, monkeypatch):
    from covey.training import setup
    monkeypatch.setattr(setup, "load_policy", lambda *a, **k: pytest.fail("the model was loaded"))
    items, model, expected = MODEL_CASES[case]
    model_dir = model(tiny_model_dir, tmp_path) if model else tiny_model_dir
    started = time.perf_counter()
    code = main(["train", *items(tmp_path), *tiny_overrides(model_dir, tmp_path)])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and expected in err, err
    assert time.perf_counter() - started < 10
