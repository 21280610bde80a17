"""The fast engine's sampler: HF's warpers, one uniform per row and step, a token by inverse CDF.

The same temperature, top-k and top-p warpers as `generate(do_sample=True)` (transformers' own classes, in
its order), and a token drawn from one uniform per row (`torch.multinomial` draws V exponentials per row:
about 30 ms a step at 32 rows on one core, as long as the forward). The uniforms come from torch's global
generator, or one generator per prompt (per-prompt seeds in one batched call); a decode loop whose rows start
at different steps takes row r's k-th uniform from them as the batch loop would have drawn it (`RowUniforms`).
"""

from __future__ import annotations

import torch
from torch import Tensor
from transformers import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper


def hf_warpers(temperature: float, top_k: int, top_p: float) -> list:
    """The warpers `generate(do_sample=True)` would apply, in its order (see `_get_logits_processor`)."""
    warpers = []
    if temperature != 1.0:
        warpers.append(TemperatureLogitsWarper(temperature))
    if top_k:
        warpers.append(TopKLogitsWarper(top_k=top_k, min_tokens_to_keep=1))
    if top_p < 1.0:
        warpers.append(TopPLogitsWarper(top_p=top_p, min_tokens_to_keep=1))
    return warpers


def sample_inverse_cdf(probs: Tensor, uniforms: Tensor) -> Tensor:
    """Token i where cdf[i-1] <= u * total < cdf[i]: exactly P(i) per row (float64 cumulative sums)."""
    cdf = probs.double().cumsum(-1)
    target = (uniforms.double() * cdf[:, -1]).unsqueeze(1)
    picked = torch.searchsorted(cdf, target, right=True).squeeze(1)
    return picked.clamp(max=probs.shape[-1] - 1)


class Uniforms:
    """One uniform per row and step: from torch's global generator, or one generator per prompt."""

    def __init__(self, n_rows: int, group_size: int, seeds: list[int] | None):
        self.n_rows, self.group_size = n_rows, group_size
        self.generators = None
        if seeds is not None:
            self.generators = [torch.Generator().manual_seed(int(s)) for s in seeds]

    def draw(self) -> Tensor:
        if self.generators is None:
            return torch.rand(self.n_rows)
        return torch.cat([torch.rand(self.group_size, generator=g) for g in self.generators])


class RowUniforms:
    """Row r's k-th uniform, drawn N at a time from the engine's `Uniforms` (above) as rows first need
    them: the draws, and so the global stream after the call, are the batch loop's."""

    def __init__(self, uniforms, n: int, upfront: int = 0):
        self.uniforms, self.table = uniforms, torch.zeros((0, n))
        self.reserve(upfront)

    def reserve(self, count: int) -> None:
        while len(self.table) < count:
            self.table = torch.cat([self.table, self.uniforms.draw()[None]])

    def take(self, rows: list[int], ks: list[int]) -> Tensor:
        self.reserve(max(ks, default=-1) + 1)
        return self.table[ks, rows]
