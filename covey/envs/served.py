"""Episodes played from outside against a policy server on the run's engine: what agent harnesses
(covey/envs/harness.py) and verifiers environments (covey/envs/verifiers.py) share.

`ServedEpisodes` is an engine (covey/rollout/base.py). Its `generate(prompts, G)` names len(prompts) x G
episodes, seeds each, starts a PolicyServer (covey/serve/) on the wrapped engine for the batch - bound to
127.0.0.1, with a fresh random bearer token - lets its subclass play them (`play`: the outside program or
environment talks to the server, passing the episode id), takes each episode's recorded calls, closes the
server, and turns each episode into one row (covey/envs/rows.py: the model's ids trained with the
sampler's log-probs, the environment's attended). Between batches no server runs: the training step and
the weight sync own the engine, so every batch samples the newest weights.

Seeds: an episode's calls that send no `seed` sample from its own seed (`PolicyServer.seed_episode`): with
per-prompt seeds (rollout.seeding=per_prompt) `row_seed(prompt seed, g)`, else one drawn from the run's
torch stream, which a checkpoint restores; so a resumed run samples what an uninterrupted one does.

Outcomes (`Outcome.status`), counted per batch under the subclass's `kind` (`harness/*`, `verifiers/*`),
never a crash: ok; failed and timeout score 0 and keep the row they have; an episode whose calls make no
row (it never asked the model) is dropped from its group. Each failure prints one warning line.
"""

from __future__ import annotations

import math
import secrets
import uuid
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Callable, Iterator, Sequence

import torch

from covey.batch import Rollout
from covey.envs.rows import EpisodeCallsError, EpisodeRow, episode_row, rows_rollout
from covey.rollout.agents import EpisodePrompt
from covey.rollout.base import Engine, EngineWrapper, Prompt
from covey.rollout.episodes import SEED_MODULUS, row_seed
from covey.serve import PolicyServer, ServerOptions

MAX_WARNINGS = 3
"""Failed episodes named one by one per batch; the rest are counted in one line."""
MODEL_NAME = "covey-policy"
"""The model id the batch's server answers to."""


@dataclass(frozen=True)
class PlayOptions:
    """How a batch's episodes are played and served (task.harness.*, and the engine's sampling settings the
    server checks requests against)."""
    concurrency: int
    """Episodes played at once."""
    timeout_s: float
    """Seconds one episode may take (then stopped: reward 0)."""
    max_new_tokens: int
    """A request's max_tokens when it sends none (rollout.max_turn_tokens, else rollout.max_new_tokens)."""
    temperature: float
    top_p: float

    def engine_type(self) -> type:
        """The ServedEpisodes subclass that plays these options' episodes."""
        raise NotImplementedError


@dataclass
class Outcome:
    """One episode's end: `status` ok | failed | timeout, its reward (None: none given), `detail` (the last
    line of a program's stderr, an environment's error), its calls (None: none recorded), and named reward
    parts and metrics to log."""
    episode: str
    status: str
    reward: float | None = None
    detail: str = ""
    calls: list[dict] | None = None
    parts: dict[str, float] = field(default_factory=dict)


@dataclass
class BatchCounts:
    """What a batch's episodes came to."""
    episodes: int = 0
    failed: int = 0
    timeouts: int = 0
    dropped: int = 0
    unscored: int = 0
    turns: int = 0
    tokens: int = 0
    env_tokens: int = 0
    parts: dict[str, list[float]] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)

    COUNTS = ("episodes", "failed", "timeouts", "dropped", "unscored")


class GreedySwitch(EngineWrapper):
    """The run's engine as the batch's server calls it: every call greedy while `greedy` is set (held-out
    evaluation plays greedily, whatever temperature the requests send or omit)."""

    def __init__(self, inner: Engine):
        super().__init__(inner)
        self.greedy = False

    def generate(self, prompts: list[Prompt], group_size: int, *, greedy: bool = False,
                 max_new_tokens: int | None = None, seeds: list[int] | None = None,
                 budgets: Sequence[int] | None = None) -> Rollout:
        return self.inner.generate(prompts, group_size, greedy=greedy or self.greedy, max_new_tokens=max_new_tokens,
                                   seeds=seeds, budgets=budgets)


def episode_messages(row: EpisodeRow, calls: list[dict], tokenizer) -> list[dict]:
    """The episode after its prompt as chat messages: a chat client's own messages after the first call's,
    then the last turn's text; else each model turn (assistant) and what the environment added (user)."""
    texts = [tokenizer.decode(ids, skip_special_tokens=True) for ids in row.model_ids]
    if all("messages" in c for c in calls):
        return [dict(m) for m in calls[-1]["messages"][len(calls[0]["messages"]):]] + [
            {"role": "assistant", "content": texts[-1]}]
    out = []
    for k, text in enumerate(texts):
        out.append({"role": "assistant", "content": text})
        if k + 1 < len(texts):
            start, end = row.turn_starts[k] + len(row.model_ids[k]), row.turn_starts[k + 1]
            out.append({"role": "user", "content": tokenizer.decode(row.ids[start:end], skip_special_tokens=True)})
    return out


@contextmanager
def batch_server(switch: GreedySwitch, options: ServerOptions, greedy: bool,
                 seeds: dict[str, int]) -> Iterator[PolicyServer]:
    """A started PolicyServer on `switch` for one batch, each episode seeded; closed on exit."""
    switch.greedy = greedy
    server = PolicyServer(switch, options)
    try:
        server.start()
        for episode, seed in seeds.items():
            server.seed_episode(episode, seed)
        yield server
    finally:
        server.close()
        switch.greedy = False


class ServedEpisodes(EngineWrapper):
    """An engine whose `generate` plays episodes from outside against a server on the wrapped engine (module
    docstring); a subclass writes `play`."""

    kind = "served"
    """The metrics' prefix and the warnings' name."""

    def __init__(self, inner: Engine, options: PlayOptions, context_length: int):
        super().__init__(inner)
        self.options, self.context_length = options, context_length
        self.switch = GreedySwitch(inner)
        self.pending: list[BatchCounts] = []

    def play(self, episodes: list[str], rows: list[EpisodePrompt], url: str, token: str) -> list[Outcome]:
        """Play each episode (its row) against the server at `url` (ending in /v1) with bearer `token`."""
        raise NotImplementedError

    def generate(self, prompts: list[Prompt], group_size: int, *, greedy: bool = False,
                 max_new_tokens: int | None = None, seeds: list[int] | None = None,
                 budgets: Sequence[int] | None = None) -> Rollout:
        """len(prompts) x group_size episodes, one row each, minus the dropped ones (a counted outcome). The
        outside side chooses its requests' max_tokens: `max_new_tokens` is the server's default for them."""
        if budgets is not None:
            raise ValueError(f"{self.kind} episodes take no per-row budgets: their requests set max_tokens")
        if not all(isinstance(p, EpisodePrompt) for p in prompts):
            raise TypeError(f"a {self.kind} engine takes the run's prompts, each carrying its row")
        n = len(prompts) * group_size
        if seeds is not None:
            own = [row_seed(s, g) for s in seeds for g in range(group_size)]
        else:  # the run's torch stream (a checkpoint restores it): a resumed run draws the same seeds
            own = torch.randint(0, SEED_MODULUS, (n,)).tolist()
        tag = uuid.uuid4().hex[:10]
        episodes = [f"covey-{tag}-{k}" for k in range(n)]
        token = secrets.token_urlsafe(24)
        with batch_server(self.switch, self.server_options(token, n, max_new_tokens), greedy,
                          dict(zip(episodes, own))) as server:
            outcomes = self.play(episodes, [prompts[k // group_size] for k in range(n)], server.url + "/v1", token)
            for outcome in outcomes:
                outcome.calls = server.episode(outcome.episode)
        return self.rollout(outcomes, [k // group_size for k in range(n)])

    def server_options(self, token: str, episodes: int, max_new_tokens: int | None = None) -> ServerOptions:
        o = self.options
        return ServerOptions(temperature=o.temperature, top_p=o.top_p,
                             max_new_tokens=max_new_tokens or o.max_new_tokens, context_length=self.context_length,
                             token=token, model_name=MODEL_NAME,
                             generate_timeout_s=o.timeout_s, max_episodes=max(4096, episodes))

    def rollout(self, outcomes: list[Outcome], groups: list[int]) -> Rollout:
        """The batch's rows (episodes without a row dropped), each with its reward as `environment_rewards`
        (NaN: none given; 0 for a failed or timed-out episode); the batch's counts kept for `take_metrics`."""
        counts = BatchCounts(episodes=len(outcomes))
        rows, kept, rewards, messages = [], [], [], []
        for outcome, group in zip(outcomes, groups):
            reward = outcome.reward
            if outcome.status != "ok":
                counts.failed += outcome.status == "failed"
                counts.timeouts += outcome.status == "timeout"
                what = "timed out" if outcome.status == "timeout" else "failed"
                counts.warnings.append(f"{outcome.episode} {what} (reward 0): {outcome.detail}")
                reward = 0.0
            try:
                row = episode_row(outcome.calls or [], outcome.episode)
            except EpisodeCallsError as e:
                counts.dropped += 1
                counts.warnings.append(f"{outcome.episode} dropped: {e} ({outcome.detail or 'no detail'})")
                continue
            counts.unscored += reward is None
            counts.turns, counts.tokens = counts.turns + row.turns, counts.tokens + len(row.ids)
            counts.env_tokens += len(row.ids) - sum(row.trained)
            for name, value in outcome.parts.items():
                counts.parts.setdefault(name, []).append(value)
            rows.append(row)
            kept.append(group)
            rewards.append(math.nan if reward is None else reward)
            messages.append(episode_messages(row, outcome.calls, self.tokenizer))
        self.warn(counts.warnings)
        self.pending.append(counts)
        out = rows_rollout(rows, kept, self.tokenizer, messages)
        out.environment_rewards = torch.tensor(rewards, dtype=torch.float)
        return out

    def warn(self, lines: list[str]) -> None:
        for line in lines[:MAX_WARNINGS]:
            print(f"covey: warning: {self.kind} episode {line}")
        if len(lines) > MAX_WARNINGS:
            print(f"covey: warning: {len(lines) - MAX_WARNINGS} more {self.kind} episodes failed or were dropped "
                  f"in this batch ({self.kind}/* metrics)")

    def take_metrics(self, total: Callable[[torch.Tensor], torch.Tensor] | None = None) -> dict:
        """The batches' outcomes since the last call, under `kind`: episodes, failed, timeouts, dropped, unscored
        (counts); turns_mean (model turns per kept episode), env_token_frac (the environment's share of the
        kept episodes' tokens); each named part's mean over the episodes that have it."""
        batches, self.pending = self.pending, []
        if not batches:
            return {}
        names = (*BatchCounts.COUNTS, "turns", "tokens", "env_tokens")
        sums = torch.tensor([sum(getattr(b, k) for b in batches) for k in names], dtype=torch.float64)
        values = dict(zip(names, (total(sums) if total is not None else sums).tolist()))
        kept = values["episodes"] - values["dropped"]
        out = {f"{self.kind}/{k}": int(values[k]) for k in BatchCounts.COUNTS}
        out[f"{self.kind}/turns_mean"] = values["turns"] / kept if kept else 0.0
        out[f"{self.kind}/env_token_frac"] = values["env_tokens"] / values["tokens"] if values["tokens"] else 0.0
        for name in sorted({k for b in batches for k in b.parts}):
            seen = [v for b in batches for v in b.parts.get(name, [])]
            out[f"{self.kind}/{name}"] = sum(seen) / len(seen)
        return out


def served_engines(options: PlayOptions, engine: Engine, eval_engine: Engine, context: int) -> tuple:
    """The run's sampling and held-out engines as engines of served episodes (one where they are one engine);
    `context`: the model's context length (prompt + max_tokens beyond it is refused)."""
    make = options.engine_type()
    train = make(engine, options, context)
    return train, train if eval_engine is engine else make(eval_engine, options, context)
