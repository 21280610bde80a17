"""Adaptive entropy control (Skywork-OR1, arXiv:2505.22312), step by step by hand."""

import pytest

from covey.algos import AdaptiveEntropyController, FixedEntropyController


def test_adaptive_rule_by_hand():
    # target 0.2, delta 0.005, c_0 = 0, c_max = 0.012; alpha_k = c_k * 1[e_k <= 0.2]
    ctl = AdaptiveEntropyController(0.0, target=0.2, delta=0.005, max_coef=0.012)
    steps = [  # e_k -> (alpha_k, c_{k+1})
        (0.1, 0.0, 0.005),    # below: applied c_0 = 0, then c grows by delta
        (0.1, 0.005, 0.010),
        (0.1, 0.010, 0.012),  # 0.015 clipped to c_max
        (0.3, 0.0, 0.007),    # above target: no bonus this step, c shrinks
        (0.2, 0.007, 0.007),  # at the target: the bonus applies, c stays
        (0.5, 0.0, 0.002),
        (0.5, 0.0, 0.0),      # -0.003 clipped to 0
    ]
    for entropy, alpha, coef in steps:
        ctl.observe(entropy)
        assert (ctl.value, ctl.coef) == (pytest.approx(alpha), pytest.approx(coef)), entropy


def test_state_round_trip_resumes_exactly():
    a = AdaptiveEntropyController(0.01, target=0.2, delta=0.005, max_coef=1.0)
    for e in (0.1, 0.3, 0.1):
        a.observe(e)
    b = AdaptiveEntropyController(0.01, target=0.2, delta=0.005, max_coef=1.0)
    b.load_state_dict(a.state_dict())
    for e in (0.05, 0.4):
        a.observe(e)
        b.observe(e)
        assert (a.value, a.coef) == (b.value, b.coef)


def test_fixed_and_bad_settings():
    fixed = FixedEntropyController(0.01)
    fixed.observe(5.0)
    assert fixed.value == 0.01
    with pytest.raises(ValueError, match="adaptive entropy"):
        AdaptiveEntropyController(0.0, target=0.0, delta=0.005, max_coef=1.0)
