"""The policy losses sapo, gmpo, luspo and vespo through the trainer: one step on the tiny model with two
epochs (the second epoch off policy, so the gates and kernels bend), finite metrics; and what the plan
reads from their registry traits (the aggregation a loss is defined with, options it ignores)."""

import math

import pytest

import covey
from covey.config import ConfigError, load_config
from covey.training.plan import make_plan
from tests.helpers import tiny_overrides


@pytest.mark.parametrize("name", ["sapo", "gmpo", "luspo", "vespo"])
def test_a_training_step_with_each_loss(tiny_model_dir, tmp_path, name):
    cfg = load_config(None, tiny_overrides(tiny_model_dir, tmp_path, **{
        "algo.policy_loss": name, "algo.epochs": 2, "train.steps": 1, "optim.lr": 1e-2, "task.train_size": 4,
        "task.eval_size": 0, "rollout.prompts_per_step": 1, "rollout.max_new_tokens": 4,
        "reward.functions": "tests.helpers:varied_reward"}))
    session = covey.open_run(cfg, evaluate_before=False)
    metrics, = list(covey.steps(session))
    covey.finish(session, evaluate=False, save=False)
    keys = ["policy/loss", "policy/clipfrac", "policy/ratio_mean", "optim/grad_norm", "policy/approx_kl"]
    keys += [] if name == "luspo" else ["policy/grad_weight_mean"]
    assert all(math.isfinite(metrics[k]) for k in keys), {k: metrics.get(k) for k in keys}
    assert metrics["optim/grad_norm"] > 0
    assert metrics["policy/ratio_mean"] != 1.0  # the second epoch ran off policy


def test_a_loss_defined_with_its_aggregation_runs_with_it():
    # luspo's length weighting is seq_mean_token_sum; gmpo's mean over sequences is seq_mean_token_mean
    assert make_plan(load_config(None, ["algo.policy_loss=luspo"])).update.loss_agg == "seq_mean_token_sum"
    plan = make_plan(load_config(None, ["algo.policy_loss=luspo", "algo.loss_agg=seq_mean_token_sum"]))
    assert plan.update.loss_agg == "seq_mean_token_sum"
    assert make_plan(load_config(None, ["algo.policy_loss=gmpo"])).update.loss_agg == "seq_mean_token_mean"
    with pytest.raises(ConfigError, match="^algo.loss_agg=token_mean: algo.policy_loss=luspo is defined with "
                                          "algo.loss_agg=seq_mean_token_sum$"):
        make_plan(load_config(None, ["algo.policy_loss=luspo", "algo.loss_agg=token_mean"]))


def test_the_plan_hands_each_loss_its_options():
    plan = make_plan(load_config(None, ["algo.policy_loss=vespo", "algo.vespo.k_pos=1.5", "algo.vespo.lambda_neg=4"]))
    assert (plan.update.loss.vespo.k_pos, plan.update.loss.vespo.lambda_neg) == (1.5, 4.0)
    plan = make_plan(load_config(None, ["algo.policy_loss=sapo", "algo.sapo.temperature_neg=2",
                                        "algo.ratio_level=sequence"]))
    assert (plan.update.loss.sapo.temperature_neg, plan.update.loss.ratio_level) == (2.0, "sequence")
    make_plan(load_config(None, ["algo.policy_loss=luspo", "algo.ratio_level=sequence"]))  # what luspo is


@pytest.mark.parametrize("overrides,message", [
    (["algo.policy_loss=vespo", "algo.clip_eps_high=0.28"],
     "algo.clip_eps_high=0.28 is not read by algo.policy_loss=vespo (it reads: "
     "algo.vespo.*)"),
    (["algo.sapo.temperature_pos=2"],
     "algo.sapo.temperature_pos=2.0 is not read by algo.policy_loss=ppo_clip (it reads: algo.clip_eps_low, "
     "algo.clip_eps_high, algo.dual_clip, algo.ratio_level, algo.ratio_against)"),
    (["algo.policy_loss=pg", "algo.ratio_level=sequence"],
     "algo.ratio_level=sequence is not read by algo.policy_loss=pg (it reads: no loss option)"),
    (["algo.policy_loss=gmpo", "algo.estimator=reinforce_pp"],
     "algo.policy_loss=gmpo reads one advantage per sequence: algo.estimator=reinforce_pp gives per-token "
     "advantages (use grpo, rloo or remax)"),
])
def test_the_plan_rejects_what_the_loss_does_not_read(overrides, message):
    with pytest.raises(ConfigError) as err:
        make_plan(load_config(None, overrides))
    assert str(err.value) == message
