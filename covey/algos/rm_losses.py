"""Reward-model losses: Bradley-Terry on preference pairs, binary cross-entropy on labelled steps.

    bt:  -log sigmoid(r_chosen - r_rejected - margin)      mean over pairs
    prm: BCE(logit at each step's last token, label)        mean over real steps

Bradley-Terry: Bradley & Terry 1952 (Biometrika 39, 324-345), the reward-model loss of
Ouyang et al. 2022 (arXiv:2203.02155). Process reward model: one 0/1 label per step,
Lightman et al. 2023 (arXiv:2305.20050).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def bt_loss(r_chosen: torch.Tensor, r_rejected: torch.Tensor, margin: float = 0.0) -> torch.Tensor:
    """Bradley-Terry: mean of -log sigmoid(r_c - r_r - m) (logsigmoid is stable for large gaps)."""
    return -F.logsigmoid(r_chosen - r_rejected - margin).mean()


def prm_loss(logits: torch.Tensor, labels: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Binary cross-entropy over the real steps only (mean)."""
    per_step = F.binary_cross_entropy_with_logits(logits, labels.float(), reduction="none")
    return (per_step * mask).sum() / mask.sum().clamp(min=1)
