"""Which tokens carry the policy gradient: high-entropy token selection, and the covariance controls
Clip-Cov and KL-Cov. Dimension legend: N sequences, L response tokens.

High-entropy tokens (Wang et al. 2025, "Beyond the 80/20 Rule", arXiv:2506.01939; TRL's
`top_entropy_quantile`): only tokens whose entropy is at least the (1 - rho) quantile of the batch's
token entropies keep their policy-gradient term; the others still count in the loss normaliser and
carry KL and entropy terms (TRL multiplies the per-token policy loss by the mask, the normaliser
unchanged; the paper's objective divides by every token of the batch).

Covariance controls (Cui et al. 2025, "The Entropy Mechanism of Reinforcement Learning for Reasoning
Language Models", arXiv:2505.22617; verl's policy losses `clip_cov`, `kl_cov`): with the centred product

    cov_t = (A_t - mean A) * (log pi(y_t) - mean log pi)        means over the batch's valid tokens

Clip-Cov picks at random max(floor(r * T), 1) tokens among those with lb < cov_t < ub (T: valid tokens)
and drops their policy term (they leave the kept tokens, read as the loss's `token_weights` trait says);
KL-Cov picks the max(floor(k * T), 1) tokens of largest cov_t and adds coef * |log pi_theta(y_t) -
log pi_old(y_t)| to their loss. verl's defaults: r = 2e-4, lb = 1, ub = 5, k = 2e-4, coef = 0.1.

Every selection is a function of whole-batch tensors: the trainer calls it once per rollout on every
rank's tokens (covey.training.token_weights), so it never depends on the micro-batch size or the process
count.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import Tensor

from covey.algos._stats import as_bool_mask, masked_fill_zero, masked_mean
from covey.algos.aggregation import Normalizer, aggregate
from covey.config.schema_algo import ClipCovOptions, KLCovOptions


def high_entropy_mask(entropy: Tensor, response_mask: Tensor, quantile: float) -> tuple[Tensor, dict]:
    """(N, L) bool: valid tokens whose entropy is >= the (1 - quantile) quantile of the valid tokens'
    entropies (torch.quantile, linear interpolation between order statistics); and metrics.

    quantile in [0, 1]: the share of tokens kept (1 keeps all; 0 keeps the highest, and its ties).
    Metrics: select/entropy_threshold, select/entropy_kept_frac (share of valid tokens kept).
    """
    if not 0.0 <= quantile <= 1.0:
        raise ValueError(f"top_entropy_quantile must be in [0, 1], got {quantile}")
    mask = as_bool_mask(response_mask)
    values = entropy.detach()[mask]
    if values.numel() == 0 or quantile >= 1.0:
        return mask.clone(), {"select/entropy_kept_frac": 1.0}
    if values.dtype not in (torch.float32, torch.float64):
        values = values.float()
    threshold = torch.quantile(values, 1.0 - quantile)
    kept = mask & (masked_fill_zero(entropy.detach(), mask) >= threshold)
    return kept, {"select/entropy_threshold": float(threshold),
                  "select/entropy_kept_frac": float(kept.sum()) / float(mask.sum())}


def token_covariance(advantages: Tensor, logp: Tensor, response_mask: Tensor) -> Tensor:
    """(N, L) float64 (A_t - mean A)(logp_t - mean logp), means over the valid tokens; 0 where masked."""
    mask = as_bool_mask(response_mask)
    adv = masked_fill_zero(advantages.detach().double(), mask)
    lp = masked_fill_zero(logp.detach().double(), mask)
    return masked_fill_zero((adv - masked_mean(adv, mask)) * (lp - masked_mean(lp, mask)), mask)


@dataclass(frozen=True)
class CovOptions:
    """Options of the covariance controls: algo.cov_control and the group of the chosen one."""
    control: str = "none"
    """none | clip_cov | kl_cov (COV_CONTROLS)."""
    clip_cov: ClipCovOptions = field(default_factory=ClipCovOptions)
    """Clip-Cov: the share of tokens dropped and the covariance band they are drawn from (algo.clip_cov.*)."""
    kl_cov: KLCovOptions = field(default_factory=KLCovOptions)
    """KL-Cov: the share of tokens penalised and the penalty's weight (algo.kl_cov.*)."""

    def validate(self) -> None:
        c, k = self.clip_cov, self.kl_cov
        if self.control not in COV_CONTROLS:
            raise ValueError(f"unknown cov_control {self.control!r}; valid: {', '.join(COV_CONTROLS)}")
        if not (0.0 <= c.ratio <= 1.0 and 0.0 <= k.ratio <= 1.0):
            raise ValueError(f"clip_cov.ratio and kl_cov.ratio must be in [0, 1], got {c.ratio}, {k.ratio}")
        if not c.lb < c.ub:
            raise ValueError(f"clip_cov.lb must be below clip_cov.ub, got {c.lb}, {c.ub}")
        if not k.coef >= 0.0:
            raise ValueError(f"kl_cov.coef must be >= 0, got {k.coef}")


def clip_cov_select(cov: Tensor, response_mask: Tensor, opts: CovOptions, generator: torch.Generator) -> Tensor:
    """(N, L) bool: max(floor(clip_ratio * T), 1) tokens drawn uniformly (by `generator`) among the
    valid ones with clip_lb < cov < clip_ub; all of them when there are fewer."""
    mask = as_bool_mask(response_mask)
    count = max(int(opts.clip_cov.ratio * int(mask.sum())), 1)
    candidates = (mask & (cov > opts.clip_cov.lb) & (cov < opts.clip_cov.ub)).flatten().nonzero().squeeze(1)
    chosen = candidates[torch.randperm(len(candidates), generator=generator)[:count]]
    out = torch.zeros(mask.numel(), dtype=torch.bool)
    out[chosen.cpu()] = True
    return out.view(mask.shape).to(mask.device)


def kl_cov_select(cov: Tensor, response_mask: Tensor, opts: CovOptions, generator: torch.Generator) -> Tensor:
    """(N, L) bool: the max(floor(kl_ratio * T), 1) valid tokens of largest cov (none without valid tokens)."""
    mask = as_bool_mask(response_mask)
    valid = mask.flatten().nonzero().squeeze(1)
    out = torch.zeros(mask.numel(), dtype=torch.bool, device=mask.device)
    if len(valid) and opts.kl_cov.ratio > 0:
        count = max(int(len(valid) * opts.kl_cov.ratio), 1)
        out[valid[torch.topk(cov.flatten()[valid], count).indices]] = True
    return out.view(mask.shape)


@dataclass(frozen=True)
class CovControl:
    """A covariance control: how it selects tokens and what it does to them."""
    select: Callable[[Tensor, Tensor, CovOptions, torch.Generator], Tensor] | None
    """(cov, response_mask, options, generator) -> (N, L) bool; None: no selection."""
    drops_policy_term: bool = False
    """The selected tokens' policy term is dropped (they leave the kept tokens: PolicyInputs.kept)."""
    penalises_drift: bool = False
    """kl_coef * |log pi_theta - log pi_old| is added on the selected tokens."""


COV_CONTROLS: dict[str, CovControl] = {
    "none": CovControl(select=None),
    "clip_cov": CovControl(select=clip_cov_select, drops_policy_term=True),
    "kl_cov": CovControl(select=kl_cov_select, penalises_drift=True),
}


def select_cov_tokens(advantages: Tensor, logp: Tensor, response_mask: Tensor, opts: CovOptions,
                      generator: torch.Generator) -> tuple[Tensor | None, dict]:
    """The tokens the control `opts.control` acts on (None for `none`), from the batch's advantages and
    log-probs; metrics select/cov_mean (mean cov_t) and select/cov_frac (share of valid tokens selected)."""
    control = COV_CONTROLS[opts.control]
    if control.select is None:
        return None, {}
    mask = as_bool_mask(response_mask)
    cov = token_covariance(advantages, logp, mask)
    chosen = control.select(cov, mask, opts, generator)
    total = max(float(mask.sum()), 1.0)
    return chosen, {"select/cov_mean": float(cov.sum()) / total, "select/cov_frac": float(chosen.sum()) / total}


def cov_terms(opts: CovOptions, logp: Tensor, old_logp: Tensor, kept: Tensor | None, response_mask: Tensor,
              chosen: Tensor, norm: Normalizer) -> tuple[Tensor | None, Tensor | None]:
    """What the control does inside the objective of one micro-batch: (the tokens whose policy term is kept,
    None for all; the KL-Cov penalty aggregated with the step's normaliser, or None). `kept`: the kept tokens
    so far; `chosen`: this micro-batch's rows of the selection. Clip-Cov's tokens leave `kept`."""
    control = COV_CONTROLS[opts.control]
    mask = as_bool_mask(response_mask) & as_bool_mask(chosen)
    if control.drops_policy_term:
        kept = (as_bool_mask(response_mask) if kept is None else as_bool_mask(kept)) & ~mask
    penalty = None
    if control.penalises_drift:
        drift = (masked_fill_zero(logp, mask) - masked_fill_zero(old_logp.detach().to(logp.dtype), mask)).abs()
        penalty = opts.kl_cov.coef * aggregate(drift, response_mask, norm)
    return kept, penalty
