"""Loss aggregation as a global estimator over one optimizer step.

The caller builds one ``Normalizer`` from the masks of *all* sequences of the
optimizer step (every micro-batch, every process) and passes it to each
micro-batch. Each micro-batch loss is then its exact share of the step loss:

    sum over micro-batches of aggregate(x_mb, mask_mb, norm) == aggregate(x, mask, norm)

so the accumulated gradient does not depend on the micro-batch size.

Distributed use (DDP / FSDP average gradients over processes): all-reduce (SUM)
``step_totals(local_mask)`` and call ``Normalizer.from_totals(mode, tokens, seqs,
max_len, num_processes=world_size)``; ``aggregate`` multiplies by
``num_processes`` so that the average over processes is the global loss.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from covey.algos._stats import as_bool_mask, masked_fill_zero

AGGREGATIONS = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "constant")


@dataclass(frozen=True)
class Normalizer:
    """Global denominators of one optimizer step.

    mode: token_mean | seq_mean_token_mean | seq_mean_token_sum | constant
    total_tokens: valid tokens of the step; num_seqs: sequences with at least one valid token;
    max_len: the constant of mode 'constant' (Dr. GRPO: the generation budget);
    num_processes: processes whose gradients are averaged (1 without distribution).
    """
    mode: str
    total_tokens: float
    num_seqs: float
    max_len: float
    num_processes: int = 1

    def __post_init__(self):
        if self.mode not in AGGREGATIONS:
            raise ValueError(f"unknown aggregation {self.mode!r}; valid: {', '.join(AGGREGATIONS)}")
        if self.total_tokens < 0 or self.num_seqs < 0:
            raise ValueError("total_tokens and num_seqs must be >= 0")
        if self.mode == "constant" and not self.max_len > 0:
            raise ValueError(f"aggregation 'constant' needs max_len > 0, got {self.max_len}")
        if self.num_processes < 1:
            raise ValueError(f"num_processes must be >= 1, got {self.num_processes}")

    @classmethod
    def from_totals(cls, mode: str, total_tokens: float, num_seqs: float, max_len: float,
                    num_processes: int = 1) -> "Normalizer":
        """Build from global totals (e.g. all-reduced ``step_totals``)."""
        return cls(mode, float(total_tokens), float(num_seqs), float(max_len), int(num_processes))

    @property
    def denominator(self) -> float:
        """What the summed loss is divided by (for seq_mean_token_mean: after each row's own 1/T_i)."""
        if self.mode == "token_mean":
            return max(self.total_tokens, 1.0)
        if self.mode == "constant":
            return max(self.num_seqs, 1.0) * self.max_len
        return max(self.num_seqs, 1.0)


def step_totals(step_response_mask: Tensor) -> Tensor:
    """(2,) float64 [valid tokens, non-empty sequences] of a mask: all-reduce this with SUM across processes."""
    mask = as_bool_mask(step_response_mask)
    return torch.stack([mask.sum(), mask.any(-1).sum()]).to(torch.float64)


def make_normalizer(mode: str, step_response_mask: Tensor, max_len: int | None = None,
                    num_processes: int = 1) -> Normalizer:
    """Normaliser from the (N, L) mask of every sequence of the optimizer step.

    max_len defaults to L. With num_processes > 1 and only the local mask, the global
    totals are *estimated* as local totals x num_processes (exact when every process holds
    the same counts); use ``step_totals`` + ``Normalizer.from_totals`` for the exact version.
    """
    tokens, seqs = (float(v) for v in step_totals(step_response_mask))
    length = step_response_mask.shape[-1] if max_len is None else max_len
    return Normalizer.from_totals(mode, tokens * num_processes, seqs * num_processes, length, num_processes)


def aggregate(per_token: Tensor, response_mask: Tensor, norm: Normalizer) -> Tensor:
    """Scalar loss share of this micro-batch. per_token: (n, L); masked positions ignored (even NaN).

    token_mean:          sum_{i,t} x / total_tokens
    seq_mean_token_mean: sum_i (sum_t x_{i,t} / T_i) / num_seqs
    seq_mean_token_sum:  sum_{i,t} x / num_seqs
    constant:            sum_{i,t} x / (num_seqs * max_len)          (Dr. GRPO)
    all multiplied by num_processes.
    """
    mask = as_bool_mask(response_mask)
    if per_token.shape != mask.shape:
        raise ValueError(f"per_token {tuple(per_token.shape)} and response_mask {tuple(mask.shape)} differ")
    x = masked_fill_zero(per_token, mask)
    if norm.mode == "seq_mean_token_mean":
        total = (x.sum(-1) / mask.sum(-1).clamp(min=1).to(x.dtype)).sum()
    else:
        total = x.sum()
    return total * (norm.num_processes / norm.denominator)


def mask_truncated(response_mask: Tensor, truncated: Tensor) -> Tensor:
    """DAPO's overlong filtering (Yu et al. 2025, arXiv:2503.14476): the rows of responses cut at the
    token budget (`truncated`, (N,) bool) set to 0, so they add nothing to the loss or its normaliser."""
    return response_mask * (~truncated.bool()).to(response_mask.dtype)[:, None]
