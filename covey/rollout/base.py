"""The engine interface every sampler implements: chat-formatted prompts in, a Rollout out."""

from __future__ import annotations

from typing import Protocol

from covey.batch import Rollout


class GenerationEngine(Protocol):
    """Anything that turns chat-formatted prompts into a Rollout."""

    def generate(self, prompts: list[str], group_size: int, *, greedy: bool = False) -> Rollout:
        ...

    def sync_weights(self, model) -> None:
        """Push the policy's current weights to the engine (no-op when it shares the module)."""
