import re

import pytest

from covey.algos import ESTIMATORS
from covey.config import ConfigError, as_dict, config_yaml, load_config, preset_names, preset_path, split_config
from covey.training.plan import make_plan


def plan_of(*overrides: str):
    """The plan of the default preset with `overrides`: the config's own checks, then the registries'."""
    return make_plan(load_config(None, list(overrides)))


def test_overrides_and_short_keys():
    cfg = load_config(None, ["steps=3", "algo.beta=0.1", "rollout.group_size=4"])
    assert (cfg.train.steps, cfg.algo.beta, cfg.rollout.group_size) == (3, 0.1, 4)


@pytest.mark.parametrize("override, message", [
    ("stepz=3", "unknown config key 'stepz' (did you mean 'steps'?)"),
    ("algo.beta=abc", "config key 'algo.beta' expects float, got 'abc'"),
    ("train.steps=1.5", "config key 'train.steps' expects int"),
    ("algo.estimator=foo", "algo.estimator='foo' is not one of"),
    ("algo.dual_clip=0.5", "algo.dual_clip must be > 1"),
    ("rollout.group_size=1", "rollout.group_size must be >= 2"),
    ("algo.minibatches=3", "must divide prompts_per_step*group_size=64"),
    ("task.template=What is {a} {op}?", "must contain {a}, {op}, {b}"),
    ("task.multistep_template=Start with {start}.",
     "task.multistep_template='Start with {start}.' must contain {start}, {steps}"),
    ("task.multistep_template=Start with {x}.", "is not a valid template"),
    ("algo.beta=[0.1", "config key 'algo.beta': cannot read '[0.1'"),
    ("reward.process_outcome_weight=1", "reward.process_outcome_weight adds the outcome to the last step"),
    ("task.start_digits=0", "task.start_digits=0: must be >= 1"),
    ("task.max_value=50", "task.max_value=50: must be >= the largest start value (99 for task.start_digits=2)"),
    ("task.template=What is {x}?", "is not a valid template"),
    ("task.min_ops=5", "task.min_ops=5, task.max_ops=4: need 1 <= min_ops <= max_ops"),
    ("task.ops=+/", "task.ops='+/': choose one or more of + - *"),
    ("task.operand_max=1", "task.operand_max=1: operands are drawn from 2..operand_max"),
    ("lr=1e-5", None),
])
def test_bad_values(override, message):
    if message is None:
        assert load_config(None, [override]).optim.lr == 1e-5
        return
    with pytest.raises(ConfigError, match=re.escape(message)):
        plan_of(override)  # what load_config refuses, or the plan (registry names, estimator traits)


def test_registry_names_are_checked_by_the_plan_not_by_the_torch_free_config():
    cfg = load_config(None, ["algo.estimator=foo"])  # covey.config knows no estimator names
    with pytest.raises(ConfigError, match=re.escape("algo.estimator='foo' is not one of: grpo, grpo_process")):
        make_plan(cfg)


def test_normalisation_and_token_credit_follow_the_estimator_traits():
    """Checked at start from the registry entry, not at the first advantage step."""
    for name, est in ESTIMATORS.items():
        base = [f"algo.estimator={name}", "reward.step_source=exact", "task.name=multistep"]
        for mode in ("group", "batch", "global_token", "none"):
            if mode in est.allowed_normalize:
                plan_of(*base, f"algo.normalize={mode}")
            else:
                message = f"algo: normalize='{mode}' is not defined for estimator '{name}'"
                with pytest.raises(ConfigError, match=message):
                    plan_of(*base, f"algo.normalize={mode}")
        if not est.sequence_level:
            with pytest.raises(ConfigError, match="algo: token_credit='uniform' applies to sequence-level estimators"):
                plan_of(*base, "algo.token_credit=uniform")
    assert plan_of("algo.estimator=grpo", "algo.token_credit=uniform").advantage.token_credit == "uniform"


def test_kl_in_reward_needs_token_estimator():
    with pytest.raises(ConfigError, match="kl_in=reward needs"):
        plan_of("algo.kl_in=reward")


def test_checks_follow_the_estimator_traits():
    """Every check that depends on the estimator reads its registry traits, for every estimator."""
    for name, est in ESTIMATORS.items():
        base = [f"algo.estimator={name}", "reward.step_source=exact", "task.name=multistep"]
        assert plan_of(*base).needs_critic == est.needs_values
        if est.min_group_size >= 2:
            with pytest.raises(ConfigError, match=f"rollout.group_size must be >= {est.min_group_size}"):
                plan_of(*base, "rollout.group_size=1")
            plan_of(*base, "algo.dynamic_sampling=true")
        else:
            plan_of(*base, "rollout.group_size=1")
            with pytest.raises(ConfigError, match="algo.dynamic_sampling needs a group-based estimator"):
                plan_of(*base, "algo.dynamic_sampling=true")
        if est.per_token_rewards:
            plan_of(*base, "algo.kl_in=reward")
        else:
            with pytest.raises(ConfigError, match="algo.kl_in=reward needs a per-token-reward estimator"):
                plan_of(*base, "algo.kl_in=reward")
        if est.step_scores:  # step rewards from a PRM need one
            with pytest.raises(ConfigError, match="reward.prm_path"):
                plan_of(f"algo.estimator={name}")
        else:
            plan_of(f"algo.estimator={name}")
    # the learner that does not use advantages trains no critic whatever the estimator says
    assert not plan_of("algo.learner=dpo", "algo.estimator=gae").needs_critic


def test_presets_load_by_name():
    assert preset_names() == ("cispo", "dapo", "dpo_iterative", "dr_grpo", "gmpo", "grpo", "gspo", "ppo",
                              "reinforce_pp", "reinforce_pp_baseline", "remax", "rloo", "sapo",
                              "wordproblems_gpu")  # the last a recipe: the defaults' GRPO
    for name in preset_names():
        cfg = load_config(name)
        assert cfg.algo.learner == ("dpo" if name == "dpo_iterative" else "advantage")
        assert preset_path(name).name == f"{name}.yaml" and preset_path(name).is_file()
        # a preset named by its file path loads the same config
        assert as_dict(load_config(str(preset_path(name)))) == as_dict(cfg)


def test_defaults_are_the_grpo_preset():
    assert as_dict(load_config()) == as_dict(load_config("grpo"))


@pytest.mark.parametrize("preset, message", [
    ("ppo2", "unknown preset 'ppo2' (did you mean 'ppo'?); presets: cispo, dapo, dpo_iterative, dr_grpo,"),
    ("xyz", "unknown preset 'xyz'; presets: cispo, dapo, dpo_iterative, "),
    ("configs/ppo.yaml", "config file not found: configs/ppo.yaml"),
])
def test_unknown_preset_is_one_line_listing_the_presets(preset, message):
    with pytest.raises(ConfigError) as err:
        load_config(preset)
    assert str(err.value).startswith(message) and "\n" not in str(err.value)


def test_split_config_takes_a_preset_then_overrides():
    assert split_config(["ppo", "steps=3"]) == ("ppo", ["steps=3"])
    assert split_config(["steps=3"]) == (None, ["steps=3"])
    assert split_config([]) == (None, [])


def test_printed_config_reads_back(tmp_path):
    cfg = load_config("ppo", ["steps=3", "task.multistep_template=From {start}: {steps}.",
                              "reward.step_separator=;"])
    path = tmp_path / "resolved.yaml"
    path.write_text(config_yaml(cfg))
    assert as_dict(load_config(str(path))) == as_dict(cfg)


def test_plan_sizes():
    plan = plan_of("rollout.prompts_per_step=4", "rollout.group_size=8", "algo.epochs=2", "algo.minibatches=4",
                   "algo.micro_batch_size=3")
    assert plan.sizes.sequences_per_minibatch == 8  # 4 prompts x 8 samples / 4 mini-batches
    assert plan.sizes.micro_batches_per_minibatch == 3  # ceil(8 / 3)
    assert plan.sizes.optimizer_steps_per_rollout == 8
    assert plan.needs_old_logprobs  # pi_old differs from pi_theta after the first of the 8 steps


def test_missing_file_and_bad_yaml(tmp_path):
    with pytest.raises(ConfigError, match="config file not found"):
        load_config(str(tmp_path / "nope.yaml"))
    bad = tmp_path / "bad.yaml"
    bad.write_text("algo: [unclosed")
    with pytest.raises(ConfigError, match="invalid YAML"):
        load_config(str(bad))


def test_every_key_has_a_one_line_docstring_and_help_config_lists_it(capsys):
    import dataclasses

    from covey.cli.main import main
    from covey.config import Config, field_docs
    from covey.config.schema import is_group

    def check(obj, prefix):
        docs = field_docs(type(obj))
        for f in dataclasses.fields(obj):
            value = getattr(obj, f.name)
            if is_group(value):  # a nested group is documented by its class's docstring, its keys each by theirs
                assert (type(value).__doc__ or "").strip(), f"{prefix}.{f.name} has no docstring"
                check(value, f"{prefix}.{f.name}")
            else:
                assert docs.get(f.name), f"{prefix}.{f.name} has no docstring"
    cfg = Config()
    for section in dataclasses.fields(cfg):
        check(getattr(cfg, section.name), section.name)
    assert main(["train", "--help-config"]) == 0
    out = capsys.readouterr().out
    assert "  task.max_value (int, default 999): multistep: bound on every intermediate value" in out
    assert "  algo.beta (float, default 0.04): " in out
    # a group's keys under their owner, indented below the group's own line
    assert "\n  algo.sapo.*: algo.policy_loss=sapo" in out
    assert "\n    algo.sapo.temperature_pos (float, default 1.0): " in out


def test_string_overrides_are_taken_verbatim():
    # YAML would read "From {start}: {steps}." as a mapping and "null" as None.
    cfg = load_config(None, ["task.multistep_template=From {start}: {steps}.", "rm.output=null"])
    assert cfg.task.multistep_template == "From {start}: {steps}."
    assert cfg.rm.output == "null"
    assert load_config(None, ["train.progress=false", "optim.lr=2e-5"]).optim.lr == 2e-5


def test_a_yaml_error_keeps_its_line_and_column(tmp_path, capsys):
    from covey.cli.main import main
    bad = tmp_path / "my.yaml"
    bad.write_text("algo:\n  beta: 0.1\n    epochs: 2\n")
    with pytest.raises(ConfigError) as err:
        load_config(str(bad))
    assert str(err.value) == f"{bad}:3:11: invalid YAML: mapping values are not allowed here"
    unclosed = tmp_path / "unclosed.yaml"
    unclosed.write_text("algo:\n  beta: [0.1\ntrain:\n  steps: 3\n")
    assert main(["train", str(unclosed), "--print-config"]) == 2
    assert capsys.readouterr().err.strip() == (f"covey train: error: {unclosed}:3:6: invalid YAML: expected ',' or "
                                               "']', but got ':' (while parsing a flow sequence that starts at 2:9)")


def test_a_yaml_list_of_reward_functions_is_the_comma_list(tmp_path):
    path = tmp_path / "my.yaml"
    path.write_text("reward:\n  functions:\n    - my_rewards.py:length\n    - my_rewards:format:0.5\n"
                    "optim:\n  betas: [0.9, 0.95]\n")
    cfg = load_config(str(path))
    assert cfg.reward.functions == "my_rewards.py:length,my_rewards:format:0.5"
    assert cfg.optim.betas == "0.9,0.95"
    path.write_text("task:\n  system_prompt: [a, b]\n")  # not a list-valued key: no silent "['a', 'b']"
    with pytest.raises(ConfigError, match=re.escape("config key 'task.system_prompt' expects str, got ['a', 'b']")):
        load_config(str(path))


def test_a_preset_then_a_yaml_file_then_overrides(tmp_path, capsys):
    from covey.cli.main import main
    path = tmp_path / "my.yaml"
    path.write_text("algo:\n  beta: 0.2\ntrain:\n  steps: 7\n  seed: 3\n")
    cfg = load_config(*split_config(["ppo", str(path), "train.steps=9"]))
    assert cfg.algo.estimator == "gae" and cfg.algo.kl_in == "reward"  # the preset's
    assert (cfg.algo.beta, cfg.train.seed) == (0.2, 3)  # the file's, over the preset's beta=0.05
    assert cfg.train.steps == 9  # the override, over the file's
    assert main(["train", "ppo", str(path), "train.steps=9", "--print-config"]) == 0
    assert "estimator: gae" in capsys.readouterr().out
    with pytest.raises(ConfigError, match=re.escape("override 'ppo' is not key=value (presets and YAML files come "
                                                    "before the overrides)")):
        load_config(*split_config(["train.steps=9", "ppo"]))


@pytest.mark.parametrize("key, old_guess, message", [
    ("rollout.lr", "rollout.top_p", "unknown config key 'rollout.lr' (did you mean 'optim.lr'?)"),
    ("task.dataset", "task.train_size", "unknown config key 'task.dataset'"),
    ("reward.weights", "reward.prm_weight", "unknown config key 'reward.weights'"),
    ("algo.kl", "algo.kl_in", "unknown config key 'algo.kl'"),
    ("model.name", "model.path", "unknown config key 'model.name'"),
    ("algo.temperature", "temperature", "unknown config key 'algo.temperature' (did you mean 'rollout.temperature'?)"),
    ("rollout.n", "rollout.engine", "unknown config key 'rollout.n' (another trainer's name): covey's is "
                                    "rollout.group_size"),
    ("eval.metrics", "eval.metric", "unknown config key 'eval.metrics' (did you mean 'eval.metric'?)"),
    ("rollouts.group_size", "rollout.group_size",
     "unknown config key 'rollouts.group_size' (did you mean 'rollout.group_size'?)"),
])
def test_no_guess_lands_on_an_unrelated_key(key, old_guess, message):
    """Each `old_guess` is what the nearest spelling over every key said; the last two were right."""
    with pytest.raises(ConfigError) as err:
        load_config(None, [f"{key}=1"])
    assert str(err.value) == message


def test_distillation_alone_needs_no_group():
    """The reverse-KL advantage is per token, against the teacher: one sample per prompt is enough; with
    algo.distill.reward_weight the estimator's group baseline comes back, and its group size with it."""
    base = ["algo.learner=distill", "algo.distill.teacher=teacher", "algo.beta=0", "rollout.group_size=1"]
    assert plan_of(*base).learner == "distill"
    with pytest.raises(ConfigError, match="rollout.group_size must be >= 2"):
        plan_of(*base, "algo.distill.reward_weight=0.5")
