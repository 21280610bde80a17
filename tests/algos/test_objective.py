"""The micro-batch objective (policy loss + KL + entropy, masked first) on numbers derived by hand."""

import math

import pytest
import torch

from covey.algos import (
    Normalizer,
    ObjectiveOptions,
    PolicyInputs,
    PolicyLossOptions,
    entropy_loss,
    kl_loss,
    policy_loss,
    policy_objective,
)

F64 = torch.float64
NAN, INF = float("nan"), float("inf")
MASK = torch.tensor([[True, True, False]])           # two valid tokens, then padding
TOKEN_MEAN = Normalizer.from_totals("token_mean", 2.0, 1, 3)


def inputs(pad=NAN):
    """Valid tokens: logp (ln 0.5, ln 0.25), ref (ln 0.25, ln 0.5), A (1, -2), H (1, 2); `pad` after."""
    logp = torch.tensor([[math.log(0.5), math.log(0.25), pad]], dtype=F64, requires_grad=True)
    old = torch.tensor([[math.log(0.5), math.log(0.25), pad]], dtype=F64)   # on-policy: ratio 1
    ref = torch.tensor([[math.log(0.25), math.log(0.5), -pad]], dtype=F64)
    adv = torch.tensor([[1.0, -2.0, pad]], dtype=F64)
    entropy = torch.tensor([[1.0, 2.0, abs(pad)]], dtype=F64, requires_grad=True)
    return logp, old, ref, adv, entropy


@pytest.mark.parametrize("pad", [NAN, INF, -INF])
def test_objective_worked_by_hand_with_garbage_in_the_padding(pad):
    # policy (ppo_clip, ratio 1 on both tokens): per token -A = (-1, 2); token mean 0.5
    # KL k3 with d = logp - ref: d = +ln 2 -> e^-d + d - 1 = 0.5 + ln 2 - 1 = 0.193147
    #                            d = -ln 2 -> 2 - ln 2 - 1 = 0.306853;  mean 0.25; x coef 0.5 = 0.125
    # entropy: mean H = 1.5; x -0.1 = -0.15
    # loss = 0.5 + 0.125 - 0.15 = 0.475
    logp, old, ref, adv, entropy = inputs(pad)
    loss, m = policy_objective(PolicyInputs(logp, old, adv, MASK, ref_logp=ref, entropy=entropy), TOKEN_MEAN,
                               ObjectiveOptions("ppo_clip", PolicyLossOptions(), kl_coef=0.5, kl_kind="k3",
                                                entropy_coef=0.1))
    assert loss.item() == pytest.approx(0.475)
    assert m["kl/ref"] == pytest.approx(0.25) and m["policy/entropy"] == pytest.approx(1.5)
    assert m["adv/mean"] == pytest.approx(-0.5) and m["policy/ratio_mean"] == pytest.approx(1.0)
    assert all(math.isfinite(v) for v in m.values())
    loss.backward()
    # d/dlogp, each term over the 2 tokens of the token mean:
    #   policy -A ratio = (-1, 2) / 2 = (-0.5, 1.0)
    #   KL 0.5 * (1 - e^-d) = 0.5 * (0.5, -1) / 2 = (0.125, -0.25)
    #   sum (-0.375, 0.75), and exactly 0 on the padded token whatever it holds
    assert logp.grad[0].tolist() == pytest.approx([-0.375, 0.75, 0.0])
    assert entropy.grad[0].tolist() == pytest.approx([-0.05, -0.05, 0.0])  # -0.1 / 2 per valid token


def test_objective_is_the_sum_of_the_tested_terms():
    # on clean inputs the objective is policy_loss + kl_loss + entropy_loss, term by term
    logp, old, ref, adv, entropy = inputs(pad=0.0)
    loss, m = policy_objective(PolicyInputs(logp, old, adv, MASK, ref_logp=ref, entropy=entropy), TOKEN_MEAN,
                               ObjectiveOptions("ppo_clip", kl_coef=0.5, entropy_coef=0.1))
    p, pm = policy_loss("ppo_clip", PolicyInputs(logp, old, adv, MASK), TOKEN_MEAN)
    k, km = kl_loss(logp, ref, MASK, TOKEN_MEAN, 0.5, "k3")
    e, em = entropy_loss(entropy, MASK, TOKEN_MEAN, 0.1)
    assert loss.item() == pytest.approx((p + k + e).item(), abs=1e-15)
    assert m == {**pm, **km, **em}


def test_zero_coefficients_report_and_add_nothing():
    # kl_coef 0: kl/ref still reported (0.25), no KL in the loss; entropy_coef 0: policy/entropy
    # still reported (1.5), no bonus; the loss is the policy term alone, 0.5
    logp, old, ref, adv, entropy = inputs()
    loss, m = policy_objective(PolicyInputs(logp, old, adv, MASK, ref_logp=ref, entropy=entropy), TOKEN_MEAN)
    assert loss.item() == pytest.approx(0.5)
    assert m["kl/ref"] == pytest.approx(0.25) and m["policy/entropy"] == pytest.approx(1.5)
    loss.backward()
    assert logp.grad[0].tolist() == pytest.approx([-0.5, 1.0, 0.0])
    assert entropy.grad is None  # the bonus is not in the graph
    # without a reference or an entropy, neither metric exists; pg needs no old log-probs:
    # l = -A logp = -(1 * ln 0.5) - (-2 * ln 0.25) = ln 2 - 4 ln 2 = -3 ln 2, token mean -1.5 ln 2
    logp, _, _, adv, _ = inputs()
    loss, m = policy_objective(PolicyInputs(logp, None, adv, MASK), TOKEN_MEAN,
                               ObjectiveOptions("pg", kl_coef=0.5, entropy_coef=0.1))
    assert loss.item() == pytest.approx(-1.5 * math.log(2))
    assert "kl/ref" not in m and "policy/entropy" not in m and "policy/approx_kl" not in m
