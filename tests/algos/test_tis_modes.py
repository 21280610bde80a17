"""The four importance-sampling modes (TRL's vllm_importance_sampling_mode), derived by hand."""

import math

import pytest
import torch

from covey.algos import TIS_MODES, importance_weights

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
    with pytest.raises(ValueError, match="tis_mode"):
        importance_weights(LOG_R, SAMPLER, MASK, 2.0, "sequence")
    with pytest.raises(ValueError, match="cap"):
        importance_weights(LOG_R, SAMPLER, MASK, 0.5)
