"""Input checking and option resolution shared by all advantage estimators."""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from torch import Tensor

from covey.algos._stats import GroupStats, as_bool_mask, compute_dtype, masked_fill_zero, masked_mean, masked_summary
from covey.algos.options import AdvantageInput, AdvantageOptions


@dataclass
class Prepared:
    """Checked, dtype-normalised view of an AdvantageInput."""
    scores: Tensor     # (N,) float
    mask: Tensor       # (N, L) bool
    group_ids: Tensor  # (N,) long
    lengths: Tensor    # (N,) float: valid tokens per sequence
    token_kl: Tensor | None  # (N, L) float, zero on masked positions, or None when KL-in-reward is off
    kl_coef: float


def _check_shape(name: str, t: Tensor | None, shape: tuple) -> None:
    if t is not None and tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {tuple(shape)}, got {tuple(t.shape)}")


def prepare(inp: AdvantageInput) -> Prepared:
    """Validate shapes and convert dtypes (advantages are computed without autograd)."""
    if inp.response_mask.dim() != 2:
        raise ValueError(f"response_mask must be (N, L), got shape {tuple(inp.response_mask.shape)}")
    n, length = inp.response_mask.shape
    _check_shape("scores", inp.scores, (n,))
    _check_shape("group_ids", inp.group_ids, (n,))
    for name in ("values", "token_kl"):
        _check_shape(name, getattr(inp, name), (n, length))
    _check_shape("baseline_scores", inp.baseline_scores, (n,))
    if inp.group_ids.is_floating_point():
        raise ValueError("group_ids must be an integer tensor")
    scores = inp.scores.detach()
    dtype = compute_dtype(scores)
    mask = as_bool_mask(inp.response_mask.detach())
    token_kl = None
    if inp.kl_coef != 0.0:
        if inp.token_kl is None:
            raise ValueError("kl_coef != 0 needs token_kl (per-token KL estimates)")
        token_kl = masked_fill_zero(inp.token_kl.detach().to(dtype), mask)
    return Prepared(scores=scores.to(dtype), mask=mask, group_ids=inp.group_ids.detach().long(),
                    lengths=mask.sum(-1).to(dtype), token_kl=token_kl, kl_coef=float(inp.kl_coef))


def resolve_normalize(name: str, entry, opts: AdvantageOptions) -> AdvantageOptions:
    """Check `opts` against the traits of estimator `name`'s registry entry (advantages.Estimator:
    sequence_level, default_normalize, allowed_normalize); return them with normalize='auto'
    replaced by the entry's default, the options its function runs with."""
    opts.validate()
    mode = entry.default_normalize if opts.normalize == "auto" else opts.normalize
    if mode not in entry.allowed_normalize:
        raise ValueError(f"normalize={mode!r} is not defined for estimator {name!r}; "
                         f"valid: auto, {', '.join(entry.allowed_normalize)}")
    if not entry.sequence_level and opts.token_credit != "shared":
        raise ValueError(f"token_credit={opts.token_credit!r} applies to sequence-level estimators (one "
                         f"advantage per sequence); {name!r} computes per-token advantages itself")
    return replace(opts, normalize=mode)


def normalize_mode(opts: AdvantageOptions) -> str:
    """The normalisation an estimator function runs: its registry entry has resolved 'auto' already."""
    opts.validate()
    if opts.normalize == "auto":
        raise ValueError("normalize='auto' means the estimator's default, which its registry entry knows: "
                         "run it as compute_advantages(name, ...) or ESTIMATORS[name](...)")
    return opts.normalize


def advantage_metrics(adv: Tensor, returns: Tensor, mask: Tensor, stats: GroupStats | None = None) -> dict:
    """Plain-float summary of one estimator call."""
    s = masked_summary(adv, mask)
    out = {"advantages/mean": s["mean"], "advantages/std": s["std"], "advantages/max_abs": s["max_abs"],
           "returns/mean": float(masked_mean(returns, mask)) if bool(mask.any()) else 0.0}
    if stats is not None:
        out["groups/num"] = float(stats.num_groups)
        out["groups/zero_std_frac"] = stats.zero_std_frac
    return out


def zeros_like_mask(mask: Tensor, dtype: torch.dtype) -> Tensor:
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device)
