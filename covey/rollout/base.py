"""The engine interface every sampler implements (`Engine`): chat-formatted prompts in, a Rollout out.

A prompt is the chat-formatted text, or the token ids themselves: a multi-turn episode continues
from the ids it has (the model's sampled ids and the environment's appended ones), which are
never decoded and encoded again.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
from torch import Tensor

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


@dataclass(frozen=True)
class Quorum:
    """When a call of `Engine.generate_until` stops: once `needed` groups have ended (every row of the group
    at its end of sequence or budget) and every group in `must` has. Rows still going then are cut: their
    tokens so far are returned and flagged (`Rollout.cut`), and rows not yet started come back empty."""
    groups: Sequence[int]
    """Each row's group."""
    needed: int
    """Groups that must have ended."""
    must: frozenset = frozenset()
    """Groups that end in this call, however long they run."""


@dataclass(eq=False)
class RowJob:
    """One prompt's rows for `Engine.serve_rows`: `n` samples of at most `max_tokens` tokens each, greedy or drawn
    from `seed`'s own stream (each row's samples as `generate([prompt_ids], n, seeds=[seed])` gives them)."""
    prompt_ids: list[int]
    n: int
    max_tokens: int
    greedy: bool
    seed: int


@dataclass
class Sample:
    """One sampled row: its ids (up to and including the end-of-sequence token), the sampler's log-prob of each
    (None where the engine returned none), and whether it ran out of tokens before ending."""
    ids: list[int]
    logprobs: list[float] | None
    truncated: bool


class RowSource(abc.ABC):
    """Where `Engine.serve_rows` takes its jobs as it runs, and where it hands each job's rows back."""

    max_rows: int
    """Most rows decoding at once."""

    @abc.abstractmethod
    def take(self, room: int) -> list[RowJob]:
        """The jobs to start now, without waiting: at most `room` rows' worth, or one job whose rows wait for
        slots; none while the source drains (the engine then ends its rows and returns)."""

    @abc.abstractmethod
    def finish(self, job: RowJob, samples: list[Sample]) -> None:
        """Every row of `job` has ended: its samples, in row order."""

    @abc.abstractmethod
    def fail(self, job: RowJob, error: BaseException) -> None:
        """`job` failed (a bad prompt, or a decode step that raised while it ran)."""


class Engine(abc.ABC):
    """The interface every sampler implements: the trainer, tool episodes, held-out evaluation and bench call
    only these. A wrapper (`EngineWrapper`) implements each of them, forwarding what it does not change; no
    engine is asked what it can do by attribute name.

    What an engine can do is said by `continues_episodes` (its `decode_episodes` runs tool episodes in its own
    decode loop; otherwise they run turn by turn through `generate`), `keeps_weights` (its sampling weights
    must stay resident between calls: a static cache's graphs read them in place) and `samples_a_copy` (it
    samples from its own reduced-precision copy of the policy, so held-out evaluation takes an engine on the
    policy itself) and `serves_rows` (its `serve_rows` decodes a stream of jobs, each joining the running decode
    as slots free up)."""

    tokenizer: Any
    continues_episodes: bool = False
    serves_rows: bool = False
    keeps_weights: bool = False
    samples_a_copy: bool = False

    @abc.abstractmethod
    def generate(self, prompts: list[Prompt], group_size: int, *, greedy: bool = False,
                 max_new_tokens: int | None = None, seeds: list[int] | None = None,
                 budgets: Sequence[int] | None = None) -> Rollout:
        """len(prompts) x group_size completions (prompt-major rows). `seeds`: one per prompt; each group's
        samples then depend on its seed only, not on the rest of the batch (rollout.seeding=per_prompt).
        `budgets`: each row's own token budget, at most max_new_tokens (a row cut at its budget is truncated);
        an engine that cannot stop a row early samples on and cuts it (`cut_to_budgets`): the same tokens."""

    def generate_until(self, prompts: list[Prompt], quorum: Quorum, *, budgets: Sequence[int],
                       seeds: list[int] | None = None) -> Rollout:
        """One sampled row per prompt, stopped at `quorum` (rollout.partial): rows in the order they take the
        engine's slots, `budgets` their token budgets, `seeds` one per row. Only an engine with a slot loop."""
        raise NotImplementedError(f"{type(self).__name__} cannot stop a call at a quorum of groups (rollout.partial "
                                  "needs the fast engine)")

    def decode_episodes(self, prompts: list[Prompt], group_size: int, hosts: list, options, *,
                        greedy: bool = False, seeds: list[int] | None = None) -> tuple[Rollout, dict]:
        """Whole tool episodes in the engine's decode loop (only where `continues_episodes`)."""
        raise NotImplementedError(f"{type(self).__name__} runs tool episodes turn by turn (covey/rollout/episodes.py)")

    def serve_rows(self, source: RowSource) -> None:
        """Decode the jobs `source` gives, each joining the running decode as slots free up, until no row runs and
        the source gives none (only where `serves_rows`: the policy server's engine thread)."""
        raise NotImplementedError(f"{type(self).__name__} cannot serve a stream of rows (the fast engine's slot "
                                  "loop does)")

    @abc.abstractmethod
    def sync_weights(self, model) -> None:
        """After an optimizer step: the engine samples `model`'s current weights from its next call."""

    def release_weights(self) -> None:  # noqa: B027 - an optional hook, a no-op unless the engine holds a copy
        """Free what the engine holds of the weights until its next call (nothing by default)."""

    def decode_path(self) -> str:
        """One start-up line: how the engine decodes, and why."""
        return f"{type(self).__name__}"

    def take_metrics(self, total: Callable[[Tensor], Tensor] | None = None) -> dict:
        """The engine's metrics since the last call (tool episodes: `episode/*`, `tools/*`); `total` sums a
        vector over processes, and every rank must call it then. {} by default."""
        return {}


def cut_to_budgets(rollout: Rollout, budgets: Sequence[int] | None, tokenizer) -> Rollout:
    """Each row of `rollout` cut at its own token budget (rows in prompt-major order): the tokens after it
    padded out of the mask, the row truncated unless it ended within the budget, its text decoded again."""
    if budgets is None:
        return rollout
    limits = torch.as_tensor(list(budgets))
    if len(limits) != len(rollout):
        raise ValueError(f"{len(limits)} budgets for {len(rollout)} rows")
    within = torch.arange(rollout.response_ids.shape[1])[None, :] < limits[:, None]
    cut = (rollout.response_mask.bool() & ~within).any(1)
    if not bool(cut.any()):
        return rollout
    rollout.response_mask = rollout.response_mask * within
    rollout.response_ids = torch.where(within, rollout.response_ids,
                                       torch.full_like(rollout.response_ids, tokenizer.pad_token_id))
    rollout.truncated = rollout.truncated | cut
    if rollout.sample_logp is not None:
        rollout.sample_logp = rollout.sample_logp * within
    rollout.completions = tokenizer.batch_decode(rollout.response_ids, skip_special_tokens=True)
    return rollout


class EngineWrapper(Engine):
    """An engine around another (`inner`): every method of the interface is forwarded to it unless the wrapper
    changes it."""

    def __init__(self, inner: Engine):
        self.inner = inner

    @property
    def tokenizer(self):
        return self.inner.tokenizer

    @property
    def continues_episodes(self) -> bool:
        return self.inner.continues_episodes

    @property
    def keeps_weights(self) -> bool:
        return self.inner.keeps_weights

    @property
    def samples_a_copy(self) -> bool:
        return self.inner.samples_a_copy

    @property
    def serves_rows(self) -> bool:
        """False unless the wrapper says otherwise: a stream of rows would bypass a wrapper's own `generate`
        (a forced greedy switch, whole episodes); one that samples as its inner engine says so."""
        return False

    def generate(self, prompts: list[Prompt], group_size: int, *, greedy: bool = False,
                 max_new_tokens: int | None = None, seeds: list[int] | None = None,
                 budgets: Sequence[int] | None = None) -> Rollout:
        return self.inner.generate(prompts, group_size, greedy=greedy, max_new_tokens=max_new_tokens, seeds=seeds,
                                   budgets=budgets)

    def generate_until(self, prompts: list[Prompt], quorum: Quorum, *, budgets: Sequence[int],
                       seeds: list[int] | None = None) -> Rollout:
        return self.inner.generate_until(prompts, quorum, budgets=budgets, seeds=seeds)

    def decode_episodes(self, prompts: list[Prompt], group_size: int, hosts: list, options, *,
                        greedy: bool = False, seeds: list[int] | None = None) -> tuple[Rollout, dict]:
        return self.inner.decode_episodes(prompts, group_size, hosts, options, greedy=greedy, seeds=seeds)

    def serve_rows(self, source: RowSource) -> None:
        self.inner.serve_rows(source)

    def sync_weights(self, model) -> None:
        self.inner.sync_weights(model)

    def release_weights(self) -> None:
        self.inner.release_weights()

    def decode_path(self) -> str:
        return self.inner.decode_path()

    def take_metrics(self, total: Callable[[Tensor], Tensor] | None = None) -> dict:
        return self.inner.take_metrics(total)
