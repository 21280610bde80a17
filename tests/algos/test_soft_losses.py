"""SAPO, GMPO, LUSPO and VESPO on hand-derived numbers: two sequences, the second one token shorter
(a masked third token), every clip or gate branch hit; the expected loss and gradient worked in comments."""

import math

import pytest
import torch

from covey.algos import POLICY_LOSSES, Normalizer, PolicyInputs, PolicyLossOptions, policy_loss
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


def run(name, logp, old, adv, mode, opts=None, **weights):
    """Loss, d loss / d logp and metrics; `weights`: PolicyInputs' kept, is_weights, sample_logp."""
    loss, metrics = policy_loss(name, PolicyInputs(logp, old, adv, MASK, **weights), norm(mode),
                                opts or PolicyLossOptions())
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
    ppo_loss, _ = policy_loss("ppo_clip", PolicyInputs(logp, old, adv, MASK), norm("seq_mean_token_mean"))
    ppo, = torch.autograd.grad(ppo_loss, logp)
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


def test_gmpo_takes_its_geometric_mean_over_the_kept_tokens():
    """A selection (high-entropy tokens, Clip-Cov) restricts sequence i's geometric mean to its kept tokens S_i.

    Sequence 1, A = +1: d = [0.2, 0.6, -0.3], kept [1, 0, 1]: S_1 = {0, 2}, g_1 = exp((0.2 - 0.3) / 2) = e^-0.05
        (all three, token 1 cut to 0.4: exp((0.2 + 0.4 - 0.3) / 3) = e^0.1)
    Sequence 2, A = -1: d = [0.3, -0.7], none kept: S_2 empty, g_2 = exp(0 / 1) = 1, l_2 = +1, no gradient
        (both, token 2 cut to -0.4: exp((0.3 - 0.4) / 2) = e^-0.05)
    loss = (-e^-0.05 + 1) / 2 = 0.024385
    gradient -A_1 g_1 / |S_1| / 2 = -e^-0.05 / 4 = -0.237807 on tokens 0 and 2 of sequence 1; 0 elsewhere
    (the dropped token 1 gets none; without the selection tokens 0 and 2 had -e^0.1 / 6)
    """
    logp, old, adv = case([[0.2, 0.6, -0.3], [0.3, -0.7, 0.0]], [1.0, -1.0])
    kept = torch.tensor([[1, 0, 1], [0, 0, 0]], dtype=torch.bool)
    loss, grad, m = run("gmpo", logp, old, adv, "seq_mean_token_mean", kept=kept)
    g1 = math.exp(-0.05)
    assert loss == pytest.approx((-g1 + 1) / 2)
    assert grad.tolist() == [pytest.approx([-g1 / 4, 0.0, -g1 / 4]), pytest.approx([0.0, 0.0, 0.0])]
    assert m["policy/clipfrac"] == 0.0   # the cut token 1 was dropped: nothing kept was clipped
    # the gradient's factor g_1 T_1 / |S_1| = 1.5 g_1 on tokens 0 and 2, 0 on the other three: mean 0.6 g_1
    assert m["policy/grad_weight_mean"] == pytest.approx(0.6 * g1)
    plain, _, _ = run("gmpo", logp, old, adv, "seq_mean_token_mean")
    assert plain == pytest.approx((-math.exp(0.1) + math.exp(-0.05)) / 2)


def test_gmpo_reads_one_importance_weight_per_sequence():
    # sequence weights w = (0.5, 2) scale each sequence's term: on policy g_i = 1, l = (-0.5 * 1, -2 * -1) = (-0.5, 2),
    # loss 0.75; gradient -w_i A_i / T_i / 2: -0.5 / 3 / 2 = -1/12 and 2 / 2 / 2 = 0.5
    logp, old, adv = case([[0.0] * 3] * 2, [1.0, -1.0])
    weights = torch.tensor([[0.5] * 3, [2.0, 2.0, 7.0]], dtype=F64)   # 7.0 is padding
    loss, grad, _ = run("gmpo", logp, old, adv, "seq_mean_token_mean", is_weights=weights)
    assert loss == pytest.approx(0.75)
    assert grad.tolist() == [pytest.approx([-1 / 12] * 3), pytest.approx([0.5, 0.5, 0.0])]
    with pytest.raises(ValueError, match="one importance weight per sequence"):
        run("gmpo", logp, old, adv, "seq_mean_token_mean", is_weights=torch.tensor([[0.5, 1.0, 1.0], [2.0] * 3]))


def test_gmpo_is_defined_with_its_sequence_mean():
    logp, old, adv = case([[0.0] * 3] * 2, [1.0, -1.0])
    with pytest.raises(ValueError, match="gmpo is defined with aggregation seq_mean_token_mean"):
        policy_loss("gmpo", PolicyInputs(logp, old, adv, MASK), norm("token_mean"))


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
        policy_loss("luspo", PolicyInputs(logp, old, adv, MASK), norm("seq_mean_token_mean"))


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


def test_vespo_kernel_acts_on_the_weight_against_the_sampler_by_hand():
    """W = pi_theta / mu with mu the sampler: (pi_theta / pi_old) * prod_t (pi_old / mu)(y_t).

    The inputs of test_vespo_gamma_kernel_by_hand (pi_theta / pi_old = 2 and 1/2), and a sampler with
        sequence 1: log pi_old - log mu = [-ln2, 0, 0]  -> pi_old / mu = 1/2,  W_1 = 2 * 1/2 = 1:  phi_1 = 1
        sequence 2: log pi_old - log mu = [ln2, ln2]     -> pi_old / mu = 4,    W_2 = 1/2 * 4 = 2:  phi_2 = 8 e^-2
                    (A = -1: k 3, lambda 2: 2^3 e^(2 (1 - 2)) = 1.082682)
    loss = (3.5 phi_1 - 2 phi_2) / 5 = (3.5 - 2.165365) / 5 = 0.266927
    gradient -phi A / 5: -0.2 on sequence 1, 8 e^-2 / 5 = 0.216536 on sequence 2
    (The form with the kernel on pi_theta / pi_old = (2, 1/2) and the sampler ratio times each term outside it gave
    phi = (4 e^-3, e / 8) times [1/2, 1, 1] and [2, 2]: loss (0.199148 * 3 - 0.339785 * 4) / 5 = -0.152339.)

    With algo.tis.cap = 1.5 (token_truncate), the bounded ratios enter W instead: sequence 1's [1/2, 1, 1] are
    within it (W_1 = 1); sequence 2's [2, 2] become [1.5, 1.5]: W_2 = 1/2 * 2.25 = 1.125,
    phi_2 = 1.125^3 e^(2 (1 - 1.125)) = 1.423828 * e^-0.25 = 1.108878; loss (3.5 - 2 phi_2) / 5 = 0.256449.
    Without the sampler's log-probs mu = pi_old: test_vespo_gamma_kernel_by_hand's numbers.
    """
    logp, old, adv = case([[0.5, LN2 - 0.5, 0.0], [-LN2, 0.0, 0.0]], [1.0, -1.0],
                          logp=[[-1.0, -2.0, -0.5], [-1.5, -0.5, -3.0]])
    sampler = old - torch.tensor([[-LN2, 0.0, 0.0], [LN2, LN2, 0.0]], dtype=F64)
    phi2 = 8 * math.exp(-2)
    loss, grad, m = run("vespo", logp, old, adv, "token_mean", sample_logp=sampler)
    assert loss == pytest.approx((3.5 - 2 * phi2) / 5)
    assert grad.tolist() == [pytest.approx([-0.2] * 3), pytest.approx([phi2 / 5, phi2 / 5, 0.0])]
    assert m["policy/grad_weight_mean"] == pytest.approx((3 + 2 * phi2) / 5)
    bounded = torch.tensor([[0.5, 1.0, 1.0], [1.5, 1.5, 0.0]], dtype=F64)
    phi2 = 1.125 ** 3 * math.exp(2 * (1 - 1.125))
    loss, grad, _ = run("vespo", logp, old, adv, "token_mean", is_weights=bounded, sample_logp=sampler)
    assert loss == pytest.approx((3.5 - 2 * phi2) / 5) and phi2 == pytest.approx(1.108878, abs=1e-6)
    assert grad.tolist() == [pytest.approx([-0.2] * 3), pytest.approx([phi2 / 5, phi2 / 5, 0.0])]
    # token_mask drops a token (weight 0): the product W is 0 and the kernel gives its sequence nothing
    dropped = torch.tensor([[0.0, 1.0, 1.0], [1.5, 1.5, 0.0]], dtype=F64)
    _, grad, _ = run("vespo", logp, old, adv, "token_mean", is_weights=dropped)
    assert grad[0].abs().max() < 1e-12 and grad[1, 0] == pytest.approx(phi2 / 5)


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
    assert {name: entry.token_weights for name, entry in POLICY_LOSSES.items()
            if entry.token_weights != "scale_term"} == {"gmpo": "select_tokens", "vespo": "sampler_in_weight"}
    for name, bad in (("sapo.temperature_neg", {"sapo": SapoOptions(temperature_neg=0.0)}),
                      ("gmpo.log_clip_low", {"gmpo": GmpoOptions(log_clip_low=-0.1)}),
                      ("vespo.lambda_pos", {"vespo": VespoOptions(lambda_pos=0.0)})):
        with pytest.raises(ValueError, match=name):
            PolicyLossOptions(**bad).validate()
