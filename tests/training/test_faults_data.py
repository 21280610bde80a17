"""Bad data through `covey train`: one line naming file and line (or dataset row), before any
model loads; or skipped and counted in `data/skipped_rows` with task.on_bad_row=skip.

The row-level parsing is tested in tests/tasks/test_files.py; here the model path does not exist,
so an error about the data proves the data was checked first.
"""

from __future__ import annotations

import json

import pytest
import yaml

from covey.cli.main import main
from covey.runtime.metrics import read_metrics
from tests.helpers import tiny_overrides

GOOD = [{"prompt": f"What is {i} + {i}?", "answer": str(2 * i)} for i in range(6)]
BAD_LINES = {
    "invalid JSON": ('{"prompt": "1+1?"', "invalid JSON"),
    "missing answer": ('{"prompt": "1+1?"}', "missing field 'answer'"),
    "prompt not text": ('{"prompt": 5, "answer": "5"}',
                        "field 'prompt' must be a string or a list of chat messages, got int"),
    "empty answer": ('{"prompt": "1+1?", "answer": " "}', "field 'answer' is empty"),
    "not an object": ('["1+1?", "2"]', "expected a JSON object, got list"),
}


def write_jsonl(path, bad_line: str | None, at: int = 3):
    lines = [json.dumps(r) for r in GOOD]
    if bad_line is not None:
        lines.insert(at - 1, bad_line)
    path.write_text("\n".join(lines) + "\n")
    return path


def train(tmp_path, model_dir, *extra) -> int:
    return main(["train", *tiny_overrides(model_dir, tmp_path, **{"model.threads": 1, "task.eval_size": 2}),
                 *extra])


@pytest.mark.parametrize("case", BAD_LINES)
def test_bad_jsonl_row_names_file_and_line_before_the_model_loads(case, tmp_path, capsys):
    bad_line, problem = BAD_LINES[case]
    data = write_jsonl(tmp_path / "data.jsonl", bad_line, at=3)
    code = train(tmp_path, "/no/such/model", "task.name=jsonl", f"task.path={data}")
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1
    assert err.startswith(f"covey train: error: {data}:3: {problem}"), err


@pytest.mark.parametrize("content, why", [("", "no rows"), ("\n\n", "no rows"),
                                          ("{oops\n[]\n", "all 2 rows were invalid and skipped")])
def test_empty_dataset_fails_before_the_model_loads(content, why, tmp_path, capsys):
    data = tmp_path / "empty.jsonl"
    data.write_text(content)
    code = train(tmp_path, "/no/such/model", "task.name=jsonl", f"task.path={data}", "task.on_bad_row=skip")
    assert code == 2
    assert capsys.readouterr().err.strip() == f"covey train: error: {data}: empty dataset ({why})"


def test_skipped_rows_are_counted_in_metrics(tmp_path, tiny_model_dir, capsys):
    data = tmp_path / "data.jsonl"
    lines = [json.dumps(r) for r in GOOD] + [BAD_LINES["invalid JSON"][0], BAD_LINES["missing answer"][0]]
    data.write_text("\n".join(lines) + "\n")
    assert train(tmp_path, tiny_model_dir, "task.name=jsonl", f"task.path={data}", "task.on_bad_row=skip",
                 "train.steps=1") == 0
    assert "(2 bad rows skipped)" in capsys.readouterr().out
    first = read_metrics(tmp_path / "t")[0]
    assert first["step"] == 0 and first["data/skipped_rows"] == 2


def test_bad_hf_dataset_row_is_named_and_skippable(tmp_path, tiny_model_dir, capsys):
    datasets = pytest.importorskip("datasets")
    rows = GOOD[:3] + [{"prompt": "", "answer": "1"}] + GOOD[3:]
    folder = tmp_path / "ds"
    datasets.Dataset.from_list(rows).save_to_disk(str(folder))
    capsys.readouterr()  # the save progress bar
    code = train(tmp_path, "/no/such/model", "task.name=hf", f"task.path={folder}")
    assert code == 2
    assert capsys.readouterr().err.strip() == f"covey train: error: {folder} row 3: field 'prompt' is empty"
    assert train(tmp_path, tiny_model_dir, "task.name=hf", f"task.path={folder}", "task.on_bad_row=skip",
                 "train.steps=1") == 0
    assert read_metrics(tmp_path / "t")[0]["data/skipped_rows"] == 1


def test_missing_hf_column_is_named(tmp_path, capsys):
    datasets = pytest.importorskip("datasets")
    folder = tmp_path / "ds"
    datasets.Dataset.from_list([{"question": "1+1?", "answer": "2"}] * 3).save_to_disk(str(folder))
    capsys.readouterr()
    assert train(tmp_path, "/no/such/model", "task.name=hf", f"task.path={folder}") == 2
    err = capsys.readouterr().err.strip()
    assert err == (f"covey train: error: {folder}: missing column 'prompt' (columns: question, answer; "
                   "set task.prompt_key=question)")


# ------------------------------------------------------------ data a TRL user brings

SEEN = {"answer": []}


def recording_reward(completions, answer, **_):
    """Varied rewards; keeps the `answer` column it was given."""
    SEEN["answer"] += list(answer)
    return [(sum(map(ord, str(c))) % 5) / 4 for c in completions]


def test_prompt_only_jsonl_trains_on_reward_functions_and_is_judged_by_them(tmp_path, tiny_model_dir, capsys):
    data = tmp_path / "prompts.jsonl"
    chat = [{"role": "user", "content": "Say something short."}]
    data.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in [*[f"Write about {i}." for i in range(5)], chat]))
    assert train(tmp_path, tiny_model_dir, "task.name=file", f"task.path={data}", "train.steps=1",
                 "reward.functions=tests.training.test_faults_data:recording_reward") == 0
    out = capsys.readouterr().out
    assert (f"covey: {data}: there is no 'answer' column, so the correctness reward is off and held-out answers are "
            "judged by the reward functions (eval.metric=reward, passing at eval.reward_threshold=1)") in out
    assert "covey: held-out metric: reward >= 1 (eval.metric=reward)" in out
    first = read_metrics(tmp_path / "t")[0]
    assert first["eval/n"] == 2 and "eval/reward_mean" in first and "eval/accuracy" not in first
    saved = yaml.safe_load((tmp_path / "t" / "config.yaml").read_text())
    assert saved["eval"]["metric"] == "reward" and saved["reward"]["correctness"] == 0.0


def test_list_and_null_answers_reach_reward_functions_and_eval_size_zero_trains_on_every_row(
        tmp_path, tiny_model_dir, capsys):
    data = tmp_path / "d.jsonl"
    answers = [["Paris", "paris"], None, ["Lima"], None]
    data.write_text("".join(json.dumps({"prompt": f"Capital {i}?", "answer": a}) + "\n" for i, a in enumerate(answers)))
    SEEN["answer"] = []
    assert train(tmp_path, tiny_model_dir, "task.name=file", f"task.path={data}", "train.steps=1", "task.eval_size=0",
                 "rollout.prompts_per_step=4", "reward.functions=tests.training.test_faults_data:recording_reward") == 0
    out = capsys.readouterr().out
    assert "covey: task file: 4 train / 0 held-out examples" in out
    assert ("covey: no held-out evaluation (task.eval_size=0): every example trains, and no accuracy is measured "
            "before or after training") in out
    assert "held-out accuracy" not in out and out.strip().splitlines()[-1].startswith("covey: 1 steps; model saved to")
    assert {json.dumps(a) for a in SEEN["answer"]} == {json.dumps(a) for a in answers}  # as given: not strings
    rows = read_metrics(tmp_path / "t")
    assert not [k for row in rows for k in row if k.startswith("eval/")]


def test_prompt_only_data_without_a_reward_function_is_one_line_before_the_model_loads(tmp_path, capsys):
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"Write about {i}.", "solution": str(i)}) + "\n" for i in range(6)))
    assert train(tmp_path, "/no/such/model", "task.name=file", f"task.path={data}") == 2
    out, err = capsys.readouterr()
    assert out == "" and err.strip() == (
        f"covey train: error: {data}: there is no 'answer' column, so the correctness reward cannot score and no "
        "other reward is set: give reward functions (reward.functions=file.py:function); set task.answer_key=solution "
        "if that column holds the answers")
