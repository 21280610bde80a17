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
    columns, TRL style). A conversational prompt (a list of chat messages, TRL's
    "conversational" format) is kept in `messages`, and `prompt` is then its text,
    one "role: content" line per message. `meta` and `messages` are excluded from
    the hash so examples can be deduplicated by (prompt, answer).
    """

    prompt: str
    answer: str
    meta: dict[str, Any] = field(default_factory=dict, hash=False)
    messages: tuple | None = field(default=None, hash=False, compare=False)
    source: str | None = field(default=None, hash=False, compare=False)
    """Where the row was read ('file:line'; None for generated tasks): errors about it name this."""

    @property
    def given_prompt(self) -> str | list[dict]:
        """The prompt as the dataset gives it: a string, or a list of chat messages."""
        return [dict(m) for m in self.messages] if self.messages is not None else self.prompt


def messages_text(messages) -> str:
    """'role: content' lines: the readable text of a conversational prompt."""
    return "\n".join(f"{m['role']}: {m['content']}" for m in messages)


def build_messages(example: Example, system_prompt: str | None = None) -> list[dict]:
    """Chat messages for `tokenizer.apply_chat_template`: the optional system prompt (unless the
    example's own messages have one), then the example's messages or its question as the user's."""
    own = example.given_prompt if example.messages is not None else [{"role": "user", "content": example.prompt}]
    if system_prompt and not any(m.get("role") == "system" for m in own):
        return [{"role": "system", "content": system_prompt}, *own]
    return own
