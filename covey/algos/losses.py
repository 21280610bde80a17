"""Policy losses (PPO clip with dual-clip / GSPO / ratio-vs-ref options, plain PG, CISPO), value loss,
and the entropy / KL loss terms, all aggregated with a global ``Normalizer``. The policy losses are
registered by name, with their traits, in covey.algos.loss_registry (SAPO, GMPO, VESPO: soft_losses).

All policy losses share one signature::

    loss_fn(inp: PolicyInputs, norm, opts) -> (scalar loss, metrics)

with `inp` masked (PolicyInputs.masked). The token weights in `inp` (kept tokens, importance weights)
are read as the loss's registry trait `token_weights` says; every loss here is `scale_term`: its
per-token term is positively homogeneous in A_t and carries only token t's gradient, so a weight w_t >= 0
scales the term by multiplying the advantage (`scaled_advantages`).
Metrics are micro-batch-local plain floats (means over valid tokens).
"""

from __future__ import annotations

import torch
from torch import Tensor

from covey.algos._stats import as_bool_mask, masked_fill_zero, masked_mean, masked_summary
from covey.algos.aggregation import Normalizer, aggregate
from covey.algos.kl import kl_penalty
from covey.algos.options import PolicyInputs, PolicyLossOptions

LOG_RATIO_CLAMP = 20.0
"""|log ratio| is clamped here before exp (e^20 ~ 4.9e8): no overflow, no NaN."""


def _mean(x: Tensor, mask: Tensor) -> float:
    return float(masked_mean(x.detach().to(torch.float64), mask))


def _old_kl_metrics(logp: Tensor, old_logp: Tensor | None, mask: Tensor) -> dict:
    """approx KL(pi_old || pi_theta) on tokens sampled from pi_old, with r = pi_theta / pi_old:
    k1 = -log r, k3 = r - 1 - log r (Schulman 2020)."""
    if old_logp is None:
        return {}
    d = (logp.detach() - old_logp.detach()).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    return {"policy/approx_kl": _mean(torch.expm1(d) - d, mask), "policy/approx_kl_k1": _mean(-d, mask)}


def _adv_metrics(adv: Tensor, mask: Tensor) -> dict:
    s = masked_summary(adv, mask)
    return {"adv/mean": s["mean"], "adv/std": s["std"], "adv/max_abs": s["max_abs"]}


def scaled_advantages(inp: PolicyInputs, mask: Tensor, importance: bool = True) -> Tensor:
    """A_t times the weights a `scale_term` loss applies: `inp.kept` (0 or 1) and, when `importance`,
    `inp.is_weights`; 0 where masked, in logp's dtype. For l(w A) = w l(A) (w >= 0) this is w_t times the
    token's term, its value and its gradient."""
    dtype = inp.logp.dtype
    adv = masked_fill_zero(inp.advantages.detach().to(dtype), mask)
    if inp.kept is not None:
        adv = adv * as_bool_mask(inp.kept).to(dtype)
    if importance and inp.is_weights is not None:
        adv = adv * masked_fill_zero(inp.is_weights.detach().to(dtype), mask)
    return adv


def log_ratio(logp: Tensor, base_logp: Tensor, mask: Tensor, level: str) -> Tensor:
    """Clamped log importance ratio per token; 0 on masked positions.

    token:    log pi_theta(y_t) - log pi_base(y_t)
    sequence: GSPO-token (Zheng et al. 2025): sg[s_i] * pi_theta(y_t) / sg[pi_theta(y_t)] in log space,
              s_i = mean_t log ratio over the valid tokens of sequence i. Its value is s_i on every token
              and its gradient is that of the sequence ratio exp(s_i).
    """
    lr = masked_fill_zero(logp - base_logp.detach(), mask)
    if level == "sequence":
        seq = lr.detach().sum(-1) / mask.sum(-1).clamp(min=1).to(lr.dtype)
        lr = masked_fill_zero(logp - logp.detach() + seq[:, None], mask)
    return lr.clamp(min=-LOG_RATIO_CLAMP, max=LOG_RATIO_CLAMP)


def ppo_clip_loss(inp: PolicyInputs, norm: Normalizer, opts: PolicyLossOptions) -> tuple[Tensor, dict]:
    """PPO clipped surrogate (Schulman et al. 2017, arXiv:1707.06347), per token:

        l = max(-A * ratio, -A * clip(ratio, 1 - eps_low, 1 + eps_high))
        dual clip (Ye et al. 2020), A < 0 only: l = min(l, -c * A)

    ratio against old_logp (default) or ref_logp (opts.ratio_against='ref', a form that circulates
    in derivations: no trust region around the sampling policy).
    """
    opts.validate()
    mask, logp, old_logp = as_bool_mask(inp.response_mask), inp.logp, inp.old_logp
    if opts.ratio_against == "ref":
        if inp.ref_logp is None:
            raise ValueError("ratio_against='ref' needs ref_logp")
        base = inp.ref_logp
    else:
        if old_logp is None:
            raise ValueError("ppo_clip with ratio_against='old' needs old_logp")
        base = old_logp
    adv = scaled_advantages(inp, mask)
    ratio = torch.exp(log_ratio(logp, base, mask, opts.ratio_level))
    unclipped = -adv * ratio
    clipped = -adv * ratio.clamp(min=1.0 - opts.clip_eps_low, max=1.0 + opts.clip_eps_high)
    per_token = torch.maximum(unclipped, clipped)
    clip_active = mask & (clipped > unclipped)
    dual = torch.zeros_like(mask)
    if opts.dual_clip is not None:
        cap = -opts.dual_clip * adv
        dual = mask & (adv < 0) & (cap < per_token)
        per_token = torch.where(adv < 0, torch.minimum(per_token, cap), per_token)
    loss = aggregate(per_token, mask, norm)
    r = ratio.detach()
    upper, lower = clip_active & (r > 1), clip_active & (r < 1)
    metrics = {
        "policy/clipfrac": _mean(clip_active.float(), mask),
        "policy/clipfrac_upper": _mean(upper.float(), mask),
        "policy/clipfrac_lower": _mean(lower.float(), mask),
        "policy/clipfrac_dual": _mean(dual.float(), mask),
        "policy/ratio_mean": _mean(r, mask),
        "policy/ratio_max": float(masked_fill_zero(r, mask).max()) if bool(mask.any()) else 0.0,
        **_old_kl_metrics(logp, old_logp, mask), **_adv_metrics(adv, mask),
    }
    return loss, metrics


def pg_loss(inp: PolicyInputs, norm: Normalizer, opts: PolicyLossOptions) -> tuple[Tensor, dict]:
    """Plain policy gradient (REINFORCE): l = -A * logp per token. No ratio, no clipping.

    Its gradient equals ppo_clip's on the first on-policy epoch (ratio = 1).
    """
    opts.validate()
    mask, logp, old_logp = as_bool_mask(inp.response_mask), inp.logp, inp.old_logp
    adv = scaled_advantages(inp, mask)
    loss = aggregate(-adv * masked_fill_zero(logp, mask), mask, norm)
    metrics = {"policy/clipfrac": 0.0, "policy/clipfrac_upper": 0.0, "policy/clipfrac_lower": 0.0,
               "policy/clipfrac_dual": 0.0, **_old_kl_metrics(logp, old_logp, mask), **_adv_metrics(adv, mask)}
    if old_logp is not None:
        r = torch.exp((logp.detach() - old_logp.detach()).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
        metrics["policy/ratio_mean"] = _mean(r, mask)
        metrics["policy/ratio_max"] = float(masked_fill_zero(r, mask).max()) if bool(mask.any()) else 0.0
    return loss, metrics


def cispo_loss(inp: PolicyInputs, norm: Normalizer, opts: PolicyLossOptions) -> tuple[Tensor, dict]:
    """CISPO (MiniMax 2025, MiniMax-M1, arXiv:2506.13585): the importance weight is clipped and detached,
    never the token's gradient:

        l = -sg(clip(ratio, 1 - eps_low, 1 + eps_high)) * A * logp

    so every token keeps a gradient (PPO's clip zeroes it outside the trust region); on the first
    on-policy step (ratio = 1) it is `pg`'s. The paper aggregates over all tokens (loss_agg=token_mean).
    """
    opts.validate()
    mask, logp, old_logp = as_bool_mask(inp.response_mask), inp.logp, inp.old_logp
    base = old_logp if old_logp is not None else logp.detach()
    adv = scaled_advantages(inp, mask)
    ratio = torch.exp(log_ratio(logp, base, mask, opts.ratio_level)).detach()
    weight = ratio.clamp(min=1.0 - opts.clip_eps_low, max=1.0 + opts.clip_eps_high)
    loss = aggregate(-weight * adv * masked_fill_zero(logp, mask), mask, norm)
    upper, lower = mask & (ratio > 1.0 + opts.clip_eps_high), mask & (ratio < 1.0 - opts.clip_eps_low)
    metrics = {"policy/clipfrac": _mean((upper | lower).float(), mask),
               "policy/clipfrac_upper": _mean(upper.float(), mask),
               "policy/clipfrac_lower": _mean(lower.float(), mask), "policy/clipfrac_dual": 0.0,
               "policy/ratio_mean": _mean(ratio, mask),
               "policy/ratio_max": float(masked_fill_zero(ratio, mask).max()) if bool(mask.any()) else 0.0,
               **_old_kl_metrics(logp, old_logp, mask), **_adv_metrics(adv, mask)}
    return loss, metrics


def value_loss(values: Tensor, old_values: Tensor, returns: Tensor, response_mask: Tensor, norm: Normalizer,
               clip_range: float | None) -> tuple[Tensor, dict]:
    """Clipped value loss (Schulman et al. 2017, arXiv:1707.06347, as OpenAI baselines' PPO2 clips it):

        l = 0.5 * max((V - R)^2, (clip(V, V_old - c, V_old + c) - R)^2)     (c = clip_range; None: 0.5 (V - R)^2)

    Metrics: critic/loss, critic/clipfrac (share of tokens whose clip decides the loss: |V - V_old| > c,
    so clip() moved V, and the clipped term is the larger), critic/explained_var (1 - Var(R - V) / Var(R),
    0 when Var(R) = 0), critic/value_mean.
    """
    mask = as_bool_mask(response_mask)
    values = masked_fill_zero(values, mask)  # garbage (even NaN) at masked positions never reaches a gradient
    returns = masked_fill_zero(returns.detach().to(values.dtype), mask)
    err = (values - returns) ** 2
    clip_active = torch.zeros_like(mask)
    if clip_range is not None:
        if not clip_range > 0:
            raise ValueError(f"clip_range must be > 0 or None, got {clip_range}")
        old = masked_fill_zero(old_values.detach().to(values.dtype), mask)
        clipped = old + (values - old).clamp(min=-clip_range, max=clip_range)
        err_clipped = (clipped - returns) ** 2
        # The clamp's own decision, not `clipped != values`: V_old + (V - V_old) rounds to a value other
        # than V inside the range too, and such a token would count as clipped.
        moved = (values.detach() - old).abs() > clip_range
        clip_active = mask & moved & (err_clipped > err)
        err = torch.maximum(err, err_clipped)
    loss = aggregate(0.5 * err, mask, norm)
    metrics = {"critic/loss": float(loss.detach()), "critic/clipfrac": _mean(clip_active.float(), mask),
               "critic/explained_var": explained_variance(values, returns, mask),
               "critic/value_mean": _mean(values, mask)}
    return loss, metrics


def explained_variance(values: Tensor, returns: Tensor, mask: Tensor) -> float:
    """1 - Var(R - V) / Var(R) over the valid tokens (population variances); 0 when Var(R) = 0."""
    mask = as_bool_mask(mask)
    v, r = values.detach().to(torch.float64), returns.detach().to(torch.float64)
    var_r = masked_mean((r - masked_mean(r, mask)) ** 2, mask)
    resid = r - v
    var_resid = masked_mean((resid - masked_mean(resid, mask)) ** 2, mask)
    return float(1.0 - var_resid / var_r) if float(var_r) > 0 else 0.0


def entropy_loss(entropy: Tensor, response_mask: Tensor, norm: Normalizer, coef: float) -> tuple[Tensor, dict]:
    """Entropy bonus as a loss term: -coef * aggregate(H). Metric policy/entropy (mean H over valid tokens)."""
    mask = as_bool_mask(response_mask)
    entropy = masked_fill_zero(entropy, mask)
    return -coef * aggregate(entropy, mask, norm), {"policy/entropy": _mean(entropy, mask)}


def kl_loss(logp: Tensor, ref_logp: Tensor, response_mask: Tensor, norm: Normalizer, coef: float,
            kind: str = "k3") -> tuple[Tensor, dict]:
    """GRPO's KL term in the loss (Shao et al. 2024, arXiv:2402.03300):
    coef * aggregate(kl_penalty(logp, ref_logp, kind)). Metric kl/ref (mean estimate over valid tokens)."""
    mask = as_bool_mask(response_mask)
    kl = kl_penalty(masked_fill_zero(logp, mask), masked_fill_zero(ref_logp.detach().to(logp.dtype), mask), kind)
    return coef * aggregate(kl, mask, norm), {"kl/ref": _mean(kl, mask)}
