"""Token-level estimators (REINFORCE++, GAE) and their building blocks on numbers derived by hand."""

import math

import pytest
import torch

from covey.algos import (
    AdvantageInput,
    AdvantageOptions,
    compute_advantages,
    discounted_returns,
    gae_advantages,
    token_rewards,
)

F64 = torch.float64


def test_token_rewards_score_on_last_valid_token_and_kl_everywhere():
    # row 0: 3 tokens, score 1, kl 0.1 * 0.5 = 0.05 per token -> [-0.05, -0.05, 0.95]
    # row 1: hole at t=1, last valid token t=2 -> [-0.05, 0, 1.95]; row 2: empty -> zeros (score lost)
    mask = torch.tensor([[1, 1, 1], [1, 0, 1], [0, 0, 0]], dtype=torch.bool)
    r = token_rewards(torch.tensor([1.0, 2.0, 3.0], dtype=F64), mask, torch.full((3, 3), 0.1, dtype=F64), 0.5)
    assert torch.allclose(r, torch.tensor([[-0.05, -0.05, 0.95], [-0.05, 0, 1.95], [0, 0, 0]], dtype=F64))


def test_discounted_returns_by_hand():
    # r = [1, 2, 3], gamma 0.5: G2 = 3, G1 = 2 + 1.5 = 3.5, G0 = 1 + 1.75 = 2.75
    # with a hole at t=1 the hole is skipped: G2 = 3, G0 = 1 + 0.5 * 3 = 2.5
    r = torch.tensor([[1.0, 2.0, 3.0], [1.0, 2.0, 3.0]], dtype=F64)
    mask = torch.tensor([[1, 1, 1], [1, 0, 1]], dtype=torch.bool)
    assert torch.allclose(discounted_returns(r, mask, 0.5), torch.tensor([[2.75, 3.5, 3.0], [2.5, 0, 3.0]], dtype=F64))


def reinforce_input():
    # scores [1, 0], lengths 3 and 2, token_kl 0.1 everywhere (padding included), kl_coef 0.5
    return AdvantageInput(scores=torch.tensor([1.0, 0.0], dtype=F64),
                          response_mask=torch.tensor([[1, 1, 1], [1, 1, 0]], dtype=torch.bool),
                          group_ids=torch.tensor([0, 0]), token_kl=torch.full((2, 3), 0.1, dtype=F64), kl_coef=0.5)


def test_reinforce_pp_returns_and_batch_whitening():
    # token rewards: seq 0 [-0.05, -0.05, 0.95], seq 1 [-0.05, -0.05]
    # gamma 0.5: seq 0 G = [-0.05 + 0.5*0.425, -0.05 + 0.5*0.95, 0.95] = [0.1625, 0.425, 0.95]
    #            seq 1 G = [-0.05 + 0.5*(-0.05), -0.05] = [-0.075, -0.05]
    # whitening over the 5 valid tokens: mean 1.4125/5 = 0.2825;
    # squared deviations 0.0144 + 0.02030625 + 0.44555625 + 0.12780625 + 0.11055625 = 0.718625, var 0.143725,
    # std 0.3791108 -> A = (G - 0.2825) / 0.3791108
    adv, ret, _ = compute_advantages("reinforce_pp", reinforce_input(), AdvantageOptions(gamma=0.5, eps=0.0))
    assert torch.allclose(ret, torch.tensor([[0.1625, 0.425, 0.95], [-0.075, -0.05, 0.0]], dtype=F64))
    expected = torch.tensor([[-0.3165302, 0.3758796, 1.7606990], [-0.9429961, -0.8770523, 0.0]], dtype=F64)
    assert torch.allclose(adv, expected, atol=1e-6)
    raw, _, _ = compute_advantages("reinforce_pp", reinforce_input(), AdvantageOptions(gamma=0.5, normalize="none"))
    assert torch.allclose(raw, ret)


def test_reinforce_pp_baseline_subtracts_group_mean_first():
    # scores [1, 0] -> [0.5, -0.5]; no KL, gamma 1: G = [0.5, 0.5, 0.5], [-0.5, -0.5]
    # whitening: mean (1.5 - 1)/5 = 0.1; deviations 0.4 (x3), -0.6 (x2); var (0.48 + 0.72)/5 = 0.24
    inp = reinforce_input()
    inp.kl_coef = 0.0
    adv, ret, _ = compute_advantages("reinforce_pp_baseline", inp, AdvantageOptions(eps=0.0))
    s = math.sqrt(0.24)
    assert torch.allclose(ret, torch.tensor([[0.5, 0.5, 0.5], [-0.5, -0.5, 0]], dtype=F64))
    assert torch.allclose(adv, torch.tensor([[0.4 / s] * 3, [-0.6 / s, -0.6 / s, 0]], dtype=F64))


def gae_input():
    # seq 0: V = [0.1, 0.2, 0.3], score 1 at t=2
    # seq 1: hole at t=1 (V there is garbage 99), V = [0.5, ., 0.2], score 2 at t=2
    return AdvantageInput(scores=torch.tensor([1.0, 2.0], dtype=F64),
                          response_mask=torch.tensor([[1, 1, 1], [1, 0, 1]], dtype=torch.bool),
                          group_ids=torch.tensor([0, 1]),
                          values=torch.tensor([[0.1, 0.2, 0.3], [0.5, 99.0, 0.2]], dtype=F64))


def test_gae_by_hand():
    # gamma 0.9, lam 0.5 (gamma * lam = 0.45)
    # seq 0: t2: delta = 1 + 0 - 0.3 = 0.7, A = 0.7
    #        t1: delta = 0 + 0.9*0.3 - 0.2 = 0.07, A = 0.07 + 0.45*0.7 = 0.385
    #        t0: delta = 0 + 0.9*0.2 - 0.1 = 0.08, A = 0.08 + 0.45*0.385 = 0.25325
    #        returns = A + V = [0.35325, 0.585, 1.0]
    # seq 1 (hole skipped): t2: delta = 2 - 0.2 = 1.8; t0: delta = 0.9*0.2 - 0.5 = -0.32, A = -0.32 + 0.45*1.8 = 0.49
    adv, ret, _ = compute_advantages("gae", gae_input(), AdvantageOptions(gamma=0.9, lam=0.5))
    assert torch.allclose(adv, torch.tensor([[0.25325, 0.385, 0.7], [0.49, 0.0, 1.8]], dtype=F64))
    assert torch.allclose(ret, torch.tensor([[0.35325, 0.585, 1.0], [0.99, 0.0, 2.0]], dtype=F64))


def test_gae_lambda_extremes():
    # lam = 0: A_t = delta_t (one-step TD); lam = 1, gamma = 1: A_t = G_t - V_t (Monte Carlo)
    r = torch.tensor([[0.0, 0.0, 1.0]], dtype=F64)
    v = torch.tensor([[0.1, 0.2, 0.3]], dtype=F64)
    m = torch.ones(1, 3, dtype=torch.bool)
    td, _ = gae_advantages(r, v, m, gamma=1.0, lam=0.0)
    assert torch.allclose(td, torch.tensor([[0.1, 0.1, 0.7]], dtype=F64))  # 0+0.2-0.1, 0+0.3-0.2, 1-0.3
    mc, ret = gae_advantages(r, v, m, gamma=1.0, lam=1.0)
    assert torch.allclose(mc, torch.tensor([[0.9, 0.8, 0.7]], dtype=F64))
    assert torch.allclose(ret, torch.ones(1, 3, dtype=F64))


def test_gae_whitening_and_kl_in_reward():
    # KL-in-reward: token_kl 1, kl_coef 0.1 -> r = [-0.1, -0.1, 0.9] for seq 0 with V = 0, gamma = lam = 1
    # A = G = [0.7, 0.8, 0.9]
    inp = gae_input()
    inp.values = torch.zeros(2, 3, dtype=F64)
    inp.token_kl, inp.kl_coef = torch.ones(2, 3, dtype=F64), 0.1
    adv, _, _ = compute_advantages("gae", inp, AdvantageOptions(gamma=1.0, lam=1.0))
    assert torch.allclose(adv[0], torch.tensor([0.7, 0.8, 0.9], dtype=F64))
    white, ret, _ = compute_advantages("gae", inp, AdvantageOptions(gamma=1.0, lam=1.0, normalize="global_token"))
    valid = inp.response_mask
    assert white[valid].mean().abs() < 1e-12 and white[valid].std(unbiased=False) == pytest.approx(1.0, abs=1e-5)
    assert torch.allclose(ret, adv)  # returns come from the un-whitened A (V = 0)


def test_gae_needs_values():
    inp = gae_input()
    inp.values = None
    with pytest.raises(ValueError, match="values"):
        compute_advantages("gae", inp, AdvantageOptions())
