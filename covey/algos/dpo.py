"""DPO (Rafailov et al. 2023) on best-vs-worst pairs: the loss as a pure function.

Its iterative form (sample n answers per prompt, keep the best and the worst by reward,
train DPO, repeat; Xiong et al. 2024, arXiv:2312.11456) is a cheaper alternative to PPO.

    l_i = -log sigmoid(beta * ((logp_c - ref_c) - (logp_r - ref_r)))

with logp_c = sum_t log pi_theta(y_c,t | x) the summed log-probability of the chosen
response (ref_* the same under the frozen reference). The loss of an optimizer step is
sum_i l_i / num_pairs, where num_pairs counts the pairs of the *whole* step, so
micro-batch losses add up to the step loss (the DESIGN's global-estimator rule).
"""

from __future__ import annotations

import torch
from torch import Tensor


def sequence_logprob(token_logp: Tensor, response_mask: Tensor) -> Tensor:
    """Summed log-probability of each response, (n, L) -> (n,); masked tokens count 0."""
    return (token_logp * response_mask.to(token_logp.dtype)).sum(-1)


def dpo_loss(policy_chosen: Tensor, policy_rejected: Tensor, ref_chosen: Tensor, ref_rejected: Tensor,
             beta: float, num_pairs: float | None = None) -> tuple[Tensor, dict]:
    """DPO sigmoid loss of P pairs of sequence log-probs (each (P,)); returns (loss, metrics).

    num_pairs: the denominator (pairs of the whole optimizer step); default P.
    Metrics (means over the P pairs): implicit rewards beta*(logp - ref) of chosen and
    rejected, their margin, and the fraction of pairs the policy already ranks right.
    """
    if beta <= 0:
        raise ValueError(f"dpo_loss: beta must be > 0, got {beta}")
    chosen_reward = beta * (policy_chosen - ref_chosen.detach())
    rejected_reward = beta * (policy_rejected - ref_rejected.detach())
    margin = chosen_reward - rejected_reward
    # -log sigmoid(m) == softplus(-m), which stays finite for large |m|
    per_pair = torch.nn.functional.softplus(-margin)
    denom = float(num_pairs) if num_pairs is not None else max(len(per_pair), 1)
    loss = per_pair.sum() / denom
    with torch.no_grad():
        metrics = {
            "dpo/loss": float(per_pair.mean()) if len(per_pair) else 0.0,
            "dpo/reward_chosen": float(chosen_reward.mean()) if len(per_pair) else 0.0,
            "dpo/reward_rejected": float(rejected_reward.mean()) if len(per_pair) else 0.0,
            "dpo/margin": float(margin.mean()) if len(per_pair) else 0.0,
            "dpo/pair_accuracy": float((margin > 0).double().mean()) if len(per_pair) else 0.0,
        }
    return loss, metrics


def best_worst_pairs(scores: Tensor, group_ids: Tensor) -> tuple[Tensor, Tensor]:
    """Indices (chosen, rejected), one pair per group whose scores are not all equal.

    chosen = the highest score of the group, rejected = the lowest (first index on ties).
    Groups where every sample scored the same carry no preference and give no pair.
    """
    chosen, rejected = [], []
    for g in group_ids.unique().tolist():
        members = (group_ids == g).nonzero().squeeze(1)
        group_scores = scores[members]
        if bool((group_scores.max() - group_scores.min()) > 0):
            chosen.append(int(members[int(group_scores.argmax())]))
            rejected.append(int(members[int(group_scores.argmin())]))
    return torch.tensor(chosen, dtype=torch.long), torch.tensor(rejected, dtype=torch.long)
