"""Truncated importance sampling weights, derived by hand."""

import math

import pytest
import torch

from covey import algos
from covey.algos import Normalizer, PolicyInputs, PolicyLossOptions, ppo_clip_loss, truncated_is_weights

# Two sequences, L = 3; the second has one valid token. Probabilities of the sampled tokens:
#   trainer pi:  [[0.6, 0.2, 0.9], [0.3, -, -]]
#   sampler mu:  [[0.2, 0.4, 0.1], [0.3, -, -]]
# ratios r = pi/mu = [[3, 0.5, 9], [1]]; with cap C = 2: w = min(r, 2) = [[2, 0.5, 2], [1]]
#   weight_mean = (2 + 0.5 + 2 + 1) / 4 = 1.375
#   capped_frac = 2 of 4 tokens (r = 3 and r = 9) = 0.5
#   ratio_max   = 9
#   mismatch_kl (k3, r - 1 - ln r): 3: 2 - ln 3; 0.5: -0.5 + ln 2; 9: 8 - ln 9; 1: 0
#               = (9.5 - ln 3 + ln 2 - ln 9) / 4 = (9.5 - ln 13.5) / 4
PI = torch.tensor([[0.6, 0.2, 0.9], [0.3, 0.5, 0.5]], dtype=torch.float64)
MU = torch.tensor([[0.2, 0.4, 0.1], [0.3, 0.5, 0.5]], dtype=torch.float64)
MASK = torch.tensor([[1, 1, 1], [1, 0, 0]], dtype=torch.bool)


def test_weights_and_metrics_by_hand():
    weights, metrics = truncated_is_weights(PI.log(), MU.log(), MASK, cap=2.0)
    expected = torch.tensor([[2.0, 0.5, 2.0], [1.0, 0.0, 0.0]], dtype=torch.float64)
    assert torch.allclose(weights, expected, atol=1e-12)
    assert metrics["tis/weight_mean"] == pytest.approx(1.375)
    assert metrics["tis/capped_frac"] == pytest.approx(0.5)
    assert metrics["tis/ratio_max"] == pytest.approx(9.0)
    assert metrics["tis/mismatch_kl"] == pytest.approx((9.5 - math.log(13.5)) / 4)


def test_equal_samplers_give_weight_one_and_no_mismatch():
    weights, metrics = truncated_is_weights(PI.log(), PI.log(), MASK, cap=2.0)
    assert torch.equal(weights, MASK.double())
    assert metrics["tis/mismatch_kl"] == 0.0 and metrics["tis/capped_frac"] == 0.0


def test_masked_garbage_no_gradient_and_bad_cap():
    train = PI.log().clone().requires_grad_(True)
    sampler = MU.log().clone()
    sampler[1, 1:] = float("nan")  # padding may hold anything
    weights, metrics = truncated_is_weights(train, sampler, MASK, cap=2.0)
    assert torch.isfinite(weights).all() and not weights.requires_grad
    assert all(math.isfinite(v) for v in metrics.values())
    with pytest.raises(ValueError, match=">= 1"):
        truncated_is_weights(PI.log(), MU.log(), MASK, cap=0.5)


def test_the_weights_scale_each_loss_term():
    """ppo_clip reads the weights as a `scale_term` loss (w_t A_t): max(-wA r, -wA clip(r)) = w max(-A r, -A clip(r)),
    w >= 0, so the loss is each token's term times its weight, value and gradient."""
    torch.manual_seed(0)
    old = torch.randn(2, 3, dtype=torch.float64)
    logp = (old + 0.3 * torch.randn(2, 3, dtype=torch.float64)).requires_grad_(True)
    adv = torch.randn(2, 3, dtype=torch.float64)
    weights, _ = truncated_is_weights(PI.log(), MU.log(), MASK, cap=2.0)
    norm = Normalizer.from_totals("token_mean", 4, 2, 3)
    folded, _ = ppo_clip_loss(PolicyInputs(logp, old, adv, MASK, is_weights=weights), norm, PolicyLossOptions())
    ratio = torch.exp(logp - old)
    per_token = torch.maximum(-adv * ratio, -adv * ratio.clamp(0.8, 1.2))
    by_hand = (weights * per_token)[MASK].sum() / 4
    assert torch.allclose(folded, by_hand, atol=1e-12)
    g1, = torch.autograd.grad(folded, logp)
    g2, = torch.autograd.grad(by_hand, logp)
    assert torch.allclose(g1, g2, atol=1e-12)
    assert algos.truncated_is_weights is truncated_is_weights


def test_sampler_mismatch_by_hand():
    from covey.algos import sampler_mismatch
    # log pi_train - log mu on the valid tokens: [0.5, -0.2, 1.0] (the 4th token is padding, garbage there)
    train = torch.tensor([[0.0, -1.2, 0.0, 99.0]], dtype=torch.float64)
    sampler = torch.tensor([[-0.5, -1.0, -1.0, 0.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 0]])
    m = sampler_mismatch(train, sampler, mask, cap=2.0)
    # mean (0.5 - 0.2 + 1.0) / 3 = 0.4333...; max |.| = 1.0; beyond log 2 = 0.693: only 1.0 -> 1/3
    assert m["sampler/log_ratio_mean"] == pytest.approx(1.3 / 3)
    assert m["sampler/log_ratio_max"] == pytest.approx(1.0)
    assert m["sampler/beyond_cap_frac"] == pytest.approx(1 / 3)
