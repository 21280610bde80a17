"""Settings that say what they mean: other trainers' names point at covey's keys instead of
landing in some section, numbers are checked against their ranges before any model loads, and a
run ended by its time budget says so."""

import json

import pytest

from covey.cli.main import main
from covey.config import ConfigError, load_config
from tests.helpers import tiny_overrides


@pytest.mark.parametrize("name,covey_key", [
    ("learning_rate", "optim.lr (the policy's; the reward model's is rm.learning_rate)"),
    ("kl_coef", "algo.beta"), ("num_generations", "rollout.group_size"),
    ("max_completion_length", "rollout.max_new_tokens"), ("epsilon_high", "algo.clip_eps_high"),
    ("loss_type", "algo.loss_agg"), ("num_iterations", "algo.epochs"),
])
def test_names_of_other_trainers_point_at_covey_keys(name, covey_key):
    with pytest.raises(ConfigError) as err:
        load_config(None, [f"{name}=1"])
    assert str(err.value) == f"unknown config key '{name}' (another trainer's name): covey's is {covey_key}"


def test_the_reward_models_learning_rate_is_still_set_by_its_full_key():
    assert load_config(None, ["rm.learning_rate=3e-4"]).rm.learning_rate == 3e-4
    assert load_config(None, ["beta=0.1"]).algo.beta == 0.1  # a unique covey leaf keeps its shorthand


@pytest.mark.parametrize("override,message", [
    ("optim.lr=-1e-5", "optim.lr must be > 0.0, got -1e-05"),
    ("optim.lr=0", "optim.lr must be > 0.0, got 0.0"),
    ("algo.beta=-0.1", "algo.beta must be >= 0.0, got -0.1"),
    ("algo.entropy_coef=-0.01", "algo.entropy_coef must be >= 0.0, got -0.01"),
    ("optim.max_grad_norm=-1", "optim.max_grad_norm must be >= 0.0, got -1.0"),
    ("train.keep_checkpoints=0", "train.keep_checkpoints must be >= 1, got 0"),
    ("rollout.top_p=1.5", "rollout.top_p must lie in (0, 1], got 1.5"),
    ("optim.betas=0.9", "optim.betas must be two numbers in [0, 1) such as '0.9,0.99', got '0.9'"),
])
def test_out_of_range_numbers_fail_naming_the_key_before_any_model_loads(override, message, capsys, tmp_path):
    # model.path names no model: the error must come before covey looks for one
    code = main(["train", *tiny_overrides("no-such-model", tmp_path), override])
    err = capsys.readouterr().err.strip()
    assert code == 2 and err == f"covey train: error: {message}"


def test_a_run_ended_by_its_time_budget_says_so(tiny_model_dir, tmp_path, capsys):
    code = main(["train", *tiny_overrides(tiny_model_dir, tmp_path, **{"train.steps": 5,
                                                                       "train.max_minutes": 1e-6})])
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert code == 0
    assert "after 1 steps" in last and "stopped by the time budget train.max_minutes=1e-06 before train.steps=5" in last
    rows = [json.loads(line) for line in (tmp_path / "t" / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["final"] == 1 and rows[-1]["train/stopped_by_budget"] == 1


@pytest.mark.parametrize("override,package,extra", [
    ("model.lora_rank=4", "peft", "lora"), ("train.logger=tensorboard", "tensorboard", "tensorboard"),
])
def test_a_missing_optional_package_is_one_line_naming_its_extra(override, package, extra, monkeypatch, capsys,
                                                                  tmp_path):
    from covey.train import setup
    real = setup.importlib.util.find_spec
    monkeypatch.setattr(setup.importlib.util, "find_spec", lambda name, *a: None if name == package else real(name, *a))
    code = main(["train", *tiny_overrides("no-such-model", tmp_path), override])
    err = capsys.readouterr().err.strip()
    assert code == 2
    assert err == f"covey train: error: {override} needs the optional package {package}: pip install 'covey[{extra}]'"


def test_a_run_shorter_than_samples_every_still_writes_samples(tiny_model_dir, tmp_path):
    assert main(["train", *tiny_overrides(tiny_model_dir, tmp_path)]) == 0  # 2 steps, train.samples_every=5
    rows = [json.loads(line) for line in (tmp_path / "t" / "samples.jsonl").read_text().splitlines()]
    assert rows and {row["step"] for row in rows} == {1}
