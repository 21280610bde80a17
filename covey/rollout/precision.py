"""Sampling from a bfloat16 copy of an fp32 policy (rollout.precision).

A decode step multiplies a few rows by every weight matrix, so it is bound by reading
the weights and by small matrix products. A bf16 copy halves the bytes read, and on
hardware with native bf16 (a CPU with AMX or AVX512-BF16, a CUDA GPU) runs the products
several times faster (docs/benchmark.md). Training, the reference and held-out
evaluation stay in the policy's own precision; only the rollouts are sampled from the
copy, which is refreshed from the policy after every update (`sync_weights`). Between a
rollout and that refresh the copy is not read, so the training loop frees its weights
(`release_weights`): the reference pass and the update, where a step's memory peaks, run
without those 270 MB (SmolLM2-135M in bf16).

The samples then come from pi_bf16, a rounding of pi_old: slightly off-policy, as with
vLLM's kernels. With one update per rollout the ratio is still taken against pi_old
(exactly 1 at the first update), so the loss is the on-policy one evaluated on samples
from a distribution within bf16 rounding of it.
"""

from __future__ import annotations

import copy
from typing import Sequence

import torch
from torch import nn

from covey.batch import Rollout
from covey.rollout.base import EngineWrapper, Prompt, Quorum, RowSource
from covey.runtime import precision

PRECISIONS = ("auto", "float32", "bfloat16")


def resolve_precision(setting: str, device: torch.device | str = "cpu") -> str:
    """rollout.precision -> float32 | bfloat16. auto: bfloat16 only where the hardware computes it natively."""
    return precision.resolve_auto("rollout.precision", setting, PRECISIONS, "float32", device)


def low_precision_copy(model: nn.Module, dtype: torch.dtype) -> nn.Module:
    """A frozen copy whose floating-point parameters are `dtype`; buffers keep theirs.

    Buffers such as rotary inverse frequencies stay fp32: rounded to bf16 they would shift
    every position's rotation, an error the rounding of the weights does not make.
    Tied parameters stay tied (deepcopy keeps the sharing).
    """
    twin = copy.deepcopy(model)
    for p in twin.parameters():
        p.requires_grad_(False)
        if p.is_floating_point():
            p.data = p.data.to(dtype)
    return twin.eval()


@torch.no_grad()
def copy_weights(dst: nn.Module, src: nn.Module) -> None:
    """dst's parameters <- src's, rounded to dst's dtype (same module structure)."""
    for (name, d), s in zip(dst.named_parameters(), src.parameters(), strict=True):
        if d.shape != s.shape:
            raise ValueError(f"copy_weights: {name} is {tuple(d.shape)} in the copy, {tuple(s.shape)} in the source")
        d.copy_(s.detach())


class LowPrecisionEngine(EngineWrapper):
    """A local engine (hf or fast) that samples from a reduced-precision copy of the policy."""

    samples_a_copy = True

    def __init__(self, engine_cls, model: nn.Module, tokenizer, dtype: torch.dtype, **engine_kwargs):
        self.copy = low_precision_copy(model, dtype)
        self.source = model  # what a released copy is refilled from
        self.released = False
        super().__init__(engine_cls(self.copy, tokenizer, **engine_kwargs))

    def release_weights(self) -> None:
        """Free the copy's weights until `sync_weights` (or the next `generate`) fills them again; kept
        where the engine's CUDA graphs read them in place (a static cache: `keeps_weights`)."""
        if self.inner.keeps_weights:
            return
        for p in self.copy.parameters():
            p.data = torch.empty(0, dtype=p.dtype, device=p.device)
        self.released = True

    def sync_weights(self, model: nn.Module) -> None:
        self.source = model
        if self.released:
            for p, s in zip(self.copy.parameters(), model.parameters(), strict=True):
                p.data = torch.empty(s.shape, dtype=p.dtype, device=p.device)
            self.released = False
        copy_weights(self.copy, model)

    def generate(self, prompts: list[Prompt], group_size: int, *, greedy: bool = False,
                 max_new_tokens: int | None = None, seeds: list[int] | None = None,
                 budgets: Sequence[int] | None = None) -> Rollout:
        if self.released:  # no update since the release (a step whose samples were all dropped)
            self.sync_weights(self.source)
        return super().generate(prompts, group_size, greedy=greedy, max_new_tokens=max_new_tokens, seeds=seeds,
                                budgets=budgets)

    def generate_until(self, prompts: list[Prompt], quorum: Quorum, *, budgets: Sequence[int],
                       seeds: list[int] | None = None) -> Rollout:
        if self.released:
            self.sync_weights(self.source)
        return super().generate_until(prompts, quorum, budgets=budgets, seeds=seeds)

    @property
    def serves_rows(self) -> bool:
        """The copy samples as the inner engine would: a stream of rows where the inner engine serves one."""
        return self.inner.serves_rows

    def serve_rows(self, source: RowSource) -> None:
        if self.released:
            self.sync_weights(self.source)
        super().serve_rows(source)

    def decode_episodes(self, prompts: list[Prompt], group_size: int, hosts: list, options, *,
                        greedy: bool = False, seeds: list[int] | None = None) -> tuple[Rollout, dict]:
        """Tool episodes from the copy (the fast engine's episode loop), refilled first if released."""
        if self.released:
            self.sync_weights(self.source)
        return super().decode_episodes(prompts, group_size, hosts, options, greedy=greedy, seeds=seeds)
