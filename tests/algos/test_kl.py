"""KL estimators, straight-through variants, exact KL from logits, KL controllers."""

import math

import pytest
import torch

from covey.algos import KL_ESTIMATORS, AdaptiveKLController, FixedKLController, full_kl, kl_penalty

F64 = torch.float64
LN2 = math.log(2)


@pytest.mark.parametrize("kind,d,expected", [
    ("k1", LN2, LN2),
    ("k2", LN2, 0.5 * LN2 ** 2),              # 0.240227
    ("k3", LN2, 0.5 + LN2 - 1),               # r = pi_ref/pi = 1/2: r - 1 - log r = 0.193147
    ("k3", -LN2, 2 - LN2 - 1),                # r = 2: 2 - 1 - ln 2 = 0.306853
    ("abs", -LN2, LN2),
    ("k1_st", LN2, LN2),
    ("k3_st", LN2, 0.5 + LN2 - 1),
])
def test_kl_values_by_hand(kind, d, expected):
    logp = torch.tensor([d], dtype=F64)
    assert kl_penalty(logp, torch.zeros(1, dtype=F64), kind).item() == pytest.approx(expected)


def test_gradients_and_straight_through():
    # d = ln 2: grad k1 = 1, k2 = d = 0.693, k3 = 1 - e^-d = 0.5, abs = sign(d) = 1; *_st: gradient of k2
    expected = {"k1": 1.0, "k2": LN2, "k3": 0.5, "abs": 1.0, "k1_st": LN2, "k3_st": LN2}
    assert set(expected) == set(KL_ESTIMATORS)
    for kind, want in expected.items():
        logp = torch.tensor([LN2], dtype=F64, requires_grad=True)
        kl_penalty(logp, torch.zeros(1, dtype=F64), kind).sum().backward()
        assert logp.grad.item() == pytest.approx(want), kind


def test_k3_is_unbiased_for_kl_theta_ref_and_the_003_form_is_not():
    # exact expectation over a 4-token distribution: E_{y~pi}[k3(log pi(y) - log ref(y))] = KL(pi || ref)
    pi = torch.tensor([0.1, 0.2, 0.3, 0.4], dtype=F64)
    ref = torch.tensor([0.4, 0.3, 0.2, 0.1], dtype=F64)
    kl = (pi * (pi / ref).log()).sum()
    for kind in ("k1", "k3"):
        assert (pi * kl_penalty(pi.log(), ref.log(), kind)).sum().item() == pytest.approx(kl.item())
    # k3 written with r = pi/ref (an error that circulates): k = r - log r - 1,
    # whose expectation under pi is not KL(pi || ref)
    r = pi / ref
    assert (pi * (r - r.log() - 1)).sum().item() != pytest.approx(kl.item(), rel=0.05)
    assert (kl_penalty(torch.linspace(-5, 5, 101, dtype=F64), torch.zeros(101, dtype=F64), "k3") >= 0).all()


def test_log_ratio_clamp_keeps_values_finite():
    logp = torch.tensor([50.0, -50.0, 1000.0, -1000.0], requires_grad=True)
    for kind in KL_ESTIMATORS:
        k = kl_penalty(logp, torch.zeros(4), kind)
        assert torch.isfinite(k).all(), kind
        assert torch.autograd.grad(k.sum(), logp)[0].isfinite().all(), kind
    # clamp 20: k3 at d = -50 is e^20 - 20 - 1
    assert kl_penalty(torch.tensor([-50.0], dtype=F64), torch.zeros(1, dtype=F64), "k3").item() == \
        pytest.approx(math.exp(20) - 21)
    with pytest.raises(ValueError, match="valid: k1"):
        kl_penalty(logp, logp, "k4")


def test_full_kl_matches_direct_formula_and_gradients():
    g = torch.Generator().manual_seed(0)
    z = torch.randn(2, 3, 11, generator=g, dtype=F64, requires_grad=True)
    y = torch.randn(2, 3, 11, generator=g, dtype=F64, requires_grad=True)
    mask = torch.tensor([[1, 1, 0], [1, 0, 1]], dtype=torch.bool)
    got = full_kl(z, y, mask, chunk_size=2, temperature=0.7)
    lp, lq = torch.log_softmax(z / 0.7, -1), torch.log_softmax(y / 0.7, -1)
    ref = ((lp.exp() * (lp - lq)).sum(-1)) * mask
    assert torch.allclose(got, ref)
    w = torch.randn(2, 3, generator=g, dtype=F64)
    gz, gy = torch.autograd.grad((got * w).sum(), (z, y))
    rz, ry = torch.autograd.grad((ref * w).sum(), (z, y))
    assert torch.allclose(gz, rz) and torch.allclose(gy, ry)
    # KL of a distribution with itself is 0
    assert torch.allclose(full_kl(z, z), torch.zeros(2, 3, dtype=F64), atol=1e-12)
    assert torch.autograd.gradcheck(lambda a, b: full_kl(a, b, chunk_size=1), (z[:1, :2], y[:1, :2]))


def test_fixed_controller():
    c = FixedKLController(0.05)
    c.update(100.0, 1000)
    assert c.value == 0.05
    c2 = FixedKLController(0.0)
    c2.load_state_dict(c.state_dict())
    assert c2.value == 0.05


def test_adaptive_controller_by_hand():
    # target 6, horizon 10000, n = 256:
    #   KL 12: error clip(12/6 - 1 = 1, -0.2, 0.2) = 0.2 -> beta *= 1 + 0.2 * 256/10000 = 1.00512
    #   KL 6: error 0 -> unchanged;   KL 0: error -1 -> -0.2 -> beta *= 0.99488
    #   KL 6.6: error 0.1 (inside the clip) -> beta *= 1.00256
    c = AdaptiveKLController(0.1, target=6.0, horizon=10000)
    c.update(12.0, 256)
    assert c.value == pytest.approx(0.1 * 1.00512)
    c.update(6.0, 256)
    assert c.value == pytest.approx(0.1 * 1.00512)
    c.update(0.0, 256)
    assert c.value == pytest.approx(0.1 * 1.00512 * 0.99488)
    d = AdaptiveKLController(0.1, 6.0, 10000)
    d.update(6.6, 256)
    assert d.value == pytest.approx(0.1 * 1.00256)
    e = AdaptiveKLController(1.0, 1.0, 1.0)
    e.load_state_dict(c.state_dict())
    assert (e.value, e.target, e.horizon) == (c.value, 6.0, 10000.0)
    with pytest.raises(ValueError):
        AdaptiveKLController(0.1, target=0.0, horizon=10)


def test_full_kl_by_hand():
    # p = softmax([0, ln 3]) = [1/4, 3/4], q = softmax([0, 0]) = [1/2, 1/2]
    # KL = 0.25 ln(0.5) + 0.75 ln(1.5) = -0.173287 + 0.304099 = 0.130812
    z = torch.tensor([[[0.0, math.log(3)]]], dtype=F64)
    assert full_kl(z, torch.zeros_like(z)).item() == pytest.approx(0.25 * math.log(0.5) + 0.75 * math.log(1.5))


def expected_gradient(kind, theta, ref_logp):
    """Exact E_{y ~ pi_theta}[grad_theta k(log pi_theta(y) - log pi_ref(y))] by enumerating y (pi weights detached)."""
    logp = torch.log_softmax(theta, -1)
    k = kl_penalty(logp, ref_logp, kind)
    return torch.autograd.grad((logp.exp().detach() * k).sum(), theta)[0]


def test_kl_loss_gradients_in_expectation():
    # documented in docs/algorithms.md: as a loss on samples of pi_theta,
    #   k2 (and the *_st variants) give grad KL(pi_theta || pi_ref),
    #   k1 gives 0 in expectation, k3 gives grad KL(pi_ref || pi_theta)
    theta = torch.tensor([0.3, -1.0, 0.8, 0.1], dtype=F64, requires_grad=True)
    ref_logp = torch.log_softmax(torch.tensor([1.0, 0.2, -0.5, 0.0], dtype=F64), -1)
    logp = torch.log_softmax(theta, -1)
    reverse = torch.autograd.grad((logp.exp() * (logp - ref_logp)).sum(), theta, retain_graph=True)[0]
    forward = torch.autograd.grad((ref_logp.exp() * (ref_logp - logp)).sum(), theta)[0]
    for kind in ("k2", "k1_st", "k3_st"):
        assert torch.allclose(expected_gradient(kind, theta, ref_logp), reverse), kind
    assert torch.allclose(expected_gradient("k1", theta, ref_logp), torch.zeros(4, dtype=F64), atol=1e-12)
    assert torch.allclose(expected_gradient("k3", theta, ref_logp), forward)
    assert not torch.allclose(forward, reverse, atol=1e-3)
