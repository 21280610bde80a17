"""Multi-turn episodes: the model's turns and the tools' replies as one row of token ids.

An episode starts from a prompt and alternates: the model samples a turn; the turn's text is read
for tool calls (the text is only read: the model's ids are kept as sampled); the calls run and
their replies, rendered by the chat template, are appended as token ids; the model continues from
every id so far (engines take token ids as prompts, covey/rollout/base.py). It ends when a turn
calls no tool, at `max_turns`, or when the token budget is spent.

The result is a Rollout whose response is the whole episode after the prompt: `response_mask`
is 1 on the tokens the model sampled (what is trained) and `response_attention` 1 on every token
of the episode (the model's and the environment's: what every pass attends to). `messages`
holds the episode as chat messages (assistant and tool), the completion TRL passes reward
functions; `completions` the assistant text; `turn_steps` each model turn's last token and score
(the steps of `algo.estimator=grpo_process` with `reward.step_source=turns`).

What the runner needs from the tools side is an `EpisodeHost` per episode (covey/rollout/
agents.py builds them from tools or an environment); the sampling itself is a callable, so that
the caller keeps its seeding and out-of-memory policy. Given one seed per episode
(rollout.seeding=per_prompt: `row_seed` of its prompt's seed), every later turn of an episode is
sampled from `turn_seed(episode seed, turn)`, so an episode's tokens do not depend on which other
episodes are still running, nor on how a batch is split into calls or across processes.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable, Protocol

import torch

from covey.batch import Rollout
from covey.rewards.rules import tool_turn_score
from covey.rollout.base import Prompt

MAX_EPISODES_AT_ONCE = 64
"""Episodes whose tool calls run at the same time (each call in a thread of its own)."""


@dataclass(frozen=True)
class EpisodeOptions:
    """Turns and token budgets of an episode (rollout.max_turns, rollout.max_turn_tokens,
    rollout.max_episode_tokens)."""
    max_turns: int
    """Model turns at most; a turn that calls no tool ends the episode sooner."""
    max_turn_tokens: int
    """New tokens the model may sample in one turn."""
    max_episode_tokens: int
    """Response tokens of the whole episode, the model's and the environment's."""


class EpisodeHost(Protocol):
    """The tools side of one episode. A host may also define `turn_reward() -> float | None`, the score of
    the model turn just ended (an environment's own, docs/agents.md); without it, or where it gives None,
    the turn is scored by `tool_turn_score` of its tool replies."""

    def calls_in(self, text: str) -> list:
        """The tool calls a model turn's text makes (empty: the episode ends)."""

    def reply(self, calls: list) -> list[dict]:
        """The tool messages answering `calls` ({"role": "tool", "name": ..., "content": ...})."""

    def append_ids(self, messages: list[dict]) -> list[int]:
        """The token ids the chat template writes after the model's last turn for `messages` (the tool
        messages) and the start of the next assistant turn."""


Sampler = Callable[..., Rollout]
"""sample(prompts, group_size, max_new_tokens) -> Rollout of len(prompts) * group_size rows; with episode
seeds, later turns are sample(prompts, 1, max_new_tokens, seeds=[one per prompt])."""

SEED_MODULUS = 2**63 - 1
"""Seeds stay below it: torch's generators and vLLM's take 64-bit integers."""


def row_seed(prompt_seed: int, index: int) -> int:
    """The seed of the episode `index` of a prompt's group: the seed its first turn takes as a prompt of
    its own (an environment's reset text), and the one its later turns are derived from."""
    return (prompt_seed * 1_000_003 + index) % SEED_MODULUS


def turn_seed(episode_seed: int, turn: int) -> int:
    """The seed of an episode's model turn `turn` (0: the first; the runner uses it from 1), from the
    episode's seed with a multiplier other than `row_seed`'s."""
    return (episode_seed * 1_000_033 + turn) % SEED_MODULUS


@dataclass
class Episode:
    """One episode as it grows: ids after the prompt, which of them the model sampled, its messages."""
    prompt: list[int]
    host: EpisodeHost
    ids: list[int] = field(default_factory=list)
    sampled: list[int] = field(default_factory=list)  # 1: the model's token, 0: the environment's
    messages: list[dict] = field(default_factory=list)
    turns: int = 0
    tool_calls: int = 0
    cut: bool = False  # ended by a budget (the turn limit with calls pending, or the token budget)
    done: bool = False
    logps: list[float] | None = field(default_factory=list)  # the sampler's log-probs (0: environment); None: unknown
    turn_ends: list[int] = field(default_factory=list)  # index in `ids` of each model turn's last token (-1: empty)
    turn_scores: list[float] = field(default_factory=list)  # each model turn's score, once its calls are answered

    def add(self, ids: list[int], by_model: bool, logps: list[float] | None = None) -> None:
        """Append ids; the model's come with the sampler's log-probs where the engine gives them."""
        self.ids += ids
        self.sampled += [int(by_model)] * len(ids)
        if by_model and logps is None:
            self.logps = None
        elif self.logps is not None:
            self.logps += list(logps) if by_model else [0.0] * len(ids)


def run_episodes(sample: Sampler, tokenizer, prompts: list[Prompt], group_size: int, hosts: list[EpisodeHost],
                 options: EpisodeOptions, seeds: list[int] | None = None) -> tuple[Rollout, dict]:
    """len(prompts) x group_size episodes (hosts: one per episode, in rollout row order); returns the
    Rollout of whole episodes and the episode metrics of the batch. `seeds`: one per episode (rollout row
    order): turn t >= 1 of episode i is sampled with seed `turn_seed(seeds[i], t)`; the first turn's
    seeding is the sampler's (the engines' per-prompt seeds). None: no turn passes seeds."""
    first = sample(prompts, group_size, min(options.max_turn_tokens, options.max_episode_tokens))
    for name, given in (("hosts", hosts), ("seeds", seeds)):
        if given is not None and len(given) != len(first):
            raise ValueError(f"run_episodes: {len(given)} {name} for {len(first)} episodes")
    episodes = [Episode(prompt=first.prompt_ids[i][first.prompt_mask[i].bool()].tolist(), host=h)
                for i, h in enumerate(hosts)]
    take_turn(episodes, range(len(episodes)), first, options, tokenizer)
    while active := [i for i, ep in enumerate(episodes) if not ep.done]:
        budgets = [min(options.max_turn_tokens, options.max_episode_tokens - len(episodes[i].ids)) for i in active]
        batch = [episodes[i].prompt + episodes[i].ids for i in active]
        own = {} if seeds is None else {"seeds": [turn_seed(seeds[i], episodes[i].turns) for i in active]}
        turn = sample(batch, 1, max(budgets), **own)
        take_turn(episodes, active, turn, options, tokenizer, budgets)
    return episode_rollout(first, episodes, tokenizer), episode_metrics(episodes)


def take_turn(episodes: list[Episode], rows, turn: Rollout, options: EpisodeOptions, tokenizer,
              budgets: list[int] | None = None) -> None:
    """Append each active episode's sampled turn (cut to its own budget), then its tools' replies: the
    calls of every episode run at once (each episode's own calls concurrently too, under the tool
    timeout), so a slow tool holds its episode only, for at most its timeout."""
    asking = []
    for j, i in enumerate(rows):
        ep = episodes[i]
        n = int(turn.response_mask[j].sum())
        cut = budgets is not None and n > budgets[j]
        if cut:  # the batch sampled up to the largest budget; this episode had less left
            n = budgets[j]
        ids = turn.response_ids[j, :n].tolist()
        # The text is read for tool calls and shown to rewards; the ids stay as sampled.
        text = tokenizer.decode(ids, skip_special_tokens=True) if cut else turn.completions[j]
        logps = turn.sample_logp[j, :n].tolist() if turn.sample_logp is not None else None
        calls = end_turn(ep, ids, logps, text, cut or bool(turn.truncated[j]), options)
        if calls:
            asking.append((ep, calls))
    if not asking:
        return
    with ThreadPoolExecutor(max_workers=min(len(asking), MAX_EPISODES_AT_ONCE)) as pool:
        replies = list(pool.map(lambda pair: pair[0].host.reply(pair[1]), asking))
    for (ep, calls), messages in zip(asking, replies):
        append_replies(ep, calls, messages, options)


def end_turn(ep: Episode, ids: list[int], logps: list[float] | None, text: str, cut: bool,
             options: EpisodeOptions) -> list:
    """Append a finished model turn (its ids as sampled, `text` read from them) and return the calls to
    run, or none and the end of the episode; `cut`: the turn ran out of its token budget."""
    ep.add(ids, by_model=True, logps=logps)
    ep.turns += 1
    ep.turn_ends.append(len(ep.ids) - 1 if ids else -1)
    ep.messages.append({"role": "assistant", "content": text})
    ep.cut = cut
    calls = tool_calls(ep, text, options)
    if not calls:  # nothing to answer: the turn is scored now (else once its replies are in, append_replies)
        score_turn(ep, [])
    return calls


def score_turn(ep: Episode, replies: list[dict]) -> None:
    """Score the model turn just ended, after its calls were answered (`replies`; empty when none ran): the
    host's `turn_reward()` where it gives one, else `tool_turn_score(replies)`."""
    own = getattr(ep.host, "turn_reward", None)
    value = own() if own is not None else None
    ep.turn_scores.append(tool_turn_score(replies) if value is None else float(value))


def tool_calls(ep: Episode, text: str, options: EpisodeOptions) -> list:
    """The calls of a finished model turn to run, or none and the end of the episode."""
    calls = [] if ep.cut else ep.host.calls_in(text)
    if not calls:
        ep.done = True
        return []
    if ep.turns >= options.max_turns:
        ep.done = ep.cut = True  # the model asked for a tool it has no turn left to read
        return []
    return calls


def append_replies(ep: Episode, calls: list, replies: list[dict], options: EpisodeOptions) -> None:
    """The tools' replies as the chat template writes them, unless they leave no room to answer."""
    appended = ep.host.append_ids(replies)
    ep.tool_calls += len(calls)
    ep.messages += replies
    score_turn(ep, replies)
    if len(ep.ids) + len(appended) >= options.max_episode_tokens:
        ep.done = ep.cut = True  # no room left for the model to read the reply and answer
        return
    ep.add(appended, by_model=False)


def episode_rollout(first: Rollout, episodes: list[Episode], tokenizer) -> Rollout:
    """The Rollout of whole episodes: the first turn's prompt rows, the episode as the response."""
    width = max((len(ep.ids) for ep in episodes), default=0)
    ids = torch.full((len(episodes), width), tokenizer.pad_token_id, dtype=torch.long)
    trained = torch.zeros((len(episodes), width))
    attended = torch.zeros((len(episodes), width))
    for row, ep in enumerate(episodes):
        n = len(ep.ids)
        ids[row, :n] = torch.tensor(ep.ids, dtype=torch.long)
        trained[row, :n] = torch.tensor(ep.sampled, dtype=torch.float)
        attended[row, :n] = 1.0
    sample_logp = None
    if episodes and all(ep.logps is not None for ep in episodes):
        sample_logp = torch.zeros((len(episodes), width))
        for row, ep in enumerate(episodes):
            sample_logp[row, :len(ep.logps)] = torch.tensor(ep.logps, dtype=torch.float)
    return Rollout(prompt_ids=first.prompt_ids, prompt_mask=first.prompt_mask, response_ids=ids,
                   response_mask=trained, response_attention=attended, group_ids=first.group_ids,
                   truncated=torch.tensor([ep.cut for ep in episodes], dtype=torch.bool),
                   completions=["".join(m["content"] for m in ep.messages if m["role"] == "assistant")
                                for ep in episodes],
                   example_index=list(first.example_index), messages=[ep.messages for ep in episodes],
                   sample_logp=sample_logp, turn_steps=[turn_steps(ep) for ep in episodes])


def turn_steps(ep: Episode) -> list[tuple[int, float]]:
    """(last token index in the response, score) of each model turn that sampled a token."""
    return [(end, score) for end, score in zip(ep.turn_ends, ep.turn_scores) if end >= 0]


def episode_metrics(episodes: list[Episode]) -> dict:
    """Per batch: model turns and tool calls per episode, the environment's share of the episode
    tokens, and the share of episodes a budget cut off."""
    n = max(len(episodes), 1)
    tokens = sum(len(ep.ids) for ep in episodes)
    env = sum(len(ep.ids) - sum(ep.sampled) for ep in episodes)
    return {"episode/turns_mean": sum(ep.turns for ep in episodes) / n,
            "episode/tool_calls_mean": sum(ep.tool_calls for ep in episodes) / n,
            "episode/env_token_frac": env / tokens if tokens else 0.0,
            "episode/cut_off_frac": sum(ep.cut for ep in episodes) / n}
