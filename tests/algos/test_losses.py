"""Policy and value losses on hand-derived numbers (torchtune style: the reasoning is in the comments)."""

import math

import pytest
import torch

from covey.algos import (
    POLICY_LOSSES,
    Normalizer,
    PolicyInputs,
    PolicyLossOptions,
    entropy_loss,
    explained_variance,
    kl_loss,
    policy_loss,
    value_loss,
)

F64 = torch.float64


def token_mean(mask):
    return Normalizer.from_totals("token_mean", float(torch.as_tensor(mask).sum()), 1, 1)


def ppo_case():
    # five tokens in one row; ratios and advantages chosen to hit every branch of the clip
    ratios = torch.tensor([[1.5, 0.5, 0.5, 1.5, 4.0]], dtype=F64)
    adv = torch.tensor([[1.0, 1.0, -1.0, -1.0, -1.0]], dtype=F64)
    old = torch.full((1, 5), -2.0, dtype=F64)
    logp = (old + ratios.log()).requires_grad_(True)
    return logp, old, adv, torch.ones(1, 5, dtype=torch.bool)


def test_ppo_clip_every_branch():
    # per token l = max(-A r, -A clip(r, 0.8, 1.2)):
    #   A=+1, r=1.5: max(-1.5, -1.2) = -1.2   upper clip active, gradient 0
    #   A=+1, r=0.5: max(-0.5, -0.8) = -0.5   not clipped, dl/dlogp = -A r = -0.5
    #   A=-1, r=0.5: max( 0.5,  0.8) =  0.8   lower clip active, gradient 0
    #   A=-1, r=1.5: max( 1.5,  1.2) =  1.5   not clipped, dl/dlogp = 1.5
    #   A=-1, r=4.0: max( 4.0,  1.2) =  4.0   not clipped, dl/dlogp = 4.0
    # token mean: (-1.2 - 0.5 + 0.8 + 1.5 + 4.0) / 5 = 0.92
    logp, old, adv, mask = ppo_case()
    loss, m = policy_loss("ppo_clip", PolicyInputs(logp, old, adv, mask), token_mean(mask), PolicyLossOptions())
    assert loss.item() == pytest.approx(0.92)
    loss.backward()
    assert torch.allclose(logp.grad, torch.tensor([[0.0, -0.5, 0.0, 1.5, 4.0]], dtype=F64) / 5)
    assert m["policy/clipfrac"] == pytest.approx(0.4)
    assert m["policy/clipfrac_upper"] == pytest.approx(0.2) and m["policy/clipfrac_lower"] == pytest.approx(0.2)
    assert m["policy/clipfrac_dual"] == 0.0
    assert m["policy/ratio_mean"] == pytest.approx((1.5 + 0.5 + 0.5 + 1.5 + 4.0) / 5)
    assert m["policy/ratio_max"] == pytest.approx(4.0)
    assert m["adv/mean"] == pytest.approx(-0.2) and m["adv/max_abs"] == 1.0
    assert m["adv/std"] == pytest.approx(math.sqrt(0.96))  # values +-1, mean -0.2: (2*1.44 + 3*0.64)/5
    # approx KL(old || new) with d = log r: k1 = mean(-d), k3 = mean(r - 1 - d)
    d = torch.tensor([1.5, 0.5, 0.5, 1.5, 4.0]).log()
    assert m["policy/approx_kl_k1"] == pytest.approx(float(-d.mean()), rel=1e-6)
    assert m["policy/approx_kl"] == pytest.approx(float((d.exp() - 1 - d).mean()), rel=1e-6)


def test_dual_clip_caps_negative_advantage_loss():
    # c = 3: token 5 (A=-1, r=4): min(4.0, -c A = 3) = 3, gradient 0; token 4 (r=1.5): min(1.5, 3) = 1.5
    # token mean: (-1.2 - 0.5 + 0.8 + 1.5 + 3.0) / 5 = 0.72
    logp, old, adv, mask = ppo_case()
    loss, m = policy_loss("ppo_clip", PolicyInputs(logp, old, adv, mask), token_mean(mask),
                          PolicyLossOptions(dual_clip=3.0))
    assert loss.item() == pytest.approx(0.72)
    loss.backward()
    assert torch.allclose(logp.grad, torch.tensor([[0.0, -0.5, 0.0, 1.5, 0.0]], dtype=F64) / 5)
    assert m["policy/clipfrac_dual"] == pytest.approx(0.2)
    with pytest.raises(ValueError, match="dual_clip"):
        policy_loss("ppo_clip", PolicyInputs(logp, old, adv, mask), token_mean(mask), PolicyLossOptions(dual_clip=1.0))


def test_asymmetric_and_large_clip():
    # DAPO clip-higher (0.2, 0.28), A = 1: r = 1.25 -> -1.25 (inside); r = 1.3 -> -1.28 (clipped)
    # R1 setting eps = 10, A = 1: r = 5 < 11 -> -5 (never clipped)
    old = torch.zeros(1, 3, dtype=F64)
    logp = torch.tensor([[1.25, 1.3, 5.0]], dtype=F64).log()
    mask = torch.tensor([[1, 1, 0]], dtype=torch.bool)
    loss, _ = policy_loss("ppo_clip", PolicyInputs(logp, old, torch.ones(1, 3, dtype=F64), mask), token_mean(mask),
                          PolicyLossOptions(clip_eps_high=0.28))
    assert loss.item() == pytest.approx((-1.25 - 1.28) / 2)
    mask = torch.tensor([[0, 0, 1]], dtype=torch.bool)
    loss, m = policy_loss("ppo_clip", PolicyInputs(logp, old, torch.ones(1, 3, dtype=F64), mask), token_mean(mask),
                          PolicyLossOptions(clip_eps_low=10.0, clip_eps_high=10.0))
    assert loss.item() == pytest.approx(-5.0) and m["policy/clipfrac"] == 0.0


def test_gspo_sequence_ratio():
    # log ratios [0.2, -0.4] -> sequence ratio s = exp(mean) = exp(-0.1) = 0.904837 on both tokens
    # eps 0.05, A = +1: s < 0.95 but A > 0 -> unclipped: l = -s per token
    # seq_mean_token_mean, 1 sequence: loss = -s; dl/dlogp_t = -s / 2 (d s / d logp_t = s / T)
    old = torch.zeros(1, 2, dtype=F64)
    logp = torch.tensor([[0.2, -0.4]], dtype=F64, requires_grad=True)
    mask = torch.ones(1, 2, dtype=torch.bool)
    norm = Normalizer.from_totals("seq_mean_token_mean", 2, 1, 2)
    opts = PolicyLossOptions(clip_eps_low=0.05, clip_eps_high=0.05, ratio_level="sequence")
    loss, m = policy_loss("ppo_clip", PolicyInputs(logp, old, torch.ones(1, 2, dtype=F64), mask), norm, opts)
    s = math.exp(-0.1)
    assert loss.item() == pytest.approx(-s)
    loss.backward()
    assert torch.allclose(logp.grad, torch.full((1, 2), -s / 2, dtype=F64))
    assert m["policy/ratio_mean"] == pytest.approx(s)
    # A = -1: max(s, clip(s) = 0.95) = 0.95, clipped -> no gradient
    logp.grad = None
    loss, m = policy_loss("ppo_clip", PolicyInputs(logp, old, -torch.ones(1, 2, dtype=F64), mask), norm, opts)
    assert loss.item() == pytest.approx(0.95) and m["policy/clipfrac_lower"] == 1.0
    loss.backward()
    assert torch.allclose(logp.grad, torch.zeros(1, 2, dtype=F64))


def test_gspo_gradient_equals_sequence_objective():
    # GSPO-token must have the gradient of the sequence-level objective -A_i exp(mean_t log r_{i,t}) (unclipped)
    g = torch.Generator().manual_seed(0)
    logp = (torch.randn(3, 4, generator=g, dtype=F64) * 0.01).requires_grad_(True)
    old = torch.zeros(3, 4, dtype=F64)
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0], [1, 0, 1, 0]], dtype=torch.bool)
    adv = torch.tensor([1.0, -2.0, 0.5], dtype=F64)[:, None].expand(3, 4)
    norm = Normalizer.from_totals("seq_mean_token_mean", 8, 3, 4)
    loss, _ = policy_loss("ppo_clip", PolicyInputs(logp, old, adv, mask), norm,
                          PolicyLossOptions(ratio_level="sequence"))
    grad, = torch.autograd.grad(loss, logp)
    seq = (logp * mask).sum(-1) / mask.sum(-1)
    ref = (-adv[:, 0] * seq.exp()).mean()
    ref_grad, = torch.autograd.grad(ref, logp)
    assert torch.allclose(grad, ref_grad)


def test_ratio_against_reference_is_an_option():
    # logp = old = -1, ref = -1.5: against old r = 1 -> l = -A = -1; against ref r = e^0.5 = 1.6487 -> clipped -1.2
    logp = torch.full((1, 1), -1.0, dtype=F64)
    ref = torch.full((1, 1), -1.5, dtype=F64)
    mask = torch.ones(1, 1, dtype=torch.bool)
    one = torch.ones(1, 1, dtype=F64)
    loss_old, _ = policy_loss("ppo_clip", PolicyInputs(logp, logp.clone(), one, mask, ref_logp=ref), token_mean(mask),
                              PolicyLossOptions())
    loss_ref, _ = policy_loss("ppo_clip", PolicyInputs(logp, logp.clone(), one, mask, ref_logp=ref), token_mean(mask),
                              PolicyLossOptions(ratio_against="ref"))
    assert loss_old.item() == pytest.approx(-1.0) and loss_ref.item() == pytest.approx(-1.2)
    with pytest.raises(ValueError, match="ref_logp"):
        policy_loss("ppo_clip", PolicyInputs(logp, logp, one, mask), token_mean(mask),
                    PolicyLossOptions(ratio_against="ref"))


def test_plain_policy_gradient():
    # l = -A logp: logp [-1, -2], A [1, -0.5] -> [1, -1]; token mean 0; dl/dlogp = -A / 2 = [-0.5, 0.25]
    logp = torch.tensor([[-1.0, -2.0]], dtype=F64, requires_grad=True)
    mask = torch.ones(1, 2, dtype=torch.bool)
    loss, m = policy_loss("pg", PolicyInputs(logp, None, torch.tensor([[1.0, -0.5]], dtype=F64), mask),
                          token_mean(mask))
    assert loss.item() == pytest.approx(0.0)
    loss.backward()
    assert torch.allclose(logp.grad, torch.tensor([[-0.5, 0.25]], dtype=F64))
    assert m["policy/clipfrac"] == 0.0


def test_pg_and_ppo_agree_on_policy():
    # at ratio = 1 (first epoch) the clipped surrogate has the plain policy-gradient gradient
    g = torch.Generator().manual_seed(1)
    logp = torch.randn(2, 5, generator=g, dtype=F64).requires_grad_(True)
    adv = torch.randn(2, 5, generator=g, dtype=F64)
    mask = torch.rand(2, 5, generator=g) < 0.7
    norm = token_mean(mask)
    g_ppo, = torch.autograd.grad(policy_loss("ppo_clip", PolicyInputs(logp, logp.detach(), adv, mask), norm)[0], logp)
    g_pg, = torch.autograd.grad(policy_loss("pg", PolicyInputs(logp, logp.detach(), adv, mask), norm)[0], logp)
    assert torch.allclose(g_ppo, g_pg)


def test_policy_loss_registry():
    assert {"ppo_clip", "pg", "cispo"} <= set(POLICY_LOSSES)
    with pytest.raises(ValueError, match="valid: ppo_clip, pg, cispo, "):
        policy_loss("grpo", PolicyInputs(torch.zeros(1, 1), torch.zeros(1, 1), torch.zeros(1, 1), torch.ones(1, 1)),
                    token_mean(torch.ones(1, 1)))


def one_value(pred, old=10.0, ret=15.0, clip=1.0):
    v = torch.tensor([[pred]], dtype=F64, requires_grad=True)
    mask = torch.ones(1, 1, dtype=torch.bool)
    loss, m = value_loss(v, torch.tensor([[old]], dtype=F64), torch.tensor([[ret]], dtype=F64), mask,
                         token_mean(mask), clip)
    loss.backward()
    return loss.item(), v.grad.item(), m


def test_value_clip_worked_example():
    """Old value 10, return 15, clip 1 (allowed range [9, 11]).

    The 16 and 49 often quoted for this example are the squared errors max((V-R)^2, (V_clip-R)^2)
    *before* the 0.5 factor:
      prediction 12: max((12-15)^2 = 9, (11-15)^2 = 16) = 16 -> loss 0.5 * 16 = 8; the clipped term wins and
                     does not depend on V, so the gradient is 0 (the update is stopped)
      prediction  8: max((8-15)^2 = 49, (9-15)^2 = 36) = 49 -> loss 24.5; gradient 0.5 * 2 * (8 - 15) = -7
    """
    loss, grad, m = one_value(12.0)
    assert 2 * loss == pytest.approx(16.0) and loss == pytest.approx(8.0)
    assert grad == 0.0 and m["critic/clipfrac"] == 1.0
    loss, grad, m = one_value(8.0)
    assert 2 * loss == pytest.approx(49.0) and loss == pytest.approx(24.5)
    assert grad == pytest.approx(-7.0) and m["critic/clipfrac"] == 0.0
    # without clipping: 0.5 * 9 = 4.5, gradient 12 - 15 = -3
    loss, grad, _ = one_value(12.0, clip=None)
    assert loss == pytest.approx(4.5) and grad == pytest.approx(-3.0)


def test_value_clipfrac_counts_the_clamp_decision_not_a_rounding():
    """A prediction inside the clip range is not clipped, even where float32 rounds V_old + (V - V_old).

    V = -0.1, V_old = 0.2, c = 0.5, R = 0: |V - V_old| = 0.3 < 0.5, so clip() leaves V where it is and
    the loss is 0.5 * (V - R)^2 = 0.5 * 0.01 = 0.005, with gradient V - R = -0.1.
    In float32, V = -0.100000001490, V_old = 0.200000002980, V - V_old rounds to -0.300000011921 and
    V_old + (V - V_old) to -0.100000008941 != V; its squared error 0.0100000016 exceeds 0.0100000007,
    so comparing the two terms (or the clipped value with V) counted this token as clipped.
    """
    v = torch.tensor([[-0.1]], dtype=torch.float32, requires_grad=True)
    old = torch.tensor([[0.2]], dtype=torch.float32)
    assert (old + (v.detach() - old).clamp(-0.5, 0.5)).item() != v.item()  # the rounding this guards against
    mask = torch.ones(1, 1, dtype=torch.bool)
    loss, m = value_loss(v, old, torch.zeros(1, 1), mask, token_mean(mask), 0.5)
    loss.backward()
    assert m["critic/clipfrac"] == 0.0
    assert loss.item() == pytest.approx(0.005, rel=1e-5) and v.grad.item() == pytest.approx(-0.1, rel=1e-5)
    # Outside the range the clamp decides: V = 0.8, V_old = 0.2 -> clip(V) = 0.7; R = 0:
    # max((0.8)^2 = 0.64, (0.7)^2 = 0.49) = 0.64: the unclipped term wins, nothing is stopped (clipfrac 0);
    # R = 1: max((0.2)^2 = 0.04, (0.3)^2 = 0.09) = 0.09: the clipped term wins (clipfrac 1, gradient 0).
    for ret, clipped in ((0.0, 0.0), (1.0, 1.0)):
        _, m = value_loss(torch.tensor([[0.8]]), old, torch.tensor([[ret]]), mask, token_mean(mask), 0.5)
        assert m["critic/clipfrac"] == clipped


def test_value_loss_explained_variance():
    # R = [1, 2, 3, 4] (var 1.25), V = [1, 2, 3, 5]: residual [0, 0, 0, -1], var 0.1875 -> 1 - 0.15 = 0.85
    v = torch.tensor([[1.0, 2.0, 3.0, 5.0]], dtype=F64)
    r = torch.tensor([[1.0, 2.0, 3.0, 4.0]], dtype=F64)
    mask = torch.ones(1, 4, dtype=torch.bool)
    loss, m = value_loss(v, v, r, mask, token_mean(mask), 0.2)
    assert m["critic/explained_var"] == pytest.approx(0.85)
    assert m["critic/value_mean"] == pytest.approx(2.75)
    assert m["critic/loss"] == pytest.approx(0.5 * 1 / 4) == loss.item()
    _, m = value_loss(v, v, torch.ones(1, 4, dtype=F64), mask, token_mean(mask), None)
    assert m["critic/explained_var"] == 0.0  # Var(R) = 0: reported as 0, not NaN


def test_explained_variance_ignores_masked_tokens():
    # Valid tokens R = [1, 2, 3, 4], V = [1, 2, 3, 5] as above: 0.85. The masked fifth token
    # (R 100, V -100) would change both variances if it counted.
    v = torch.tensor([[1.0, 2.0, 3.0, 5.0, -100.0]], dtype=F64)
    r = torch.tensor([[1.0, 2.0, 3.0, 4.0, 100.0]], dtype=F64)
    mask = torch.tensor([[1, 1, 1, 1, 0]], dtype=torch.bool)
    assert explained_variance(v, r, mask) == pytest.approx(0.85)
    assert explained_variance(r, r, mask) == pytest.approx(1.0)  # a perfect critic
    assert explained_variance(torch.zeros_like(r), r, mask) == pytest.approx(0.0)  # V constant: Var(R - V) = Var(R)


def test_entropy_and_kl_loss_terms():
    # entropy bonus: -coef * mean H = -0.1 * (1 + 3)/2 = -0.2
    mask = torch.ones(1, 2, dtype=torch.bool)
    loss, m = entropy_loss(torch.tensor([[1.0, 3.0]]), mask, token_mean(mask), 0.1)
    assert loss.item() == pytest.approx(-0.2) and m["policy/entropy"] == pytest.approx(2.0)
    # KL loss, k3 with d = ln 2: e^-d + d - 1 = 0.5 + 0.693147 - 1 = 0.193147; coef 0.5, one token
    logp = torch.tensor([[math.log(0.5)]], dtype=F64, requires_grad=True)
    ref = torch.tensor([[math.log(0.25)]], dtype=F64)
    one = torch.ones(1, 1, dtype=torch.bool)
    loss, m = kl_loss(logp, ref, one, token_mean(one), 0.5, "k3")
    assert loss.item() == pytest.approx(0.5 * (0.5 + math.log(2) - 1))
    assert m["kl/ref"] == pytest.approx(0.5 + math.log(2) - 1)
    loss.backward()
    assert logp.grad.item() == pytest.approx(0.5 * (1 - 0.5))  # d k3 / d logp = 1 - e^-d


def test_cispo_by_hand():
    """CISPO (MiniMax 2025, arXiv:2506.13585): l = -sg(clip(r, 1 - 0.2, 1 + 0.28)) * A * logp, token mean.

    logp = [-1.0, -2.0], old = [-1.5, -1.0]: r = [e^0.5, e^-1] = [1.6487, 0.3679], clipped to [1.28, 0.8];
    A = [1, -1]: l = [-1.28 * 1 * -1.0, -0.8 * -1 * -2.0] = [1.28, -1.6]; mean = -0.16.
    d l / d logp = -w A / 2 tokens = [-0.64, +0.4]: both tokens keep a gradient, though both ratios are
    outside the clip range (PPO's clip would give both 0 here: A > 0 with r > 1.28, A < 0 with r < 0.8).
    """
    logp = torch.tensor([[-1.0, -2.0]], dtype=torch.float64, requires_grad=True)
    old = torch.tensor([[-1.5, -1.0]], dtype=torch.float64)
    adv = torch.tensor([[1.0, -1.0]], dtype=torch.float64)
    mask = torch.ones(1, 2)
    opts = PolicyLossOptions(clip_eps_low=0.2, clip_eps_high=0.28)
    loss, metrics = policy_loss("cispo", PolicyInputs(logp, old, adv, mask), token_mean(mask), opts)
    assert float(loss) == pytest.approx(-0.16)
    loss.backward()
    assert logp.grad[0].tolist() == pytest.approx([-0.64, 0.4])
    assert metrics["policy/clipfrac"] == 1.0 and metrics["policy/clipfrac_upper"] == 0.5
    ppo = torch.tensor([[-1.0, -2.0]], dtype=torch.float64, requires_grad=True)
    policy_loss("ppo_clip", PolicyInputs(ppo, old, adv, mask), token_mean(mask), opts)[0].backward()
    assert ppo.grad.tolist() == [[0.0, 0.0]]


def test_cispo_on_policy_is_the_policy_gradient():
    logp = torch.tensor([[-0.7, -1.3, -0.2]], dtype=torch.float64, requires_grad=True)
    adv = torch.tensor([[0.5, -2.0, 1.5]], dtype=torch.float64)
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    norm = token_mean(mask)
    cispo = policy_loss("cispo", PolicyInputs(logp, None, adv, mask), norm)[0]
    grad_cispo, = torch.autograd.grad(cispo, logp)
    pg = policy_loss("pg", PolicyInputs(logp, None, adv, mask), norm)[0]
    grad_pg, = torch.autograd.grad(pg, logp)
    assert torch.allclose(grad_cispo, grad_pg) and float(cispo) == pytest.approx(float(pg))
