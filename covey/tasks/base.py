"""The one record every task produces, and how it becomes chat messages.

A task is just a list of `Example`s: the prompt is the *user message text*
(not chat formatted) so any model's chat template can be applied by the caller.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Example:
    """One prompt with its reference answer.

    `meta` holds extra dataset columns (passed to reward functions as keyword
    columns, TRL style). It is excluded from the hash so examples can be
    deduplicated by (prompt, answer) even though a dict is unhashable.
    """

    prompt: str
    answer: str
    meta: dict[str, Any] = field(default_factory=dict, hash=False)


def build_messages(example: Example, system_prompt: str | None = None) -> list[dict]:
    """Chat messages for `tokenizer.apply_chat_template`: optional system, then user."""
    messages = []
    if system_prompt:
        messages.append({"role": "system", "content": system_prompt})
    messages.append({"role": "user", "content": example.prompt})
    return messages
