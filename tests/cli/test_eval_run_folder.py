"""`covey eval RUN_DIR` repeats the run's evaluation from any folder: the run records its data paths
absolute and eval.metric resolved (auto written as the verifier it chose), and a run started with
eval.metric=auto resumes with it."""

import json

import yaml

from covey.cli.main import main
from tests.helpers import tiny_overrides


def test_eval_of_a_run_folder_from_another_folder_judges_as_the_run_did(tiny_model_dir, tmp_path, monkeypatch,
                                                                        capsys):
    work, elsewhere = tmp_path / "work", tmp_path / "elsewhere"
    work.mkdir()
    elsewhere.mkdir()
    (work / "data.jsonl").write_text("".join(json.dumps({"prompt": f"What is {i} + {i}?", "answer": str(2 * i)}) + "\n"
                                             for i in range(8)))
    keys = tiny_overrides(tiny_model_dir, tmp_path / "runs", **{"task.name": "file", "task.path": "data.jsonl",
                                                                "task.eval_size": 2, "train.steps": 1,
                                                                "model.threads": 1, "train.resume": "auto"})
    monkeypatch.chdir(work)
    assert main(["train", *keys]) == 0
    run_dir = tmp_path / "runs" / "t"
    saved = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert saved["task"]["path"] == str(work / "data.jsonl") and saved["eval"]["metric"] == "math"
    assert main(["train", *keys, "train.steps=2"]) == 0  # started with eval.metric=auto: resumes with it
    assert "covey: resumed from" in capsys.readouterr().out
    monkeypatch.chdir(elsewhere)
    assert main(["eval", str(run_dir)]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["metric"] == "accuracy (math)" and result["eval/n"] == 2


def test_eval_by_reward_from_another_folder_finds_a_module_function_of_the_run_folder(tiny_model_dir, tmp_path,
                                                                                      monkeypatch, capsys):
    # reward.functions=my_rewards:score names a module of the folder the run started in: the run records it
    # as that file's absolute path, so `covey eval RUN_DIR` from elsewhere imports the same function
    work, elsewhere = tmp_path / "work", tmp_path / "elsewhere"
    work.mkdir()
    elsewhere.mkdir()
    (work / "my_rewards.py").write_text("def score(completions, **kwargs):\n    return [1.0 for _ in completions]\n")
    keys = tiny_overrides(tiny_model_dir, tmp_path / "runs", **{
        "reward.functions": "my_rewards:score", "reward.correctness": 0.0, "eval.metric": "reward",
        "train.steps": 1, "model.threads": 1})
    monkeypatch.chdir(work)
    monkeypatch.syspath_prepend(str(work))
    assert main(["train", *keys]) == 0
    run_dir = tmp_path / "runs" / "t"
    assert yaml.safe_load((run_dir / "config.yaml").read_text())["reward"]["functions"] == \
        f"{work / 'my_rewards.py'}:score"
    monkeypatch.chdir(elsewhere)
    capsys.readouterr()
    assert main(["eval", str(run_dir)]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["eval/reward_pass"] == 1.0  # the function scores every answer 1


def test_eval_of_a_folder_that_is_not_there_says_so(capsys):
    assert main(["eval", "./not-a-run"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == ("covey eval: error: ./not-a-run: no such run folder or YAML file (give a run folder, a preset "
                   "name or a YAML file)")
