"""Policy losses that gate the importance ratio softly or per sequence: SAPO, GMPO, VESPO (2025-2026).

Same signature as covey.algos.losses::

    loss_fn(logp, old_logp, advantages, response_mask, norm, opts, ref_logp=None) -> (scalar loss, metrics)

Registered with their traits in covey.algos.loss_registry. Besides the metrics every policy loss reports,
each reports policy/grad_weight_mean: the mean over valid tokens of the detached factor w_t with
d l_t / d logp_t = -w_t * A_t (before the aggregation's own 1/T_i or 1/tokens); 1 on policy.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from covey.algos._stats import as_bool_mask, masked_fill_zero, masked_mean, masked_summary
from covey.algos.aggregation import Normalizer, aggregate
from covey.algos.losses import LOG_RATIO_CLAMP, log_ratio
from covey.algos.options import PolicyLossOptions

VESPO_LOG_W_MIN = math.log(1e-8)
"""VESPO's sequence log-weight is clamped to [log 1e-8, LOG_RATIO_CLAMP] before the kernel (as TRL 1.16 does)."""


def _mean(x: Tensor, mask: Tensor) -> float:
    return float(masked_mean(x.detach().to(torch.float64), mask))


def common_metrics(logp: Tensor, old_logp: Tensor | None, adv: Tensor, ratio: Tensor, mask: Tensor) -> dict:
    """policy/ratio_*, policy/approx_kl* (old -> new, k3 and k1) and adv/* as every policy loss reports them."""
    s = masked_summary(adv, mask)
    r = ratio.detach()
    out = {"policy/ratio_mean": _mean(r, mask),
           "policy/ratio_max": float(masked_fill_zero(r, mask).max()) if bool(mask.any()) else 0.0,
           "adv/mean": s["mean"], "adv/std": s["std"], "adv/max_abs": s["max_abs"]}
    if old_logp is not None:
        d = (logp.detach() - old_logp.detach()).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
        out.update({"policy/approx_kl": _mean(torch.expm1(d) - d, mask), "policy/approx_kl_k1": _mean(-d, mask)})
    return out


def clip_metrics(upper: Tensor, lower: Tensor, mask: Tensor) -> dict:
    """policy/clipfrac* from the tokens whose ratio a clip cut above (A > 0) and below (A < 0)."""
    return {"policy/clipfrac": _mean((upper | lower).float(), mask),
            "policy/clipfrac_upper": _mean(upper.float(), mask), "policy/clipfrac_lower": _mean(lower.float(), mask),
            "policy/clipfrac_dual": 0.0}


def sapo_loss(logp: Tensor, old_logp: Tensor | None, advantages: Tensor, response_mask: Tensor, norm: Normalizer,
              opts: PolicyLossOptions, ref_logp: Tensor | None = None) -> tuple[Tensor, dict]:
    """SAPO (Gao et al. 2025, arXiv:2511.20347): a soft gate in place of PPO's clip, per token

        f(r) = 4 / tau * sigmoid(tau * (r - 1)),   tau = sapo.temperature_pos if A > 0 else sapo.temperature_neg
        l    = -f(r) * A

    df/dr = 4 s (1 - s) with s = sigmoid(tau (r - 1)): 1 at r = 1 (pg's gradient on policy), falling smoothly
    as r leaves 1 instead of dropping to 0 at the clip. ratio_level=sequence gates GSPO's sequence ratio.
    """
    opts.validate()
    mask = as_bool_mask(response_mask)
    base = old_logp if old_logp is not None else logp.detach()
    adv = masked_fill_zero(advantages.detach().to(logp.dtype), mask)
    ratio = torch.exp(log_ratio(logp, base, mask, opts.ratio_level))
    tau = torch.where(adv > 0, adv.new_tensor(opts.sapo.temperature_pos), adv.new_tensor(opts.sapo.temperature_neg))
    gate = torch.sigmoid(tau * (ratio - 1.0))
    loss = aggregate(-(4.0 / tau) * gate * adv, mask, norm)
    weight = 4.0 * gate.detach() * (1.0 - gate.detach()) * ratio.detach()
    none = torch.zeros_like(mask)
    metrics = {**clip_metrics(none, none, mask), "policy/grad_weight_mean": _mean(weight, mask),
               **common_metrics(logp, old_logp, adv, ratio, mask)}
    return loss, metrics


def gmpo_loss(logp: Tensor, old_logp: Tensor | None, advantages: Tensor, response_mask: Tensor, norm: Normalizer,
              opts: PolicyLossOptions, ref_logp: Tensor | None = None) -> tuple[Tensor, dict]:
    """GMPO (Zhao et al. 2025, arXiv:2507.20673): the geometric mean of the clipped token ratios of sequence i

        d_t  = logp_t - old_logp_t, clipped one-sided in log space by the sign of A_i:
               A_i > 0: min(d_t, clip(d_t, -lo, hi)) (only the top is cut); else max(d_t, clip(d_t, -lo, hi))
        g_i  = exp(mean over valid t of d_t)
        l_i  = -A_i * g_i            on every valid token of i (lo, hi = gmpo.log_clip_low, gmpo.log_clip_high)

    A_i is the mean advantage over the sequence's valid tokens (its advantage, for outcome rewards).
    With seq_mean_token_mean (the registry entry's aggregation) the loss is mean_i l_i, the paper's.
    """
    opts.validate()
    mask = as_bool_mask(response_mask)
    base = old_logp if old_logp is not None else logp.detach()
    d = masked_fill_zero(logp - base.detach(), mask).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    n_tok = mask.sum(-1).clamp(min=1).to(logp.dtype)
    seq_adv = masked_fill_zero(advantages.detach().to(logp.dtype), mask).sum(-1) / n_tok
    positive = (seq_adv > 0)[:, None]
    cut = d.clamp(-opts.gmpo.log_clip_low, opts.gmpo.log_clip_high)
    clipped = masked_fill_zero(torch.where(positive, torch.minimum(d, cut), torch.maximum(d, cut)), mask)
    geo = torch.exp(clipped.sum(-1) / n_tok)
    per_token = (-seq_adv * geo)[:, None].expand_as(d)
    loss = aggregate(per_token, mask, norm)
    upper = mask & positive & (d.detach() > opts.gmpo.log_clip_high)
    lower = mask & (seq_adv < 0)[:, None] & (d.detach() < -opts.gmpo.log_clip_low)
    weight = geo.detach()[:, None] * (~(upper | lower)).to(d.dtype)
    adv = seq_adv[:, None].expand_as(d)
    metrics = {**clip_metrics(upper, lower, mask), "policy/grad_weight_mean": _mean(weight, mask),
               **common_metrics(logp, old_logp, adv, torch.exp(d), mask)}
    return loss, metrics


def vespo_loss(logp: Tensor, old_logp: Tensor | None, advantages: Tensor, response_mask: Tensor, norm: Normalizer,
               opts: PolicyLossOptions, ref_logp: Tensor | None = None) -> tuple[Tensor, dict]:
    """VESPO (arXiv:2602.10693), as TRL 1.16 defines loss_type="vespo": a detached gamma kernel of the
    sequence's whole importance weight (a product of token ratios, no 1/T) scales the policy gradient

        log w_i = clamp(sum over valid t of clamp(logp_t - old_logp_t, +-20), log 1e-8, 20)
        phi     = w^k * exp(lambda * (1 - w))           (phi(1) = 1, its peak at w = k / lambda)
        l_t     = -sg(phi) * A_t * logp_t               k, lambda = vespo.k_pos, vespo.lambda_pos if A_t >= 0,
                                                                    vespo.k_neg, vespo.lambda_neg otherwise
    """
    opts.validate()
    mask = as_bool_mask(response_mask)
    base = old_logp if old_logp is not None else logp.detach()
    adv = masked_fill_zero(advantages.detach().to(logp.dtype), mask)
    d = masked_fill_zero(logp.detach() - base.detach(), mask).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    log_w = d.sum(-1, keepdim=True).clamp(VESPO_LOG_W_MIN, LOG_RATIO_CLAMP)
    nonneg = adv >= 0
    k = torch.where(nonneg, adv.new_tensor(opts.vespo.k_pos), adv.new_tensor(opts.vespo.k_neg))
    lam = torch.where(nonneg, adv.new_tensor(opts.vespo.lambda_pos), adv.new_tensor(opts.vespo.lambda_neg))
    phi = torch.exp(k * log_w + lam * (1.0 - torch.exp(log_w))).nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)
    loss = aggregate(-phi * adv * masked_fill_zero(logp, mask), mask, norm)
    none = torch.zeros_like(mask)
    metrics = {**clip_metrics(none, none, mask), "policy/grad_weight_mean": _mean(phi, mask),
               **common_metrics(logp, old_logp, adv, torch.exp(d), mask)}
    return loss, metrics
