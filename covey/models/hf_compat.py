"""How covey calls transformers models: names that changed between the releases it supports
(>= 5.0), and an argument form that avoids a slow path.

transformers 5.2x renamed the KV-cache argument of `forward` and the output field
`past_key_values` to `cache`; the old name still works there but warns on every call
and is announced to go in 5.40. covey passes and reads whichever name the installed
release declares, so it neither warns nor breaks on either side of the rename.
"""

from __future__ import annotations

from dataclasses import fields

import torch
from torch import Tensor
from transformers.modeling_outputs import BaseModelOutputWithPast

CACHE_KEY = "cache" if "cache" in {f.name for f in fields(BaseModelOutputWithPast)} else "past_key_values"


def with_cache(cache) -> dict:
    """The keyword argument that hands `cache` to a transformers model's forward."""
    return {CACHE_KEY: cache}


def cache_of(output):
    """The KV cache a transformers model's forward returned."""
    return getattr(output, CACHE_KEY)


def last_positions(count: int, width: int, device) -> torch.Tensor:
    """`logits_to_keep` as the indices of the last `count` of `width` positions, not the int `count`.

    With an int, transformers projects a strided view of the hidden states; when the weight
    needs no gradient (the reference, the bf16 sampling copy) torch.matmul does not fold such
    a view into one matrix product but runs a batched one over a copy of the (V, d) weight per
    row: a (4, 576, 49152) copy, 93 ms of a bf16 prefill of 4 prompts (dev/LOG.md, 2026-11-25).
    Indexing gathers a contiguous input instead.
    """
    return torch.arange(width - count, width, device=device)


def cache_tensors(cache) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(keys, values) of every layer of a transformers Cache, (batch, kv_heads, positions, head_dim) each."""
    return [(layer.keys, layer.values) for layer in cache.layers]


def whole_cache():
    """A Cache that keeps every position it is given in every layer (a `DynamicLayer` each): the passes
    mask each layer to its own pattern themselves, where a model's own cache would keep only the last
    window - 1 positions of a sliding-window layer (covey/passes/packing.py)."""
    from transformers import DynamicCache
    return DynamicCache()


def cache_from(pairs: list[tuple[torch.Tensor, torch.Tensor]]):
    """A `whole_cache` holding the (keys, values) `pairs`, one per layer."""
    cache = whole_cache()
    for index, (keys, values) in enumerate(pairs):
        cache.update(keys, values, index)
    return cache


def position_ids(attention_mask: Tensor) -> Tensor:
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
