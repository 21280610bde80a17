"""Settings that say what they mean: other trainers' names point at covey's keys instead of
landing in some section, numbers are checked against their ranges before any model loads, and a
run ended by its time budget says so."""

import json
import re

import pytest

from covey.cli.main import main
from covey.config import ConfigError, load_config
from tests.helpers import tiny_overrides


@pytest.mark.parametrize("name,covey_key", [
    ("learning_rate", "optim.lr (the policy's; the reward model's is rm.learning_rate)"),
    ("num_generations", "rollout.group_size"), ("max_completion_length", "rollout.max_new_tokens"),
    ("epsilon_high", "algo.clip_eps_high (the same number with loss_type grpo, bnpo, dr_grpo, dapo; with "
                     "loss_type=cispo TRL's epsilon_high is the cap on the weight itself: "
                     "algo.clip_eps_high = epsilon_high - 1)"),
    ("loss_type", "algo.loss_agg (grpo, bnpo, dr_grpo, dapo) or algo.policy_loss (cispo, sapo, luspo, vespo); "
                  "loss_type=X names X's exact setting"),
    ("delta", "algo.dual_clip (TRL's two-sided clip at delta is the dual clip c = delta)"),
    ("num_iterations", "algo.epochs"),
    ("max_steps", "train.steps"), ("epsilon", "algo.clip_eps_low and algo.clip_eps_high"),
])
@pytest.mark.parametrize("section", ["", "algo.", "optim.", "rollout."])
def test_trl_names_point_at_covey_keys_with_or_without_a_section(name, covey_key, section):
    with pytest.raises(ConfigError) as err:
        load_config(None, [f"{section}{name}=1"])
    assert str(err.value) == f"unknown config key '{section}{name}': TRL's {name} is {covey_key} here"


@pytest.mark.parametrize("key", ["kl_coef", "algo.kl_coef", "algo.init_kl_coef"])
def test_names_of_other_trainers_point_at_covey_keys(key):
    with pytest.raises(ConfigError) as err:
        load_config(None, [f"{key}=1"])
    assert str(err.value) == f"unknown config key '{key}' (another trainer's name): covey's is algo.beta"


def test_trl_names_that_are_covey_names_work_as_they_are():
    cfg = load_config(None, ["beta=0.1", "temperature=0.9", "top_p=0.95", "top_k=20", "seed=3", "warmup_steps=2"])
    assert (cfg.algo.beta, cfg.rollout.temperature, cfg.rollout.top_p, cfg.rollout.top_k, cfg.train.seed,
            cfg.optim.warmup_steps) == (0.1, 0.9, 0.95, 20, 3, 2)


def test_the_trl_table_in_the_docs_is_the_one_the_config_reads():
    import re
    from pathlib import Path

    from covey.config.load import TRL_NAMES
    from covey.config.schema import leaf_keys
    doc = (Path(__file__).resolve().parents[2] / "docs" / "your-task.md").read_text()
    table = doc.split("## TRL's names", 1)[1].split("\n## ", 1)[0]
    rows = dict(re.findall(r"^\| `(\w+)` \| (.+?) \|$", table, re.M))
    leaves = {key.rpartition(".")[2]: key for key in leaf_keys() if key.count(".") == 1}
    for name, where in rows.items():
        expected = TRL_NAMES.get(name) or leaves.get(name)
        assert expected and where.replace("`", "").startswith(expected.split(" (")[0]), (name, where)
    assert set(TRL_NAMES) <= set(rows), set(TRL_NAMES) - set(rows)


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
    ("algo.clip_eps_low=1.5", "algo.clip_eps_low must lie in [0, 1] (the ratio's lower bound is 1 - eps, PPO's 0.2; "
                              "1 = no lower bound, as CISPO's paper has it), got 1.5"),
    ("algo.clip_eps_low=-0.1", "algo.clip_eps_low must lie in [0, 1] (the ratio's lower bound is 1 - eps, PPO's 0.2; "
                               "1 = no lower bound, as CISPO's paper has it), got -0.1"),
    ("algo.sapo.temperature_neg=0", "algo.sapo.temperature_neg must be > 0.0, got 0.0"),
    ("algo.vespo.k_pos=-1", "algo.vespo.k_pos must be >= 0.0, got -1.0"),
    ("algo.clip_eps_high=20", "algo.clip_eps_high must lie in [0, 10] (the ratio's upper bound is 1 + eps; PPO's is "
                              "0.2, DAPO's 0.28), got 20.0"),
    ("task.eval_size=-1", "task.eval_size must be >= 0, got -1"),
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
    from covey.training import setup
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


def test_task_eval_size_zero_and_high_clip_bounds_are_accepted():
    cfg = load_config(None, ["task.eval_size=0", "algo.clip_eps_low=0.99", "algo.clip_eps_high=0.28"])
    assert (cfg.task.eval_size, cfg.algo.clip_eps_low, cfg.algo.clip_eps_high) == (0, 0.99, 0.28)


@pytest.mark.parametrize("files, lacks", [
    ((), "has no config.json: give the folder a model was saved to (save_pretrained), a .gguf file, 'default' or "
         "a hub id"),
    (("policy/config.json",), "has no config.json: a checkpoint's model is its policy/ folder, {folder}/policy"),
    (("config.json", "tokenizer.json"), "has config.json but no weights (no *.safetensors or *.bin file)"),
])
def test_a_folder_without_a_model_says_what_it_lacks(files, lacks, tmp_path, capsys):
    folder = tmp_path / "my-model"
    folder.mkdir()
    for name in files:
        (folder / name).parent.mkdir(exist_ok=True)
        (folder / name).write_text("{}")
    code = main(["train", *tiny_overrides(str(folder), tmp_path)])
    out, err = capsys.readouterr()
    assert code == 2 and out == ""  # before anything is printed
    assert err.strip() == f"covey train: error: model folder {folder} {lacks.format(folder=folder)}"


@pytest.mark.parametrize("value, setting", [
    ("dapo", "algo.loss_agg=token_mean"), ("grpo", "algo.loss_agg=seq_mean_token_mean"),
    ("dr_grpo", "algo.loss_agg=constant"), ("bnpo", "algo.loss_agg=token_mean"),
    ("cispo", "algo.policy_loss=cispo algo.loss_agg=token_mean algo.clip_eps_low=1 "
              "algo.clip_eps_high=<TRL's epsilon_high - 1>"),
    ("vespo", "algo.policy_loss=vespo algo.loss_agg=token_mean"),
])
def test_trl_loss_type_names_the_exact_setting_of_its_value(value, setting):
    # the settings tests/algos/test_trl_parity.py checks against TRL 1.16 on identical inputs
    with pytest.raises(ConfigError) as err:
        load_config(None, [f"loss_type={value}"])
    assert str(err.value) == f"unknown config key 'loss_type': TRL's loss_type={value} is {setting} here"


def test_every_trl_name_points_to_keys_that_exist():
    # each covey key a TRL name's hint gives (section.leaf, with or without =value) is a real key
    import re

    from covey.config.load import TRL_LOSS_TYPES, TRL_NAMES
    from covey.config.schema import group_keys, leaf_keys
    keys = set(leaf_keys())
    for name, hint in {**TRL_NAMES, **TRL_LOSS_TYPES}.items():
        named = re.findall(r"\b((?:model|task|rollout|reward|rm|algo|optim|train|eval)(?:\.\w+)+)", hint)
        assert named, name
        for key in named:
            assert key in keys or key in group_keys(), (name, key)


@pytest.mark.parametrize("name, expected", [
    ("mask_truncated_completions", "algo.mask_truncated"), ("max_tool_calling_iterations", "rollout.max_turns"),
    ("environment_factory", "rollout.environment"), ("reward_funcs", "reward.functions"),
    ("epsilon_high", "algo.clip_eps_high = epsilon_high - 1"),
])
def test_trl_agent_and_cispo_names_get_a_pointer(name, expected):
    with pytest.raises(ConfigError, match=re.escape(expected)):
        load_config(None, [f"{name}=1"])


def test_options_live_under_their_owner():
    # a key that matters for one value of another sits in that owner's group; the section stays short
    import dataclasses

    from covey.config import Config
    top = [f.name for f in dataclasses.fields(Config().algo)]
    assert len(top) <= 40, len(top)
    for group in ("sapo", "gmpo", "vespo", "gae", "dpo", "tis", "clip_cov", "kl_cov", "adaptive_entropy",
                  "adaptive_kl", "dynamic_sampling"):
        assert group in top
    cfg = load_config(None, ["algo.policy_loss=sapo", "algo.sapo.temperature_neg=2", "sapo.temperature_pos=0.5",
                             "algo.tis.cap=2", "algo.tis.mode=token_mask"])
    assert (cfg.algo.sapo.temperature_pos, cfg.algo.sapo.temperature_neg) == (0.5, 2.0)
    assert (cfg.algo.tis.cap, cfg.algo.tis.mode) == (2.0, "token_mask")


@pytest.mark.parametrize("override,message", [
    ("algo.tis_cap=2", "config key 'algo.tis_cap' is now algo.tis.cap"),
    ("sapo_temperature_pos=2", "config key 'algo.sapo_temperature_pos' is now algo.sapo.temperature_pos"),
    ("algo.dpo_beta=0.2", "config key 'algo.dpo_beta' is now algo.dpo.beta"),
    ("algo.lam=0.9", "config key 'algo.lam' is now algo.gae.lam"),
    ("algo.sapo=1", "config key 'algo.sapo' is a group of options: set algo.sapo.temperature_pos, "
                    "algo.sapo.temperature_neg"),
    ("algo.sapo.temperature=1", "unknown config key 'algo.sapo.temperature' (did you mean "
                                "'algo.sapo.temperature_pos'?)"),
    ("ratio=0.1", "ambiguous config key 'ratio': use one of algo.clip_cov.ratio, algo.kl_cov.ratio"),
])
def test_a_flat_key_that_moved_fails_naming_its_new_place(override, message):
    with pytest.raises(ConfigError) as err:
        load_config(None, [override])
    assert str(err.value).startswith(message)


def test_a_group_with_a_switch_takes_the_switch_as_its_value(tmp_path):
    cfg = load_config(None, ["algo.dynamic_sampling=true", "adaptive_entropy=on"])
    assert cfg.algo.dynamic_sampling.enabled and cfg.algo.adaptive_entropy.enabled
    assert cfg.algo.dynamic_sampling.max_rounds == 3
    path = tmp_path / "mine.yaml"
    path.write_text("algo:\n  dynamic_sampling: true\n  gae:\n    lam: 0.9\n")
    cfg = load_config(str(path))
    assert cfg.algo.dynamic_sampling.enabled and cfg.algo.gae.lam == 0.9
    path.write_text("algo:\n  tis_cap: 2\n")
    with pytest.raises(ConfigError, match=r"mine.yaml: config key 'algo.tis_cap' is now algo.tis.cap"):
        load_config(str(path))


def test_an_older_runs_config_is_read_with_its_flat_keys_moved():
    # a run folder's config.json from before the groups: every moved key lands in its group
    from covey.config import from_dict
    cfg = from_dict({"algo": {"tis_cap": 2.0, "tis_mode": "sequence_mask", "sapo_temperature_neg": 1.5,
                              "dynamic_sampling": True, "max_resample_rounds": 5, "dpo_beta": 0.3, "lam": 0.9}})
    a = cfg.algo
    assert (a.tis.cap, a.tis.mode, a.sapo.temperature_neg, a.dpo.beta, a.gae.lam) == (2.0, "sequence_mask", 1.5,
                                                                                     0.3, 0.9)
    assert a.dynamic_sampling.enabled and a.dynamic_sampling.max_rounds == 5
