"""Small things a new user met on a first day, each said in one line where it happens."""

from __future__ import annotations

import inspect
import json

import pytest

import covey
from covey.cli.main import main
from covey.config import ConfigError, load_config
from tests.helpers import tiny_overrides


def test_the_train_function_documents_itself():
    # help(covey.train) opens with the call a user makes (its signature: TRL's keywords), not with the package's
    # layout; covey.open_run takes the same keywords
    keywords = ["reward_funcs", "reward_weights", "tools", "environment_factory"]
    for function in (covey.train, covey.open_run):
        params = inspect.signature(function).parameters
        assert list(params)[:5] == ["config", *keywords]
        assert all(params[k].kind is inspect.Parameter.KEYWORD_ONLY and params[k].default is None for k in keywords)
    assert callable(covey.train) and covey.train.__doc__.startswith("Train a policy as `config`")


def test_a_function_weight_pair_points_to_reward_weights(tmp_path):
    def score(completions, **kwargs):
        return [0.0 for _ in completions]
    cfg = load_config(None, tiny_overrides("/no/such/model", tmp_path))
    with pytest.raises(ValueError, match=r"is a \(function, weight\) pair: give the functions in reward_funcs"):
        covey.train(cfg, reward_funcs=[(score, 0.5)])


def test_a_hub_id_as_data_path_says_data_are_read_from_files(tmp_path, capsys):
    code = main(["train", "task.name=file", "task.path=openai/gsm8k", *tiny_overrides("/no/such/model", tmp_path)])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1
    assert "openai/gsm8k: file not found: it looks like a Hugging Face hub id" in err and "save_to_disk" in err


@pytest.mark.parametrize("value, hint", [("ppo", "PPO's advantages are algo.estimator=gae"),
                                         ("dapo", "the preset: covey train dapo")])
def test_a_preset_name_as_estimator_names_the_estimator(value, hint):
    from covey.training.plan import make_plan  # the registries' names are checked by the plan
    with pytest.raises(ConfigError, match=hint):
        make_plan(load_config(None, [f"algo.estimator={value}"]))


def test_a_cpu_run_says_the_gpu_budget_is_not_used_and_samples_show_the_model_prompt(tiny_model_dir, tmp_path,
                                                                                      capsys):
    assert main(["train", *tiny_overrides(tiny_model_dir, tmp_path, **{
        "train.gpu_memory_gib": 20, "train.steps": 1, "train.device": "cpu"})]) == 0
    out = capsys.readouterr().out
    assert ("covey: note: train.gpu_memory_gib=20 budgets a GPU's memory: on the CPU it is not used "
            "(micro-batches stay at algo.micro_batch_size)") in out
    sample = json.loads((tmp_path / "t" / "samples.jsonl").read_text().splitlines()[0])
    # the dataset's question, and what the model read: the chat template around it
    assert sample["prompt"] in sample["model_prompt"] and sample["model_prompt"].startswith("<|im_start|>")
