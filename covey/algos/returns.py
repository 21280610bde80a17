"""Token-level estimators: REINFORCE++ (Hu 2025, arXiv:2501.03262) and GAE (Schulman et al. 2016, arXiv:1506.02438).

Both build per-token rewards from the outcome score and the KL-in-reward term,

    r_t = -kl_coef * KL_t              on every valid response token t,
    r_T += score                       on the last valid response token T,

then run one backward recursion over the L response positions (a loop over
time, vectorised over the N sequences). Masked positions inside a response
("holes") are skipped: they neither receive nor pass on anything, so a
sequence with holes gives the same numbers as the same sequence compacted.
"""

from __future__ import annotations

import torch
from torch import Tensor

from covey.algos._prep import Prepared, advantage_metrics, normalize_mode, prepare
from covey.algos._stats import as_bool_mask, group_stats, masked_fill_zero, whiten
from covey.algos.options import AdvantageInput, AdvantageOptions


def last_token_index(mask: Tensor) -> Tensor:
    """(N,) index of the last valid token of each row, -1 for an empty row."""
    mask = as_bool_mask(mask)
    if mask.shape[-1] == 0:
        return torch.full(mask.shape[:1], -1, dtype=torch.long, device=mask.device)
    idx = torch.arange(mask.shape[-1], device=mask.device).expand_as(mask)
    return torch.where(mask, idx, torch.full_like(idx, -1)).max(-1).values


def token_rewards(scores: Tensor, mask: Tensor, token_kl: Tensor | None = None, kl_coef: float = 0.0) -> Tensor:
    """(N, L) r_t = score * [t == last valid token] - kl_coef * token_kl_t, 0 on masked positions.

    An empty response (mask all zero) has no token to carry its score: its row is 0.
    """
    mask = as_bool_mask(mask)
    last = last_token_index(mask)
    r = torch.zeros(mask.shape, dtype=scores.dtype, device=scores.device)
    if mask.shape[-1]:
        r = r.scatter(1, last.clamp(min=0)[:, None], scores[:, None])
    if token_kl is not None and kl_coef != 0.0:
        r = r - kl_coef * masked_fill_zero(token_kl.to(r.dtype), mask)
    return masked_fill_zero(r, mask)


def discounted_returns(rewards: Tensor, mask: Tensor, gamma: float) -> Tensor:
    """(N, L) G_t = r_t + gamma * G_{t+1} over the valid tokens of each row; 0 on masked positions.

    G after the last valid token is 0. Holes are skipped (G_{t+1} is the return of
    the next *valid* token).
    """
    mask = as_bool_mask(mask)
    out = torch.zeros_like(rewards)
    running = torch.zeros_like(rewards[:, 0]) if rewards.shape[-1] else None
    for t in reversed(range(rewards.shape[-1])):
        m = mask[:, t]
        running = torch.where(m, rewards[:, t] + gamma * running, running)
        out[:, t] = torch.where(m, running, torch.zeros_like(running))
    return out


def gae_advantages(rewards: Tensor, values: Tensor, mask: Tensor, gamma: float, lam: float) -> tuple[Tensor, Tensor]:
    """GAE (Schulman et al. 2016), masked. Returns (advantages, returns), both (N, L), 0 when masked.

        delta_t = r_t + gamma * V_{t+1} - V_t      (V after the last valid token = 0)
        A_t     = delta_t + gamma * lam * A_{t+1}
        R_t     = A_t + V_t
    """
    mask = as_bool_mask(mask)
    values = masked_fill_zero(values.detach().to(rewards.dtype), mask)
    adv = torch.zeros_like(rewards)
    if rewards.shape[-1] == 0:
        return adv, adv.clone()
    next_value = torch.zeros_like(rewards[:, 0])
    next_adv = torch.zeros_like(next_value)
    for t in reversed(range(rewards.shape[-1])):
        m = mask[:, t]
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        a = delta + gamma * lam * next_adv
        next_adv = torch.where(m, a, next_adv)
        next_value = torch.where(m, values[:, t], next_value)
        adv[:, t] = torch.where(m, a, torch.zeros_like(a))
    return adv, masked_fill_zero(adv + values, mask)


def _rewards(p: Prepared, scores: Tensor) -> Tensor:
    return token_rewards(scores, p.mask, p.token_kl, p.kl_coef)


def _reinforce(inp: AdvantageInput, opts: AdvantageOptions, subtract_group_mean: bool):
    mode = normalize_mode(opts)
    p = prepare(inp)
    scores, stats = p.scores, None
    if subtract_group_mean:
        stats = group_stats(scores, p.group_ids, opts.ddof)
        scores = torch.where(stats.constant, torch.zeros_like(scores), scores - stats.mean)
    returns = discounted_returns(_rewards(p, scores), p.mask, opts.gamma)
    adv = returns
    if mode == "global_token":
        adv = whiten(returns, p.mask, ddof=opts.ddof, eps=opts.eps, scale=opts.std_normalize)
    return adv, returns, advantage_metrics(adv, returns, p.mask, stats)


def reinforce_pp(inp: AdvantageInput, opts: AdvantageOptions):
    """REINFORCE++ (Hu 2025, arXiv:2501.03262): A_t = whiten_batch(G_t), G_t = r_t + gamma G_{t+1}.

    r_t = score on the last token - kl_coef * token_kl_t. Whitening is over all valid
    tokens of the batch (normalize auto = global_token; none = raw returns).
    """
    return _reinforce(inp, opts, subtract_group_mean=False)


def reinforce_pp_baseline(inp: AdvantageInput, opts: AdvantageOptions):
    """REINFORCE++-baseline: score - group mean of the scores, then as reinforce_pp."""
    return _reinforce(inp, opts, subtract_group_mean=True)


def gae(inp: AdvantageInput, opts: AdvantageOptions):
    """PPO's GAE (Schulman et al. 2016, arXiv:1506.02438): needs inp.values. normalize auto = none;
    global_token whitens A over the batch (returns stay A + V of the un-whitened A)."""
    mode = normalize_mode(opts)
    p = prepare(inp)
    if inp.values is None:
        raise ValueError("estimator 'gae' needs values (critic V(s_t) per response token)")
    adv, returns = gae_advantages(_rewards(p, p.scores), inp.values, p.mask, opts.gamma, opts.lam)
    if mode == "global_token":
        adv = whiten(adv, p.mask, ddof=opts.ddof, eps=opts.eps, scale=opts.std_normalize)
    return adv, returns, advantage_metrics(adv, returns, p.mask)
