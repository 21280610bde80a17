"""Episode traces: every call of an episode, its exact prompt ids, completion ids, log-probs and finish reasons,
and the rule that a call's prompt extends the previous call's prompt and completion.

An episode is one multi-turn conversation: its calls come one after another, each continuing the last. So
the trainer can train exactly what was sampled, a later call's prompt ids must start with the previous
call's prompt ids followed by the ids of one of its choices:

- a token-id prompt (POST /v1/continue, or /v1/completions with ids) is checked as it is;
- a text prompt (a chat call's rendering) is not re-tokenized where it repeats the episode: when its text
  starts with the previous prompt's text followed by the text of one of the previous choices (special
  tokens written out), its ids are the previous prompt's ids, that choice's sampled ids, and the ids of the
  rest of the text alone (`text_prompt_ids`). A chat template that renders earlier turns differently once
  later messages follow (one that drops an earlier turn's reasoning, say), or a client that changed an
  earlier message, gives a text that does not repeat the episode: the call is refused (400) naming the
  episode and the first token where the prompt and the episode differ.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass

from covey.serve.options import RequestError
from covey.serve.texts import Texts


@dataclass
class Choice:
    ids: list[int]
    logprobs: list[float] | None
    finish_reason: str


@dataclass
class Call:
    """One call of an episode. `prompt_text`: the text its prompt was rendered as (None: sent as ids)."""

    route: str
    prompt_ids: list[int]
    prompt_text: str | None
    seed: int
    choices: list[Choice]
    messages: list[dict] | None = None
    """A chat call's messages, as the template rendered them (None: a completion call)."""

    def as_dict(self) -> dict:
        choices = [{"completion_ids": list(c.ids), "logprobs": None if c.logprobs is None else list(c.logprobs),
                    "finish_reason": c.finish_reason} for c in self.choices]
        out = {"route": self.route, "prompt_ids": list(self.prompt_ids), "seed": self.seed, "choices": choices}
        return out if self.messages is None else {**out, "messages": [dict(m) for m in self.messages]}


class Episodes:
    """The traces of the episodes seen, oldest first; beyond `limit` episodes the oldest is dropped."""

    def __init__(self, limit: int = 4096):
        self.limit = limit
        self.calls: OrderedDict[str, list[Call]] = OrderedDict()
        self.lock = threading.Lock()

    def last(self, episode: str | None) -> Call | None:
        with self.lock:
            calls = self.calls.get(episode) if episode is not None else None
            return calls[-1] if calls else None

    def record(self, episode: str, call: Call) -> None:
        with self.lock:
            self.calls.setdefault(episode, []).append(call)
            self.calls.move_to_end(episode)
            while len(self.calls) > self.limit:
                self.calls.popitem(last=False)

    def count(self, episode: str) -> int:
        """Calls recorded for the episode so far."""
        with self.lock:
            return len(self.calls.get(episode, ()))

    def trace(self, episode: str) -> list[dict] | None:
        """The episode's calls in order (None: no such episode)."""
        with self.lock:
            calls = self.calls.get(episode)
            return None if calls is None else [c.as_dict() for c in calls]

    def take(self, episode: str) -> list[dict] | None:
        """The episode's calls in order, and the episode forgotten (None: no such episode)."""
        with self.lock:
            calls = self.calls.pop(episode, None)
            return None if calls is None else [c.as_dict() for c in calls]

    def __len__(self) -> int:
        return len(self.calls)


def common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    return next((i for i in range(n) if a[i] != b[i]), n)


def check_extends(previous: Call | None, ids: list[int], episode: str | None, texts: Texts) -> None:
    """RequestError unless `ids` start with the previous call's prompt ids and one of its choices' ids."""
    if previous is None:
        return
    best, at = [], -1
    for choice in previous.choices:
        expected = previous.prompt_ids + choice.ids
        same = common_prefix(expected, ids)
        if same == len(expected):
            return
        if same > at:
            best, at = expected, same
    if at < len(ids):
        found = f"the prompt has id {ids[at]} ({texts.pieces([ids[at]])[0]!r})"
    else:
        found = f"the prompt ends there ({len(ids)} tokens)"
    raise RequestError(
        f"episode {episode!r}: the prompt does not extend the previous call's prompt and completion "
        f"({len(best)} tokens): they first differ at token {at}, where {found} and the episode has id {best[at]} "
        f"({texts.pieces([best[at]])[0]!r}). The chat template renders earlier turns differently (or an earlier "
        "message changed), and covey does not re-tokenize them: send the exact ids to POST /v1/continue, or "
        "use a new episode id")


def text_prompt_ids(previous: Call | None, text: str, texts: Texts, episode: str | None) -> list[int]:
    """The ids of a text prompt: spliced onto the episode's ids where the text repeats them (module docstring),
    else the text's own tokens, which must then extend the episode as they are (`check_extends`)."""
    if previous is not None and previous.prompt_text is not None and text.startswith(previous.prompt_text):
        rest = text[len(previous.prompt_text):]
        done = sorted(((texts.decode(c.ids, special=True), c) for c in previous.choices),
                      key=lambda pair: -len(pair[0]))
        for written, choice in done:
            if rest.startswith(written):
                return previous.prompt_ids + choice.ids + texts.encode(rest[len(written):])
    ids = texts.encode(text)
    check_extends(previous, ids, episode, texts)
    return ids

