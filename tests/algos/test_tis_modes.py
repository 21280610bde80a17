"""The four importance-sampling modes (TRL's vllm_importance_sampling_mode), with and without a lower bound
(vllm_importance_sampling_clip_min), derived by hand; algo.tis.min's checks and its line in print_plan."""

import math

import pytest
import torch

from covey.algos import TIS_MODES, importance_weights
from covey.config import ConfigError
from covey.config.load import load_config
from covey.training.plan import make_plan, print_plan

# log r_t = log pi_train - log mu per token, cap C = 2:
#   row 0: r = [2, 0.5, (masked: e^5)]   sequence ratio R = 2 * 0.5 = 1 (the masked token never counts)
#   row 1: r = [3, 1.5, (masked)]        R = 3 * 1.5 = 4.5
LOG_R = torch.tensor([[math.log(2), math.log(0.5), 5.0], [math.log(3), math.log(1.5), 5.0]], dtype=torch.float64)
MASK = torch.tensor([[1, 1, 0], [1, 1, 0]], dtype=torch.bool)
SAMPLER = torch.full_like(LOG_R, -1.0)
EXPECTED = {  # weights, share of valid tokens beyond the cap, largest ratio before the cap
    "token_truncate": ([[2, 0.5, 0], [2, 1.5, 0]], 1 / 4, 3.0),       # min(r, 2); r = 2 is not beyond
    "token_mask": ([[2, 0.5, 0], [0, 1.5, 0]], 1 / 4, 3.0),           # r = 3 > 2 -> 0
    "sequence_truncate": ([[1, 1, 0], [2, 2, 0]], 2 / 4, 4.5),        # min(R, 2) on every token
    "sequence_mask": ([[1, 1, 0], [0, 0, 0]], 2 / 4, 4.5),            # R = 4.5 > 2: the row is out
}


@pytest.mark.parametrize("mode", TIS_MODES)
def test_modes_by_hand(mode):
    weights, metrics = importance_weights(SAMPLER + LOG_R, SAMPLER, MASK, cap=2.0, mode=mode)
    expected, beyond, ratio_max = EXPECTED[mode]
    assert torch.allclose(weights, torch.tensor(expected, dtype=torch.float64), atol=1e-12)
    assert metrics["tis/capped_frac"] == pytest.approx(beyond)
    assert metrics["tis/ratio_max"] == pytest.approx(ratio_max)
    assert metrics["tis/weight_mean"] == pytest.approx(float(weights.sum()) / 4)
    # the token-level k3 of the mismatch, whatever the mode: r - 1 - ln r over the 4 valid tokens
    k3 = sum(r - 1 - math.log(r) for r in (2, 0.5, 3, 1.5)) / 4
    assert metrics["tis/mismatch_kl"] == pytest.approx(k3)


def test_bad_mode_and_cap():
    with pytest.raises(ValueError, match="tis mode"):
        importance_weights(LOG_R, SAMPLER, MASK, 2.0, "sequence")
    with pytest.raises(ValueError, match="cap"):
        importance_weights(LOG_R, SAMPLER, MASK, 0.5)


# With a lower bound c = 0.4 (TRL's vllm_importance_sampling_clip_min), cap C = 2, a third row added:
#   row 0: r = [2, 0.5]     R = 1
#   row 1: r = [3, 1.5]     R = 4.5
#   row 2: r = [0.25, 1]    R = 0.25
# each row's third token is masked (log r = 5 there, never counted); 6 valid tokens.
LOG_R_MIN = torch.tensor([[math.log(2), math.log(0.5), 5.0], [math.log(3), math.log(1.5), 5.0],
                          [math.log(0.25), 0.0, 5.0]], dtype=torch.float64)
MASK_MIN = torch.tensor([[1, 1, 0]] * 3, dtype=torch.bool)
EXPECTED_MIN = {  # weights, share of valid tokens beyond C, share below c, largest ratio
    # clamp(r, 0.4, 2): 3 -> 2, 0.25 -> 0.4; sum 2 + 0.5 + 2 + 1.5 + 0.4 + 1 = 7.4
    "token_truncate": ([[2, 0.5, 0], [2, 1.5, 0], [0.4, 1, 0]], 1 / 6, 1 / 6, 3.0),
    # r = 3 > 2 and r = 0.25 < 0.4 -> 0; sum 2 + 0.5 + 1.5 + 1 = 5
    "token_mask": ([[2, 0.5, 0], [0, 1.5, 0], [0, 1, 0]], 1 / 6, 1 / 6, 3.0),
    # clamp(R, 0.4, 2) on every token: 1, 4.5 -> 2, 0.25 -> 0.4; sum 2 + 4 + 0.8 = 6.8
    "sequence_truncate": ([[1, 1, 0], [2, 2, 0], [0.4, 0.4, 0]], 2 / 6, 2 / 6, 4.5),
    # R = 4.5 > 2 and R = 0.25 < 0.4: both rows out; sum 2
    "sequence_mask": ([[1, 1, 0], [0, 0, 0], [0, 0, 0]], 2 / 6, 2 / 6, 4.5),
}
WEIGHT_SUM_MIN = {"token_truncate": 7.4, "token_mask": 5.0, "sequence_truncate": 6.8, "sequence_mask": 2.0}


@pytest.mark.parametrize("mode", TIS_MODES)
def test_modes_with_a_lower_bound_by_hand(mode):
    sampler = torch.full_like(LOG_R_MIN, -1.0)
    weights, metrics = importance_weights(sampler + LOG_R_MIN, sampler, MASK_MIN, cap=2.0, mode=mode, floor=0.4)
    expected, beyond, below, ratio_max = EXPECTED_MIN[mode]
    assert torch.allclose(weights, torch.tensor(expected, dtype=torch.float64), atol=1e-12)
    assert metrics["tis/capped_frac"] == pytest.approx(beyond)
    assert metrics["tis/below_min_frac"] == pytest.approx(below)
    assert metrics["tis/ratio_max"] == pytest.approx(ratio_max)
    assert metrics["tis/weight_mean"] == pytest.approx(WEIGHT_SUM_MIN[mode] / 6)
    k3 = sum(r - 1 - math.log(r) for r in (2, 0.5, 3, 1.5, 0.25, 1)) / 6  # the bound never changes it
    assert metrics["tis/mismatch_kl"] == pytest.approx(k3)


@pytest.mark.parametrize("mode", TIS_MODES)
def test_a_zero_lower_bound_is_none(mode):
    # every ratio is > 0, so clamping at 0 or masking ratios < 0 changes nothing; the metric is left out
    sampler = torch.full_like(LOG_R_MIN, -1.0)
    plain, plain_metrics = importance_weights(sampler + LOG_R_MIN, sampler, MASK_MIN, 2.0, mode)
    zero, zero_metrics = importance_weights(sampler + LOG_R_MIN, sampler, MASK_MIN, 2.0, mode, floor=0.0)
    assert torch.equal(plain, zero) and plain_metrics == zero_metrics
    assert "tis/below_min_frac" not in zero_metrics


@pytest.mark.parametrize("floor", [-0.1, 2.0, 3.0])
def test_bad_lower_bound(floor):
    with pytest.raises(ValueError, match="floor"):
        importance_weights(LOG_R, SAMPLER, MASK, 2.0, "token_mask", floor=floor)


@pytest.mark.parametrize("overrides,message", [
    (["algo.tis.min=0.5"], "algo.tis.min=0.5 is a lower bound of importance sampling: set algo.tis.cap > 0"),
    (["algo.tis.cap=2", "algo.tis.min=2"], r"algo.tis.min must lie in \[0, algo.tis.cap=2\), got 2.0"),
    (["algo.tis.cap=2", "algo.tis.min=-0.1"], r"algo.tis.min must lie in \[0, algo.tis.cap=2\), got -0.1"),
])
def test_tis_min_config_errors(overrides, message):
    with pytest.raises(ConfigError, match=f"^{message}$"):
        load_config(None, overrides)


def test_the_plan_carries_and_prints_the_lower_bound(capsys):
    plan = make_plan(load_config(None, ["algo.tis.cap=2", "algo.tis.min=0.5", "algo.tis.mode=sequence_mask"]))
    assert (plan.tokens.tis.cap, plan.tokens.tis.mode, plan.tokens.tis.min) == (2.0, "sequence_mask", 0.5)
    print_plan(plan)
    assert "importance sampling sequence_mask cap 2 min 0.5" in capsys.readouterr().out
    print_plan(make_plan(load_config(None, ["algo.tis.cap=2"])))
    assert "covey: importance sampling token_truncate cap 2\n" in capsys.readouterr().out  # no bound, no "min"


def test_the_loop_passes_the_lower_bound_on():
    """correct_sampler_mismatch (the loop's step) sets the rollout's importance weights with algo.tis.min's bound,
    the advantages untouched: token_mask, C = 2, c = 0.4 on the rows above -> the weights of
    EXPECTED_MIN["token_mask"]."""
    from types import SimpleNamespace

    from covey.training.token_weights import correct_sampler_mismatch
    plan = make_plan(load_config(None, ["algo.tis.cap=2", "algo.tis.min=0.4", "algo.tis.mode=token_mask"]))
    sampler = torch.full_like(LOG_R_MIN, -1.0)
    rollout = SimpleNamespace(old_logp=sampler + LOG_R_MIN, sample_logp=sampler, response_mask=MASK_MIN,
                              advantages=torch.ones_like(LOG_R_MIN), is_weights=None)
    metrics = correct_sampler_mismatch(SimpleNamespace(plan=plan), rollout)
    expected = torch.tensor(EXPECTED_MIN["token_mask"][0], dtype=torch.float64)
    assert torch.allclose(rollout.is_weights, expected, atol=1e-12)
    assert torch.equal(rollout.advantages, torch.ones_like(LOG_R_MIN))
    assert metrics["tis/below_min_frac"] == pytest.approx(1 / 6)
