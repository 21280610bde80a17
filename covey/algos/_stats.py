"""Masked and grouped statistics shared by the estimators and losses.

Every function here is vectorised: group statistics use ``index_add_`` and
``scatter_reduce_`` over a contiguous re-indexing of the group ids, never a
Python loop over groups. Masked positions may hold garbage (even NaN): they
are removed with ``torch.where`` before any arithmetic touches them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


def compute_dtype(x: Tensor) -> torch.dtype:
    """float64 stays float64; everything else (bf16, fp16, ints, bool) computes in float32."""
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def as_bool_mask(mask: Tensor) -> Tensor:
    """Accept bool or 0/1 float/int masks."""
    return mask if mask.dtype == torch.bool else mask != 0


def masked_fill_zero(x: Tensor, mask: Tensor) -> Tensor:
    """x where mask else 0; safe when x holds NaN/inf at masked positions."""
    return torch.where(mask, x, torch.zeros((), dtype=x.dtype, device=x.device))


def masked_mean(x: Tensor, mask: Tensor) -> Tensor:
    """Mean of x over mask (0 when the mask is empty)."""
    mask = as_bool_mask(mask)
    n = mask.sum()
    return masked_fill_zero(x, mask).sum() / n.clamp(min=1)


def masked_std(x: Tensor, mask: Tensor, ddof: int = 0) -> Tensor:
    """sqrt(sum (x - mean)^2 / (n - ddof)) over mask; 0 when n - ddof <= 0."""
    mask = as_bool_mask(mask)
    n = mask.sum()
    dev = masked_fill_zero(x - masked_mean(x, mask), mask)
    denom = n - ddof
    var = (dev * dev).sum() / denom.clamp(min=1)
    return torch.where(denom > 0, var, torch.zeros_like(var)).sqrt()


def masked_summary(x: Tensor, mask: Tensor) -> dict[str, float]:
    """mean / std (ddof 0) / max |x| over mask, as plain floats (0.0 on an empty mask)."""
    mask = as_bool_mask(mask)
    x = x.detach().to(compute_dtype(x))
    if not bool(mask.any()):
        return {"mean": 0.0, "std": 0.0, "max_abs": 0.0}
    return {"mean": float(masked_mean(x, mask)), "std": float(masked_std(x, mask)),
            "max_abs": float(masked_fill_zero(x.abs(), mask).max())}


def whiten(x: Tensor, mask: Tensor, *, ddof: int, eps: float, scale: bool = True) -> Tensor:
    """(x - mean) / (std + eps) over the valid entries of the whole tensor; 0 elsewhere.

    If every valid entry is equal the result is exactly 0 (no eps-sized noise).
    ``scale=False`` only subtracts the mean (the Dr. GRPO analogue).
    """
    mask = as_bool_mask(mask)
    vals = x[mask]
    if vals.numel() == 0 or bool(vals.max() == vals.min()):
        return torch.zeros_like(x)
    centred = x - vals.mean()
    if scale:
        centred = centred / (plain_std(vals, ddof) + eps)
    return masked_fill_zero(centred, mask)


def plain_std(vals: Tensor, ddof: int) -> Tensor:
    n = vals.numel()
    if n - ddof <= 0:
        return vals.new_zeros(())
    return ((vals - vals.mean()) ** 2).sum().div(n - ddof).sqrt()


@dataclass
class GroupStats:
    """Per-element statistics of the group each element belongs to (all shaped like x)."""
    mean: Tensor
    std: Tensor
    count: Tensor
    constant: Tensor      # bool: every member of the group has the same value
    num_groups: int
    zero_std_frac: float  # fraction of groups whose values are all equal (singletons included)


def group_index(group_ids: Tensor) -> tuple[Tensor, int]:
    """Map arbitrary integer ids to 0..G-1 (inverse index, G)."""
    uniq, inverse = torch.unique(group_ids, return_inverse=True)
    return inverse, int(uniq.numel())


def group_stats(x: Tensor, group_ids: Tensor, ddof: int = 0) -> GroupStats:
    """Mean, std (ddof), size and "all equal" flag of each element's group.

    x: (M,) float, group_ids: (M,) int. A group with count - ddof <= 0 has std 0.
    """
    x = x.to(compute_dtype(x))
    if x.numel() == 0:
        empty = torch.zeros_like(x)
        return GroupStats(empty, empty, empty, empty.bool(), 0, 0.0)
    inv, g = group_index(group_ids)
    zeros = torch.zeros(g, dtype=x.dtype, device=x.device)
    count = zeros.index_add(0, inv, torch.ones_like(x))
    mean = zeros.index_add(0, inv, x) / count
    dev = x - mean[inv]
    ss = zeros.index_add(0, inv, dev * dev)
    denom = count - ddof
    var = torch.where(denom > 0, ss / denom.clamp(min=1), zeros)
    big = torch.finfo(x.dtype).max
    mx = torch.full_like(zeros, -big).scatter_reduce(0, inv, x, "amax", include_self=True)
    mn = torch.full_like(zeros, big).scatter_reduce(0, inv, x, "amin", include_self=True)
    constant = mx == mn
    return GroupStats(mean=mean[inv], std=var.sqrt()[inv], count=count[inv], constant=constant[inv],
                      num_groups=g, zero_std_frac=float(constant.to(x.dtype).mean()))
