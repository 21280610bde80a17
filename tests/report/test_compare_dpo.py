"""Iterative DPO in the loop and the policy-gradient variance measurement, on the tiny model."""

import json

import pytest
import torch

from covey.cli.main import main
from covey.config import load_config
from covey.train.gradvar import add_minibatch_gradient, measure_grad_variance
from covey.train.plan import make_plan
from covey.models.load import load_policy
from covey.rollout.hf import HFEngine
from tests.helpers import tiny_overrides

VARIED = "reward.functions=tests.report.test_compare:varied_reward:1"


def metric_rows(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_dpo_iterative_trains_on_pairs(tiny_model_dir, tmp_path):
    code = main(["train", "dpo_iterative", VARIED, "train.samples_every=1",
                 *tiny_overrides(tiny_model_dir, tmp_path)])
    assert code == 0
    steps = [r for r in metric_rows(tmp_path / "t" / "metrics.jsonl") if "reward/mean" in r]
    first = steps[0]
    assert first["dpo/pairs"] >= 1 and first["optim/grad_norm"] > 0
    # step 1: the policy still equals the reference, so every margin is 0 and the loss is log 2
    assert first["dpo/loss"] == pytest.approx(0.6931, abs=1e-3) and first["dpo/margin"] == pytest.approx(0, abs=1e-4)
    assert first["kl/ref"] == pytest.approx(0, abs=1e-5)
    assert "advantages/std" not in first  # no advantage estimator runs for DPO
    # sample logs carry the preference label: +1 chosen, -1 rejected, 0 unpaired
    labels = {json.loads(line)["advantage"] for line in (tmp_path / "t" / "samples.jsonl").read_text().splitlines()}
    assert {-1.0, 1.0} <= labels <= {-1.0, 0.0, 1.0}


def test_grad_variance_does_not_change_training(tiny_model_dir, tmp_path):
    rows = {}
    for every in (0, 1):
        out = tmp_path / f"every{every}"
        assert main(["train", "grpo", VARIED, f"train.grad_var_every={every}",
                     *tiny_overrides(tiny_model_dir, out)]) == 0
        rows[every] = [r for r in metric_rows(out / "t" / "metrics.jsonl") if "reward/mean" in r]
    for plain, measured in zip(rows[0], rows[1]):
        for key in ("reward/mean", "policy/loss", "optim/grad_norm", "kl/ref", "policy/entropy"):
            assert measured[key] == plain[key], key
        assert "policy/grad_var" not in plain
        assert measured["policy/grad_var"] >= 0 and 0 <= measured["policy/grad_noise_frac"] <= 4 / 3
        assert measured["time/grad_var"] > 0


def scored_rollout(model_dir):
    policy, tok = load_policy(model_dir, dtype=torch.float32)
    engine = HFEngine(policy, tok, max_new_tokens=6)
    torch.manual_seed(0)
    rollout = engine.generate([tok.apply_chat_template([{"role": "user", "content": f"{i}+1?"}], tokenize=False,
                                                       add_generation_prompt=True) for i in range(2)], 4)
    rollout.advantages = torch.linspace(-1, 1, len(rollout))[:, None] * rollout.response_mask
    return policy, rollout


def test_grad_variance_matches_the_stacked_gradients(tiny_model_dir):
    # direct computation: stack the 4 mini-batch gradients, var = sum_m |g_m - mean|^2 / 3
    cfg = load_config(None, ["algo.beta=0", "train.grad_var_batches=4", "algo.micro_batch_size=1"])
    opts = make_plan(cfg).update
    policy, rollout = scored_rollout(tiny_model_dir)
    params = [p for p in policy.parameters() if p.requires_grad]
    order = torch.randperm(len(rollout), generator=torch.Generator().manual_seed(7))
    flat = []
    for batch in order.split(2):
        add_minibatch_gradient(policy, rollout, batch, opts, 0.0)
        flat.append(torch.cat([p.grad.flatten() for p in params]).double())
        policy.zero_grad(set_to_none=True)
    flat = torch.stack(flat)
    expected = float(((flat - flat.mean(0)) ** 2).sum() / 3)
    m = measure_grad_variance(policy, rollout, opts, 0.0, seed=7, num_batches=cfg.train.grad_var_batches)
    assert expected > 0
    assert m["policy/grad_var"] == pytest.approx(expected, rel=1e-4)
    assert m["policy/grad_mean_sq"] == pytest.approx(float((flat.mean(0) ** 2).sum()), rel=1e-4)
    assert m["policy/grad_noise_frac"] == pytest.approx(expected / float((flat ** 2).sum(1).mean()), rel=1e-4)
    assert all(p.grad is None for p in params)
