"""Policy losses that gate the importance ratio softly or per sequence: SAPO, GMPO, VESPO (2025-2026).

Same signature as covey.algos.losses::

    loss_fn(inp: PolicyInputs, norm, opts) -> (scalar loss, metrics)

Registered with their traits in covey.algos.loss_registry: SAPO reads the token weights as every loss in
covey.algos.losses does (`scale_term`); GMPO takes its geometric mean over the kept tokens and reads one
importance weight per sequence (`select_tokens`); VESPO takes its sequence weight against the sampler
(`sampler_in_weight`). Besides the metrics every policy loss reports,
each reports policy/grad_weight_mean: the mean over valid tokens of the detached factor w_t with
d l_t / d logp_t = -w_t * A_t (before the aggregation's own 1/T_i or 1/tokens); 1 on policy.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from covey.algos._stats import as_bool_mask, masked_fill_zero, masked_mean, masked_summary
from covey.algos.aggregation import Normalizer, aggregate
from covey.algos.losses import LOG_RATIO_CLAMP, log_ratio, scaled_advantages
from covey.algos.options import PolicyInputs, PolicyLossOptions

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


def sapo_loss(inp: PolicyInputs, norm: Normalizer, opts: PolicyLossOptions) -> tuple[Tensor, dict]:
    """SAPO (Gao et al. 2025, arXiv:2511.20347): a soft gate in place of PPO's clip, per token

        f(r) = 4 / tau * sigmoid(tau * (r - 1)),   tau = sapo.temperature_pos if A > 0 else sapo.temperature_neg
        l    = -f(r) * A

    df/dr = 4 s (1 - s) with s = sigmoid(tau (r - 1)): 1 at r = 1 (pg's gradient on policy), falling smoothly
    as r leaves 1 instead of dropping to 0 at the clip. ratio_level=sequence gates GSPO's sequence ratio.
    """
    opts.validate()
    mask, logp, old_logp = as_bool_mask(inp.response_mask), inp.logp, inp.old_logp
    base = old_logp if old_logp is not None else logp.detach()
    adv = scaled_advantages(inp, mask)
    ratio = torch.exp(log_ratio(logp, base, mask, opts.ratio_level))
    tau = torch.where(adv > 0, adv.new_tensor(opts.sapo.temperature_pos), adv.new_tensor(opts.sapo.temperature_neg))
    gate = torch.sigmoid(tau * (ratio - 1.0))
    loss = aggregate(-(4.0 / tau) * gate * adv, mask, norm)
    weight = 4.0 * gate.detach() * (1.0 - gate.detach()) * ratio.detach()
    none = torch.zeros_like(mask)
    metrics = {**clip_metrics(none, none, mask), "policy/grad_weight_mean": _mean(weight, mask),
               **common_metrics(logp, old_logp, adv, ratio, mask)}
    return loss, metrics


def gmpo_loss(inp: PolicyInputs, norm: Normalizer, opts: PolicyLossOptions) -> tuple[Tensor, dict]:
    """GMPO (Zhao et al. 2025, arXiv:2507.20673): the geometric mean of the clipped token ratios of sequence i

        d_t  = logp_t - old_logp_t, clipped one-sided in log space by the sign of A_i:
               A_i > 0: min(d_t, clip(d_t, -lo, hi)) (only the top is cut); else max(d_t, clip(d_t, -lo, hi))
        g_i  = exp(mean over the kept tokens S_i of d_t)     (S_i: valid, and kept by the selections)
        l_i  = -w_i * A_i * g_i        on every valid token of i (lo, hi = gmpo.log_clip_low, gmpo.log_clip_high)

    A_i is the mean advantage over the sequence's valid tokens (its advantage, for outcome rewards); w_i its
    importance weight (one per sequence: a sequence TIS mode; ValueError on weights that vary inside a
    sequence). A dropped token leaves the mean and gets no gradient (TRL 1.16's GMPO with
    top_entropy_quantile); S_i empty: g_i = 1, no gradient. With seq_mean_token_mean (the registry entry's
    aggregation) the loss is mean_i l_i, the paper's.
    """
    opts.validate()
    mask, logp, old_logp = as_bool_mask(inp.response_mask), inp.logp, inp.old_logp
    base = old_logp if old_logp is not None else logp.detach()
    kept = mask if inp.kept is None else mask & as_bool_mask(inp.kept)
    d = masked_fill_zero(logp - base.detach(), mask).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    n_tok = mask.sum(-1).clamp(min=1).to(logp.dtype)
    seq_adv = masked_fill_zero(inp.advantages.detach().to(logp.dtype), mask).sum(-1) / n_tok
    positive = (seq_adv > 0)[:, None]
    cut = d.clamp(-opts.gmpo.log_clip_low, opts.gmpo.log_clip_high)
    clipped = masked_fill_zero(torch.where(positive, torch.minimum(d, cut), torch.maximum(d, cut)), kept)
    n_kept = kept.sum(-1).clamp(min=1).to(logp.dtype)
    geo = torch.exp(clipped.sum(-1) / n_kept)
    scale = sequence_weights(inp.is_weights, mask, n_tok)
    per_token = (-scale * seq_adv * geo)[:, None].expand_as(d)
    loss = aggregate(per_token, mask, norm)
    upper = kept & positive & (d.detach() > opts.gmpo.log_clip_high)
    lower = kept & (seq_adv < 0)[:, None] & (d.detach() < -opts.gmpo.log_clip_low)
    weight = (scale * geo.detach() * n_tok / n_kept)[:, None] * (kept & ~(upper | lower)).to(d.dtype)
    adv = seq_adv[:, None].expand_as(d)
    metrics = {**clip_metrics(upper, lower, mask), "policy/grad_weight_mean": _mean(weight, mask),
               **common_metrics(logp, old_logp, adv, torch.exp(d), mask)}
    return loss, metrics


def sequence_weights(weights: Tensor | None, mask: Tensor, n_tok: Tensor) -> Tensor | float:
    """(n,) the one importance weight of each sequence (its value on its valid tokens); 1.0 without weights.
    ValueError when a sequence's weights differ: a per-token weight has no place in one term per sequence."""
    if weights is None:
        return 1.0
    w = weights.detach().to(n_tok.dtype)
    low = torch.where(mask, w, torch.full_like(w, float("inf"))).amin(-1)
    high = torch.where(mask, w, torch.full_like(w, float("-inf"))).amax(-1)
    if bool(((high - low) > 1e-6 * high.abs().clamp(min=1.0)).any()):
        raise ValueError("a loss with one term per sequence reads one importance weight per sequence "
                         "(algo.tis.mode=sequence_truncate or sequence_mask), got weights that vary inside one")
    return masked_fill_zero(w, mask).sum(-1) / n_tok


def vespo_loss(inp: PolicyInputs, norm: Normalizer, opts: PolicyLossOptions) -> tuple[Tensor, dict]:
    """VESPO (Shen et al. 2026, arXiv:2602.10693): a detached gamma kernel of the sequence's whole importance
    weight W = pi_theta / mu against the sampler mu (a product of token ratios, no 1/T) scales the policy gradient

        d_t     = clamp(logp_t - old_logp_t, +-20)                         pi_theta / pi_old
        s_t     = clamp(log w_t, log 1e-8, 20)                             pi_old / mu, bounded by algo.tis.*
                  (w_t: inp.is_weights; without them w_t = exp(old_logp_t - sample_logp_t); without those, 1)
        log W_i = clamp(sum over valid t of (d_t + s_t), log 1e-8, 20)
        phi     = W^k * exp(lambda * (1 - W))           (phi(1) = 1, its peak at W = k / lambda)
        l_t     = -sg(phi) * A_t * logp_t               k, lambda = vespo.k_pos, vespo.lambda_pos if A_t >= 0,
                                                                    vespo.k_neg, vespo.lambda_neg otherwise

    With the sampler's log-probs W is the paper's pi_theta / mu; without them mu = pi_old, exact where the
    sampler and the trainer agree. The importance weights act inside W only, never on the term (TRL 1.16's
    loss_type="vespo" with its vLLM token modes); the kept tokens scale the term.
    """
    opts.validate()
    mask, logp, old_logp = as_bool_mask(inp.response_mask), inp.logp, inp.old_logp
    base = (old_logp if old_logp is not None else logp).detach()
    adv = scaled_advantages(inp, mask, importance=False)
    d = masked_fill_zero(logp.detach() - base, mask).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    log_w = (d + sampler_log_ratio(inp, base, mask)).sum(-1, keepdim=True).clamp(VESPO_LOG_W_MIN, LOG_RATIO_CLAMP)
    nonneg = adv >= 0
    k = torch.where(nonneg, adv.new_tensor(opts.vespo.k_pos), adv.new_tensor(opts.vespo.k_neg))
    lam = torch.where(nonneg, adv.new_tensor(opts.vespo.lambda_pos), adv.new_tensor(opts.vespo.lambda_neg))
    phi = torch.exp(k * log_w + lam * (1.0 - torch.exp(log_w))).nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)
    loss = aggregate(-phi * adv * masked_fill_zero(logp, mask), mask, norm)
    none = torch.zeros_like(mask)
    metrics = {**clip_metrics(none, none, mask), "policy/grad_weight_mean": _mean(phi, mask),
               **common_metrics(logp, old_logp, adv, torch.exp(d), mask)}
    return loss, metrics


def sampler_log_ratio(inp: PolicyInputs, old_logp: Tensor, mask: Tensor) -> Tensor:
    """(n, L) log(pi_old / mu) per valid token, clamped to [log 1e-8, 20]: from the bounded importance weights
    when given (a masked-out token's 0 gives log 1e-8), else from the sampler's log-probs, else 0 (mu = pi_old)."""
    if inp.is_weights is not None:
        log_r = inp.is_weights.detach().to(old_logp.dtype).clamp(min=1e-30).log()
    elif inp.sample_logp is not None:
        log_r = old_logp - inp.sample_logp.detach().to(old_logp.dtype)
    else:
        return torch.zeros_like(old_logp)
    return masked_fill_zero(log_r.clamp(VESPO_LOG_W_MIN, LOG_RATIO_CLAMP), mask)
