"""SAPO, GMPO, LUSPO and VESPO on hand-derived numbers: two sequences, the second one token shorter
(a masked third token), every clip or gate branch hit; the expected loss and gradient worked in comments."""

import math

import pytest
import torch

from covey.algos import POLICY_LOSSES, Normalizer, PolicyLossOptions, policy_loss
from covey.config.schema_algo import GmpoOptions, SapoOptions, VespoOptions

F64 = torch.float64
MASK = torch.tensor([[1, 1, 1], [1, 1, 0]], dtype=torch.bool)  # T_1 = 3, T_2 = 2: 5 valid tokens
LN2 = math.log(2.0)


def norm(mode):
    return Normalizer.from_totals(mode, 5, 2, 3)


def case(log_ratios, adv_per_seq, logp=None):
    """(logp leaf, old, advantages) with logp - old = log_ratios on every token."""
    d = torch.tensor(log_ratios, dtype=F64)
    logp = torch.tensor(logp, dtype=F64) if logp is not None else torch.full((2, 3), -1.0, dtype=F64)
    old = logp - d
    adv = torch.tensor(adv_per_seq, dtype=F64)[:, None].expand(2, 3)
    return logp.clone().requires_grad_(True), old, adv


def run(name, logp, old, adv, mode, opts=None):
    loss, metrics = policy_loss(name, logp, old, adv, MASK, norm(mode), opts or PolicyLossOptions())
    grad, = torch.autograd.grad(loss, logp)
    return loss.item(), grad, metrics


def test_sapo_soft_gate_by_hand():
    """f(r) = 4/tau sigmoid(tau (r - 1)), l = -f(r) A, seq_mean_token_mean; tau = 1 (A > 0), 1.05 (A <= 0).

    Ratios chosen so that sigmoid is 1/2 or 2/3 or 1/3: tau (r - 1) = 0 or +-ln 2.
    Sequence 1, A = +1, tau = 1:   r = [1, 1 + ln2, 1 - ln2]: f = 4 * [1/2, 2/3, 1/3] = [2, 8/3, 4/3]
        l = -f = [-2, -8/3, -4/3], row mean -6/3 = -2
    Sequence 2, A = -2, tau = 1.05: r = [1, 1 + ln2 / 1.05]: f = [2, 8/3] / 1.05
        l = 2 f = [4, 16/3] / 1.05, row mean (28/3) / 2.1 = 40/9
    loss = (-2 + 40/9) / 2 = 11/9

    Gradient: df/dr = 4 s (1 - s) (tau cancels), dr/dlogp = r, so dl/dlogp = -A * 4 s (1 - s) * r,
    then / (num_seqs 2 * T_i):  4 s (1 - s) = 1 at s = 1/2, 8/9 at s = 2/3 or 1/3.
        seq 1: -1 * [1 * 1, 8/9 * (1 + ln2), 8/9 * (1 - ln2)] / 6
        seq 2: +2 * [1 * 1, 8/9 * (1 + ln2 / 1.05)] / 4
    Token 2 of seq 1 (r = 1.69, A > 0) keeps a gradient where ppo_clip's clip at 1.2 gives 0.
    """
    r = [[1.0, 1 + LN2, 1 - LN2], [1.0, 1 + LN2 / 1.05, 1.0]]
    logp, old, adv = case([[math.log(x) for x in row] for row in r], [1.0, -2.0])
    loss, grad, m = run("sapo", logp, old, adv, "seq_mean_token_mean")
    assert loss == pytest.approx(11 / 9)
    w = 8 / 9
    expected = [[-1 / 6, -w * (1 + LN2) / 6, -w * (1 - LN2) / 6], [2 / 4, 2 * w * (1 + LN2 / 1.05) / 4, 0.0]]
    assert grad.tolist() == [pytest.approx(row) for row in expected]
    # the gradient's factor 4 s (1 - s) r per valid token, averaged: (1 + w(1+ln2) + w(1-ln2) + 1 + w(1+ln2/1.05))/5
    assert m["policy/grad_weight_mean"] == pytest.approx((2 + 2 * w + w * (1 + LN2 / 1.05)) / 5)
    assert m["policy/clipfrac"] == 0.0
    ppo, = torch.autograd.grad(policy_loss("ppo_clip", logp, old, adv, MASK, norm("seq_mean_token_mean"))[0], logp)
    assert ppo[0, 1] == 0.0


def test_sapo_on_policy_is_the_policy_gradient():
    # r = 1: s = 1/2, df/dr = 1, so every token's gradient is -A / (num_seqs T_i): pg's
    logp, old, adv = case([[0.0] * 3] * 2, [0.5, -1.5])
    _, grad, _ = run("sapo", logp, old, adv, "seq_mean_token_mean")
    _, grad_pg, _ = run("pg", logp, old, adv, "seq_mean_token_mean")
    assert torch.allclose(grad, grad_pg)


def test_gmpo_geometric_mean_clipped_in_log_space_by_hand():
    """GMPO, log-space clip 0.4 both sides, one-sided by the sign of A; l_i = -A_i exp(mean_t d'_t).

    Sequence 1, A = +1: d = [0.2, 0.6, -0.5] -> the top cut at 0.4: d' = [0.2, 0.4, -0.5] (token 2 clipped;
        the -0.5 stays: for A > 0 only a rising ratio is cut), mean 0.1 / 3, g_1 = e^(1/30) = 1.033895
    Sequence 2, A = -1: d = [0.3, -0.7] -> the bottom cut at -0.4: d' = [0.3, -0.4] (token 2 clipped),
        mean -0.05, g_2 = e^-0.05 = 0.951229
    loss = mean_i l_i = (-g_1 + g_2) / 2 = -0.041333
    dl/dlogp_t = -A_i g_i / T_i on unclipped tokens, 0 on clipped ones, / num_seqs 2:
        seq 1: [-g_1 / 6, 0, -g_1 / 6];  seq 2: [g_2 / 4, 0]
    """
    logp, old, adv = case([[0.2, 0.6, -0.5], [0.3, -0.7, 0.0]], [1.0, -1.0])
    loss, grad, m = run("gmpo", logp, old, adv, "seq_mean_token_mean")
    g1, g2 = math.exp(0.1 / 3), math.exp(-0.05)
    assert loss == pytest.approx((-g1 + g2) / 2)
    assert grad.tolist() == [pytest.approx([-g1 / 6, 0.0, -g1 / 6]), pytest.approx([g2 / 4, 0.0, 0.0])]
    assert m["policy/clipfrac_upper"] == pytest.approx(0.2) and m["policy/clipfrac_lower"] == pytest.approx(0.2)
    assert m["policy/grad_weight_mean"] == pytest.approx((2 * g1 + g2) / 5)
    # a wider log clip (1.0) lets token 2 of each through: g_1 = e^(0.3/3), g_2 = e^(-0.4/2)
    loss, _, m = run("gmpo", logp, old, adv, "seq_mean_token_mean",
                     PolicyLossOptions(gmpo=GmpoOptions(log_clip_low=1.0, log_clip_high=1.0)))
    assert loss == pytest.approx((-math.exp(0.1) + math.exp(-0.2)) / 2) and m["policy/clipfrac"] == 0.0


def test_gmpo_is_defined_with_its_sequence_mean():
    logp, old, adv = case([[0.0] * 3] * 2, [1.0, -1.0])
    with pytest.raises(ValueError, match="gmpo is defined with aggregation seq_mean_token_mean"):
        policy_loss("gmpo", logp, old, adv, MASK, norm("token_mean"))


def test_luspo_weights_gspo_by_length_by_hand():
    """LUSPO: GSPO's clipped sequence ratio s_i = exp(mean_t d_t), each sequence's term times T_i.

    Sequence 1, A = +1, d = [0.1, 0.2, 0.0]: s_1 = e^0.1 = 1.105171 < 1.2, unclipped: l = -s_1 per token,
        summed over its 3 tokens: -3 s_1
    Sequence 2, A = -1, d = [-0.3, -0.3]: s_2 = e^-0.3 = 0.740818 < 0.8: max(s_2, 0.8) = 0.8 (clipped),
        summed over 2 tokens: 1.6
    loss = (-3 s_1 + 1.6) / 2 = -0.857756   (GSPO, seq_mean_token_mean: (-s_1 + 0.8) / 2 = -0.152585)
    dl/dlogp_t = -A s_1 / 2 = -0.552585 on sequence 1 (each token carries d s_1 / d logp_t = s_1 / 3,
    times 3 tokens); 0 on the clipped sequence 2.
    """
    logp, old, adv = case([[0.1, 0.2, 0.0], [-0.3, -0.3, 0.0]], [1.0, -1.0])
    s1 = math.exp(0.1)
    loss, grad, m = run("luspo", logp, old, adv, "seq_mean_token_sum")
    assert loss == pytest.approx((-3 * s1 + 1.6) / 2)
    assert grad.tolist() == [pytest.approx([-s1 / 2] * 3), pytest.approx([0.0] * 3)]
    assert m["policy/clipfrac_lower"] == pytest.approx(2 / 5)
    gspo, _, _ = run("ppo_clip", logp, old, adv, "seq_mean_token_mean", PolicyLossOptions(ratio_level="sequence"))
    assert gspo == pytest.approx((-s1 + 0.8) / 2)
    with pytest.raises(ValueError, match="luspo is defined with aggregation seq_mean_token_sum"):
        policy_loss("luspo", logp, old, adv, MASK, norm("seq_mean_token_mean"))


def test_vespo_gamma_kernel_by_hand():
    """VESPO: phi(w) = w^k e^(lambda (1 - w)) of the sequence weight w = exp(sum_t d_t), detached;
    l_t = -phi A_t logp_t; token_mean over the 5 valid tokens.

    Sequence 1, A = +1 (k 2, lambda 3): d = [0.5, ln2 - 0.5, 0] -> w = 2, phi_1 = 4 e^-3 = 0.199148
        logp = [-1, -2, -0.5]: l = phi_1 * [1, 2, 0.5], sum 3.5 phi_1
    Sequence 2, A = -1 (k 3, lambda 2): d = [-ln2, 0] -> w = 1/2, phi_2 = e / 8 = 0.339785
        logp = [-1.5, -0.5]: l = phi_2 * logp = phi_2 * [-1.5, -0.5], sum -2 phi_2
    loss = (3.5 phi_1 - 2 phi_2) / 5 = 0.0032898
    dl/dlogp_t = -phi A / 5: seq 1: -phi_1 / 5 = -0.039830;  seq 2: +phi_2 / 5 = 0.067957
    """
    logp, old, adv = case([[0.5, LN2 - 0.5, 0.0], [-LN2, 0.0, 0.0]], [1.0, -1.0],
                          logp=[[-1.0, -2.0, -0.5], [-1.5, -0.5, -3.0]])
    phi1, phi2 = 4 * math.exp(-3), math.e / 8
    loss, grad, m = run("vespo", logp, old, adv, "token_mean")
    assert loss == pytest.approx((3.5 * phi1 - 2 * phi2) / 5)
    assert grad.tolist() == [pytest.approx([-phi1 / 5] * 3), pytest.approx([phi2 / 5, phi2 / 5, 0.0])]
    assert m["policy/grad_weight_mean"] == pytest.approx((3 * phi1 + 2 * phi2) / 5)
    # swap the signs: A = -1 on w = 2 (k 3, lambda 2): 8 e^-2; A = +1 on w = 1/2 (k 2, lambda 3): e^1.5 / 4
    _, _, m = run("vespo", logp, old, -adv, "token_mean")
    assert m["policy/grad_weight_mean"] == pytest.approx((3 * 8 * math.exp(-2) + 2 * math.exp(1.5) / 4) / 5)


def test_vespo_weight_stays_finite_far_off_policy():
    # sum of log-ratios -30 -> clamped to log 1e-8: phi = 1e-16 e^(3 (1 - 1e-8)) = 2.0e-15;
    # +30 -> clamped to 20: w = e^20 = 4.85e8, phi = e^(40 + 3 (1 - w)) underflows to 0
    logp, old, adv = case([[-10.0, -10.0, -10.0], [15.0, 15.0, 0.0]], [1.0, 1.0])
    loss, grad, m = run("vespo", logp, old, adv, "token_mean")
    assert math.isfinite(loss) and torch.isfinite(grad).all()
    assert m["policy/grad_weight_mean"] == pytest.approx(3 * 1e-16 * math.exp(3) / 5, rel=1e-6)


def test_vespo_on_policy_is_the_policy_gradient():
    logp, old, adv = case([[0.0] * 3] * 2, [0.5, -1.5])
    loss, grad, _ = run("vespo", logp, old, adv, "token_mean")
    loss_pg, grad_pg, _ = run("pg", logp, old, adv, "token_mean")
    assert loss == pytest.approx(loss_pg) and torch.allclose(grad, grad_pg)


def test_registry_traits():
    assert set(POLICY_LOSSES) == {"ppo_clip", "pg", "cispo", "sapo", "gmpo", "luspo", "vespo"}
    assert POLICY_LOSSES["luspo"].ratio_level == "sequence"
    assert POLICY_LOSSES["luspo"].aggregation == "seq_mean_token_sum"
    assert POLICY_LOSSES["gmpo"].sequence_advantage and "ratio_level" not in POLICY_LOSSES["vespo"].options
    for name, bad in (("sapo.temperature_neg", {"sapo": SapoOptions(temperature_neg=0.0)}),
                      ("gmpo.log_clip_low", {"gmpo": GmpoOptions(log_clip_low=-0.1)}),
                      ("vespo.lambda_pos", {"vespo": VespoOptions(lambda_pos=0.0)})):
        with pytest.raises(ValueError, match=name):
            PolicyLossOptions(**bad).validate()
