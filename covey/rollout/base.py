"""The engine interface every sampler implements: chat-formatted prompts in, a Rollout out.

A prompt is the chat-formatted text, or the token ids themselves: a multi-turn episode continues
from the ids it has (the model's sampled ids and the environment's appended ones), which are
never decoded and encoded again.
"""

from __future__ import annotations

from typing import Protocol, Sequence

import torch

from covey.batch import Rollout

Prompt = str | Sequence[int]
"""Chat-formatted text, or the token ids of one (a row to continue)."""


def encode_prompts(tokenizer, prompts: list[Prompt]) -> dict:
    """{"input_ids", "attention_mask"} (N, P), left-padded with the tokenizer's pad id: texts through
    the tokenizer (no special tokens added: the chat template wrote them), id lists as they are."""
    if all(isinstance(p, str) for p in prompts):
        return tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
    if any(isinstance(p, str) for p in prompts):
        raise TypeError("prompts must be all texts or all token-id lists, not a mix")
    width = max((len(p) for p in prompts), default=0)
    ids = torch.full((len(prompts), width), tokenizer.pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, p in enumerate(prompts):
        if len(p):
            ids[row, width - len(p):] = torch.as_tensor(list(p), dtype=torch.long)
            mask[row, width - len(p):] = 1
    return {"input_ids": ids, "attention_mask": mask}


class GenerationEngine(Protocol):
    """Anything that turns chat-formatted prompts into a Rollout."""

    def generate(self, prompts: list[Prompt], group_size: int, *, greedy: bool = False) -> Rollout:
        ...

    def sync_weights(self, model) -> None:
        """Push the policy's current weights to the engine (no-op when it shares the module)."""
