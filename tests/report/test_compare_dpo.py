"""The policy-gradient variance measurement on the tiny model. Iterative DPO in the loop and a run
measuring the variance (which must not change the training) share the one run per preset of
tests/training/test_presets_pinned.py."""

import pytest
import torch

from covey.config import load_config
from covey.models.load import load_policy
from covey.rollout.hf import HFEngine
from covey.training.gradvar import add_minibatch_gradient, measure_grad_variance
from covey.training.plan import make_plan


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
