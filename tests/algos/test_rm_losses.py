"""Reward-model losses (covey.algos.rm_losses) against values worked by hand."""

import pytest
import torch

from covey.algos.rm_losses import bt_loss, prm_loss


def test_bt_loss_by_hand():
    # -log sigmoid(2) = log(1 + e^-2) = 0.126928; -log sigmoid(0) = log 2 = 0.693147; mean 0.410038
    assert bt_loss(torch.tensor([2.0, 0.0]), torch.tensor([0.0, 0.0])).item() == pytest.approx(0.410038, abs=1e-6)
    # margin 1: -log sigmoid(1) = 0.313262, -log sigmoid(-1) = 1.313262; mean 0.813262
    assert bt_loss(torch.tensor([2.0, 0.0]), torch.tensor([0.0, 0.0]), 1.0).item() == pytest.approx(0.813262, abs=1e-6)
    # a huge gap stays finite (logsigmoid, not log(sigmoid))
    assert bt_loss(torch.tensor([-200.0]), torch.tensor([200.0])).item() == pytest.approx(400.0)


def test_prm_loss_by_hand_ignores_masked_steps():
    logits = torch.tensor([[0.0, 2.0], [-1.0, 99.0]])
    labels = torch.tensor([[1, 0], [0, 1]])
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    # BCE: label 1 at logit 0 -> log 2 = 0.693147; label 0 at 2 -> log(1+e^2) = 2.126928;
    # label 0 at -1 -> log(1+e^-1) = 0.313262; the 4th is masked. Mean of 3 = 1.044446
    assert prm_loss(logits, labels, mask).item() == pytest.approx(1.044446, abs=1e-6)
