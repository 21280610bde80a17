"""High-entropy token selection, adaptive entropy, Clip-Cov / KL-Cov and the TIS modes through the
trainer on the tiny model: each option runs a step, logs what it chose, and resumes exactly."""

import json

import pytest
import torch

import covey
from covey.config import ConfigError, load_config
from tests.helpers import tiny_overrides


def lines(run_dir) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def run(tiny_model_dir, folder, **keys):
    base = {"reward.functions": "tests.helpers:varied_reward", "reward.correctness": 0.0, **keys}
    return lines(covey.train(load_config(None, tiny_overrides(tiny_model_dir, folder, **base))).run_dir)


def test_high_entropy_tokens_carry_the_gradient(tiny_model_dir, tmp_path):
    m = run(tiny_model_dir, tmp_path / "q", **{"train.steps": 1, "algo.top_entropy_quantile": 0.2})[1]
    # the top 20% of the step's tokens by pi_old's entropy keep their advantage (ties kept: at least 20%)
    assert 0.2 <= m["select/entropy_kept_frac"] < 0.35 and m["select/entropy_threshold"] > 0
    assert m["optim/grad_norm"] > 0 and torch.isfinite(torch.tensor(m["policy/loss"]))


def test_adaptive_entropy_steps_and_resumes_exactly(tiny_model_dir, tmp_path):
    # a target far above the tiny model's entropy: e_k < target every step, so alpha_k = c_k and c grows by
    # delta: alpha_1 = c_0 = 0.01, alpha_2 = 0.01 + 0.005 = 0.015, alpha_3 = 0.02
    keys = {"train.steps": 3, "algo.adaptive_entropy": "true", "algo.adaptive_entropy.target": 100.0,
            "algo.entropy_coef": 0.01, "algo.adaptive_entropy.coef_delta": 0.005}
    whole = run(tiny_model_dir, tmp_path / "whole", **keys)
    assert [m["policy/entropy_coef"] for m in whole[1:4]] == pytest.approx([0.01, 0.015, 0.02])
    assert whole[1]["select/rollout_entropy"] < 100.0
    # stopped after step 1 and resumed: the controller's state comes back with the checkpoint
    run(tiny_model_dir, tmp_path / "cut", **{**keys, "train.steps": 1})
    resumed = run(tiny_model_dir, tmp_path / "cut", **{**keys, "train.resume": "auto"})
    assert [m["policy/entropy_coef"] for m in resumed[1:4]] == pytest.approx([0.01, 0.015, 0.02])


@pytest.mark.parametrize("control", ["clip_cov", "kl_cov"])
def test_covariance_controls_select_their_share(tiny_model_dir, tmp_path, control):
    # 8 sequences x up to 8 tokens; a share of 0.25 of the T valid tokens: floor(0.25 T) of them chosen
    # (Clip-Cov among the tokens whose covariance lies in (-100, 100): all of them)
    keys = {"train.steps": 1, "algo.cov_control": control, "algo.clip_cov.ratio": 0.25, "algo.clip_cov.lb": -100,
            "algo.clip_cov.ub": 100, "algo.kl_cov.ratio": 0.25, "algo.epochs": 2}
    m = run(tiny_model_dir, tmp_path / control, **keys)[1]
    tokens = round(m["response/len_mean"] * 8)
    assert m["select/cov_frac"] == pytest.approx(int(0.25 * tokens) / tokens, abs=1e-6)
    assert m["optim/grad_norm"] > 0


def test_clip_cov_draw_is_seeded(tiny_model_dir, tmp_path):
    """Two runs with one seed pick the same tokens: their losses agree to the bit."""
    keys = {"train.steps": 1, "algo.cov_control": "clip_cov", "algo.clip_cov.ratio": 0.3, "algo.clip_cov.lb": -100,
            "algo.clip_cov.ub": 100}
    a, b = run(tiny_model_dir, tmp_path / "a", **keys)[1], run(tiny_model_dir, tmp_path / "b", **keys)[1]
    assert a["policy/loss"] == b["policy/loss"] and a["select/cov_frac"] > 0


def test_a_masked_tis_mode_runs_on_the_fast_engine(tiny_model_dir, tmp_path):
    """The modes' weights by hand: tests/algos/test_tis_modes.py."""
    m = run(tiny_model_dir, tmp_path / "tis", **{"train.steps": 1, "algo.tis.cap": 2,
                                                 "algo.tis.mode": "sequence_mask"})[1]
    # fp32 sampling from the trained weights: every ratio is 1 up to kernel order, nothing beyond the cap
    assert m["tis/weight_mean"] == pytest.approx(1.0, abs=1e-3) and m["tis/capped_frac"] == 0.0


@pytest.mark.parametrize("keys", [
    {"algo.policy_loss": "gmpo", "algo.top_entropy_quantile": 0.5, "algo.tis.cap": 2,
     "algo.tis.mode": "sequence_truncate"},
    {"algo.policy_loss": "vespo", "algo.tis.cap": 2, "algo.tis.mode": "token_mask", "algo.cov_control": "clip_cov",
     "algo.clip_cov.ratio": 0.25, "algo.clip_cov.lb": -100, "algo.clip_cov.ub": 100},
], ids=["gmpo", "vespo"])
def test_the_sequence_losses_train_with_their_token_devices(tiny_model_dir, tmp_path, keys):
    """gmpo over the kept tokens with a weight per sequence, vespo with the bounded sampler ratios inside its weight
    and Clip-Cov's tokens dropped: a step with two epochs (the second off policy) that moves the policy.
    What each pair computes, by hand: tests/training/test_loss_devices.py."""
    m = run(tiny_model_dir, tmp_path / keys["algo.policy_loss"], **{"train.steps": 1, "algo.epochs": 2, **keys})[1]
    assert m["optim/grad_norm"] > 0 and torch.isfinite(torch.tensor(m["policy/loss"]))
    assert m["tis/weight_mean"] == pytest.approx(1.0, abs=1e-3)


def test_bad_values_fail_with_their_key():
    for bad, key in (("algo.tis.mode=sequence", "algo.tis.mode"), ("algo.cov_control=cov", "algo.cov_control"),
                     ("algo.top_entropy_quantile=1.5", "algo.top_entropy_quantile"),
                     ("algo.clip_cov.lb=6", "algo.clip_cov.lb")):
        with pytest.raises(ConfigError, match=key):
            covey.train(load_config(None, [bad, "model.path=/nonexistent"]))
