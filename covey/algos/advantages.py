"""Advantage estimators with a group baseline: GRPO (outcome and process), RLOO, ReMax.

All estimators share one signature::

    estimator(inp: AdvantageInput, opts: AdvantageOptions) -> (advantages (N, L), returns (N, L), metrics)

and are registered in ``ESTIMATORS``; ``compute_advantages(name, inp, opts)`` looks one up.
Formulas, option names, defaults and sources: docs/algorithms.md.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import Tensor

from covey.algos._prep import Prepared, advantage_metrics, normalize_mode, prepare, resolve_normalize
from covey.algos._stats import GroupStats, as_bool_mask, group_stats, masked_fill_zero, plain_std, whiten
from covey.algos.options import AdvantageInput, AdvantageOptions
from covey.algos.returns import gae, reinforce_pp, reinforce_pp_baseline


def sequence_rewards(p: Prepared) -> Tensor:
    """(N,) score_i - kl_coef * sum_t token_kl_{i,t}: the undiscounted return of the token rewards."""
    if p.token_kl is None:
        return p.scores
    return p.scores - p.kl_coef * p.token_kl.sum(-1)


def scale(centred: Tensor, raw: Tensor, stats: GroupStats, mode: str, opts: AdvantageOptions) -> Tensor:
    """Divide centred rewards by the std of `mode` (+ eps): group std, or the std of all `raw` (batch).

    Nothing is divided for mode none / global_token or std_normalize=False. Where the std is 0
    the centred value is kept as is (it is already 0 for grpo / rloo; ReMax keeps r - b).
    """
    if not opts.std_normalize or mode in ("none", "global_token"):
        return centred
    std = stats.std if mode == "group" else plain_std(raw, opts.ddof).expand_as(raw)
    return torch.where(std > 0, centred / (std + opts.eps), centred)


def spread_over_tokens(seq_adv: Tensor, mask: Tensor, credit: str, gamma: float) -> Tensor:
    """(N,) -> (N, L) token credit, with k = 1..T_i the rank of a token among the valid ones:

    shared:     A_i                                   (GRPO: Shao et al. 2024, arXiv:2402.03300)
    uniform:    A_i / T_i
    discounted: gamma^(T_i - k) A_i / sum_{j=1..T_i} gamma^(T_i - j)
    """
    mask = as_bool_mask(mask)
    dtype = seq_adv.dtype
    if credit == "shared":
        w = torch.ones(mask.shape, dtype=dtype, device=mask.device)
    elif credit == "uniform":
        w = 1.0 / mask.sum(-1, keepdim=True).clamp(min=1).to(dtype)
        w = w.expand(mask.shape)
    else:
        rank = mask.to(dtype).cumsum(-1)                       # k = 1..T_i on valid tokens
        lengths = mask.sum(-1, keepdim=True).to(dtype)
        w = torch.pow(torch.tensor(gamma, dtype=dtype, device=mask.device), (lengths - rank).clamp(min=0))
        w = masked_fill_zero(w, mask)
        w = w / w.sum(-1, keepdim=True).clamp(min=torch.finfo(dtype).tiny)
    return masked_fill_zero(seq_adv[:, None] * w, mask)


def _group_mean_baseline(r: Tensor, stats: GroupStats, inp: AdvantageInput) -> Tensor:
    return torch.where(stats.constant, torch.zeros_like(r), r - stats.mean)


def _leave_one_out_baseline(r: Tensor, stats: GroupStats, inp: AdvantageInput) -> Tensor:
    # r_i - (sum_g - r_i) / (n - 1)  ==  n / (n - 1) * (r_i - mean_g); a singleton has no other sample: 0.
    n = stats.count
    loo = (r - stats.mean) * n / (n - 1).clamp(min=1)
    return torch.where(stats.constant | (n < 2), torch.zeros_like(r), loo)


def _greedy_baseline(r: Tensor, stats: GroupStats, inp: AdvantageInput) -> Tensor:
    if inp.baseline_scores is None:
        raise ValueError("estimator 'remax' needs baseline_scores (reward of the greedy sample of each prompt)")
    return r - inp.baseline_scores.detach().to(r.dtype)


def _sequence_estimator(baseline: Callable, inp: AdvantageInput, opts: AdvantageOptions):
    """Shared pipeline: sequence reward -> baseline -> scale -> token credit -> optional global_token whitening."""
    mode = normalize_mode(opts)
    p = prepare(inp)
    r = sequence_rewards(p)
    stats = group_stats(r, p.group_ids, opts.ddof)
    seq_adv = scale(baseline(r, stats, inp), r, stats, mode, opts)
    adv = spread_over_tokens(seq_adv, p.mask, opts.token_credit, opts.gamma)
    if mode == "global_token":
        adv = whiten(adv, p.mask, ddof=opts.ddof, eps=opts.eps, scale=opts.std_normalize)
    returns = masked_fill_zero(r[:, None].expand(p.mask.shape), p.mask)
    return adv, returns, advantage_metrics(adv, returns, p.mask, stats)


def grpo(inp: AdvantageInput, opts: AdvantageOptions):
    """GRPO outcome supervision (Shao et al. 2024, arXiv:2402.03300): A_i = (r_i - mean_g) / (std_g + eps).

    std_normalize=False gives Dr. GRPO (r_i - mean_g). With normalize=global_token and
    token_credit uniform/discounted, the sequence advantage is spread over its tokens
    (a variant that circulates in worked examples, not the paper's shared credit).
    """
    return _sequence_estimator(_group_mean_baseline, inp, opts)


def rloo(inp: AdvantageInput, opts: AdvantageOptions):
    """RLOO (Ahmadian et al. 2024): A_i = r_i - mean of the other G-1 rewards of the group."""
    return _sequence_estimator(_leave_one_out_baseline, inp, opts)


def remax(inp: AdvantageInput, opts: AdvantageOptions):
    """ReMax (Li et al. 2023): A_i = r_i - r(greedy sample of the same prompt)."""
    return _sequence_estimator(_greedy_baseline, inp, opts)


def _check_steps(inp: AdvantageInput, p: Prepared) -> tuple[Tensor, Tensor, Tensor]:
    if inp.step_scores is None or inp.step_ends is None:
        raise ValueError("estimator 'grpo_process' needs step_scores and step_ends")
    if inp.step_scores.dim() != 2 or inp.step_scores.shape[0] != p.mask.shape[0]:
        raise ValueError(f"step_scores must be (N, S), got {tuple(inp.step_scores.shape)}")
    if inp.step_ends.shape != inp.step_scores.shape:
        raise ValueError(f"step_ends must have the shape of step_scores {tuple(inp.step_scores.shape)}")
    if inp.step_mask is not None and inp.step_mask.shape != inp.step_scores.shape:
        raise ValueError(f"step_mask must have the shape of step_scores {tuple(inp.step_scores.shape)}")
    if p.token_kl is not None:
        raise ValueError("grpo_process does not put KL in the reward; use a KL loss (kl_coef must be 0)")
    valid = torch.ones_like(inp.step_ends, dtype=torch.bool) if inp.step_mask is None \
        else as_bool_mask(inp.step_mask.detach())
    ends = inp.step_ends.detach().long()
    length = p.mask.shape[-1]
    if bool((valid & ((ends < 0) | (ends >= length))).any()):
        raise ValueError(f"step_ends of real steps must lie in [0, {length - 1}] (response-token indices)")
    return inp.step_scores.detach().to(p.scores.dtype), ends, valid


def steps_to_tokens(step_values: Tensor, ends: Tensor, valid: Tensor, mask: Tensor) -> Tensor:
    """(N, S) -> (N, L): value of token t = sum of step_values of the real steps with end >= t."""
    placed = torch.zeros(mask.shape, dtype=step_values.dtype, device=step_values.device)
    index = ends.clamp(min=0, max=max(mask.shape[-1] - 1, 0))
    placed = placed.scatter_add(1, index, masked_fill_zero(step_values, valid))
    return masked_fill_zero(placed.flip(-1).cumsum(-1).flip(-1), mask)


def grpo_process(inp: AdvantageInput, opts: AdvantageOptions):
    """GRPO process supervision (Shao et al. 2024, arXiv:2402.03300, section 4.1.3): normalise every step
    reward by the mean and std of all real step rewards of the group; A_t = sum of the normalised rewards
    of the steps ending at or after t.
    """
    mode = normalize_mode(opts)
    p = prepare(inp)
    scores, ends, valid = _check_steps(inp, p)
    if p.mask.shape[-1] == 0:
        zero = torch.zeros(p.mask.shape, dtype=p.scores.dtype, device=p.mask.device)
        return zero, zero.clone(), advantage_metrics(zero, zero, p.mask)
    flat = scores[valid]
    stats = group_stats(flat, p.group_ids[:, None].expand_as(scores)[valid], opts.ddof)
    centred = torch.where(stats.constant, torch.zeros_like(flat), flat - stats.mean)
    step_adv = torch.zeros_like(scores).masked_scatter(valid, scale(centred, flat, stats, mode, opts))
    adv = steps_to_tokens(step_adv, ends, valid, p.mask)
    if mode == "global_token":
        adv = whiten(adv, p.mask, ddof=opts.ddof, eps=opts.eps, scale=opts.std_normalize)
    returns = steps_to_tokens(scores, ends, valid, p.mask)
    return adv, returns, advantage_metrics(adv, returns, p.mask, stats)


ALL_NORMALIZE = ("group", "batch", "global_token", "none")
"""Every normalisation (docs/algorithms.md): group and batch scale a sequence's (or a step's) reward."""


@dataclass(frozen=True)
class Estimator:
    """A registered advantage estimator and what it needs from the rest of a step.

    The run's plan derives from these traits which models exist and which inputs are gathered;
    its options are checked against them (`resolve_normalize`). Nothing outside this registry
    branches on an estimator's name: a new estimator is one entry here.
    """
    fn: Callable[[AdvantageInput, AdvantageOptions], "tuple[Tensor, Tensor, dict]"]
    needs_values: bool = False       # a critic's value per token (GAE): the run trains a critic
    greedy_baseline: bool = False    # the reward of one greedy answer per prompt (ReMax)
    step_scores: bool = False        # a reward per reasoning step (process supervision)
    min_group_size: int = 1          # samples per prompt the baseline needs (2 for a group baseline)
    per_token_rewards: bool = False  # returns from per-token rewards, so a KL penalty can go in the reward
    sequence_level: bool = False     # one advantage per sequence, spread over its tokens by token_credit
    default_normalize: str = "none"  # what normalize='auto' means for it (its paper's choice)
    allowed_normalize: tuple[str, ...] = ("global_token", "none")  # the normalisations defined for it

    def options(self, opts: AdvantageOptions) -> AdvantageOptions:
        """`opts` checked against the traits (ValueError naming the option), normalize='auto' resolved."""
        return resolve_normalize(self.fn.__name__, self, opts)

    def __call__(self, inp: AdvantageInput, opts: AdvantageOptions):
        return self.fn(inp, self.options(opts))


ESTIMATORS: dict[str, Estimator] = {
    "grpo": Estimator(grpo, min_group_size=2, sequence_level=True, default_normalize="group",
                      allowed_normalize=ALL_NORMALIZE),
    "grpo_process": Estimator(grpo_process, step_scores=True, min_group_size=2, default_normalize="group",
                              allowed_normalize=ALL_NORMALIZE),
    "rloo": Estimator(rloo, min_group_size=2, sequence_level=True, allowed_normalize=ALL_NORMALIZE),
    "remax": Estimator(remax, greedy_baseline=True, sequence_level=True, allowed_normalize=ALL_NORMALIZE),
    "reinforce_pp": Estimator(reinforce_pp, per_token_rewards=True, default_normalize="global_token"),
    "reinforce_pp_baseline": Estimator(reinforce_pp_baseline, min_group_size=2, per_token_rewards=True,
                                       default_normalize="global_token"),
    "gae": Estimator(gae, needs_values=True, per_token_rewards=True),
}


def compute_advantages(name: str, inp: AdvantageInput, opts: AdvantageOptions | None = None):
    """Run estimator `name`: (advantages (N, L), returns (N, L), metrics). Both tensors are 0 where masked.
    `opts` are checked against the entry's traits and normalize='auto' becomes its default."""
    if name not in ESTIMATORS:
        raise ValueError(f"unknown estimator {name!r}; valid: {', '.join(ESTIMATORS)}")
    entry = ESTIMATORS[name]
    opts = resolve_normalize(name, entry, opts if opts is not None else AdvantageOptions())
    with torch.no_grad():
        return entry.fn(inp, opts)
