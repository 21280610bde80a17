"""An episode's recorded calls as one episode row, and rows as a Rollout.

The policy server (covey/serve/) records each call of an episode: its prompt ids, and per choice the
completion ids the engine sampled with the sampler's log-prob of each. A multi-turn episode is a chain
of calls, each continuing the last: call k's prompt ids start with call k-1's prompt ids followed by the
ids of one of its choices. `episode_row` turns such a chain into one row:

    prompt    the first call's prompt ids (the row's prompt: attended, never trained)
    response  for each call, the ids of the choice the next call continues (the last call: its one
              choice) - the model's tokens: trained (mask 1), with their sampler log-probs - then the
              ids the next call's prompt adds after them - the environment's tokens (a tool's reply,
              the chat template's turn markers): attended, not trained (mask 0, log-prob 0)

No id is decoded and encoded again: every id of the row is an id the server recorded. A call whose
prompt does not extend the previous call's prompt and completion cannot be one row with it (the
environment rewrote the conversation): it is refused with one line naming the episode and the call.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from covey.batch import Rollout


class EpisodeCallsError(ValueError):
    """An episode's calls that do not make one row (none, a chain that breaks, several last choices)."""


@dataclass
class EpisodeRow:
    """One episode as a row: `ids` is every id after the prompt, `trained` 1 on the model's ids and 0 on the
    environment's, `logps` the sampler's log-prob of each model id (0 on the environment's; None when a call
    returned none), `turn_starts` / `turn_ends` the index in `ids` of each model turn's first / last token
    (an empty turn ends at -1)."""

    episode: str
    prompt_ids: list[int]
    ids: list[int] = field(default_factory=list)
    trained: list[int] = field(default_factory=list)
    logps: list[float] | None = field(default_factory=list)
    turn_starts: list[int] = field(default_factory=list)
    turn_ends: list[int] = field(default_factory=list)
    finish_reason: str = "stop"

    @property
    def turns(self) -> int:
        return len(self.turn_ends)

    @property
    def truncated(self) -> bool:
        """The last turn ran out of tokens before its end token."""
        return self.finish_reason == "length"

    @property
    def model_ids(self) -> list[list[int]]:
        """Each model turn's ids."""
        return [self.ids[start:end + 1] if end >= 0 else [] for start, end in zip(self.turn_starts, self.turn_ends)]

    def add(self, ids: list[int], by_model: bool, logps: list[float] | None = None) -> None:
        self.ids += ids
        self.trained += [int(by_model)] * len(ids)
        if by_model and logps is None:
            self.logps = None
        elif self.logps is not None:
            self.logps += [float(v) for v in logps] if by_model else [0.0] * len(ids)


def common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    return next((i for i in range(n) if a[i] != b[i]), n)


def continued_choice(context: list[int], call: dict, following: list[int], episode: str, index: int) -> dict:
    """The choice of `call` (call `index`, whose prompt is `context`) that the next call's prompt ids
    `following` continue; EpisodeCallsError naming the call where none is."""
    best, at = 0, -1
    for choice in call["choices"]:
        expected = context + list(choice["completion_ids"])
        same = common_prefix(expected, following)
        if same == len(expected):
            return choice
        best, at = (len(expected), same) if same > at else (best, at)
    raise EpisodeCallsError(
        f"episode {episode!r}: call {index + 1}'s prompt ({len(following)} tokens) does not extend call {index}'s "
        f"prompt and completion ({best} tokens): they first differ at token {at}; an environment that rewrites "
        "earlier turns makes a new episode")


def episode_row(calls: list[dict], episode: str) -> EpisodeRow:
    """The row of an episode's calls in order (each {"prompt_ids", "choices": [{"completion_ids", "logprobs",
    "finish_reason"}]}, as `PolicyServer.take_episode` gives them; see the module docstring)."""
    if not calls:
        raise EpisodeCallsError(f"episode {episode!r}: no calls recorded (the environment never asked the model)")
    row = EpisodeRow(episode=episode, prompt_ids=list(calls[0]["prompt_ids"]))
    context = list(row.prompt_ids)
    for index, call in enumerate(calls):
        if index + 1 < len(calls):
            following = list(calls[index + 1]["prompt_ids"])
            choice = continued_choice(context, call, following, episode, index)
        else:
            if len(call["choices"]) != 1:
                raise EpisodeCallsError(f"episode {episode!r}: call {index} (the last) has {len(call['choices'])} "
                                        "choices; a row follows one (send n=1)")
            choice, following = call["choices"][0], None
        ids = list(choice["completion_ids"])
        row.turn_starts.append(len(row.ids))
        row.add(ids, by_model=True, logps=choice.get("logprobs"))
        row.turn_ends.append(len(row.ids) - 1 if ids else -1)
        row.finish_reason = choice.get("finish_reason") or "stop"
        context += ids
        if following is not None:
            row.add(following[len(context):], by_model=False)
            context = following
    return row


def rows_rollout(rows: list[EpisodeRow], groups: list[int], tokenizer, messages: list[list[dict]] | None = None,
                 completions: list[str] | None = None) -> Rollout:
    """The Rollout of episode rows: prompts left-padded, responses right-padded; `response_mask` the model's
    ids, `response_attention` every id of the episode, `sample_logp` the sampler's log-probs (None unless
    every row has them). `groups`: each row's prompt index in the batch (its group and `example_index`);
    `completions`: each row's assistant text (default: its model turns decoded, special tokens removed)."""
    n, pad = len(rows), tokenizer.pad_token_id
    p_len = max((len(r.prompt_ids) for r in rows), default=0)
    l_len = max((len(r.ids) for r in rows), default=0)
    prompt_ids = torch.full((n, p_len), pad, dtype=torch.long)
    prompt_mask = torch.zeros((n, p_len), dtype=torch.long)
    response_ids = torch.full((n, l_len), pad, dtype=torch.long)
    trained, attended = torch.zeros((n, l_len)), torch.zeros((n, l_len))
    with_logps = bool(rows) and all(r.logps is not None for r in rows)
    sample_logp = torch.zeros((n, l_len)) if with_logps else None
    for i, r in enumerate(rows):
        if r.prompt_ids:
            prompt_ids[i, p_len - len(r.prompt_ids):] = torch.tensor(r.prompt_ids, dtype=torch.long)
            prompt_mask[i, p_len - len(r.prompt_ids):] = 1
        k = len(r.ids)
        if k:
            response_ids[i, :k] = torch.tensor(r.ids, dtype=torch.long)
            trained[i, :k] = torch.tensor(r.trained, dtype=torch.float)
            attended[i, :k] = 1.0
            if sample_logp is not None:
                sample_logp[i, :k] = torch.tensor(r.logps, dtype=torch.float)
    if completions is None:
        completions = ["".join(tokenizer.decode(t, skip_special_tokens=True) for t in r.model_ids) for r in rows]
    return Rollout(prompt_ids=prompt_ids, prompt_mask=prompt_mask, response_ids=response_ids, response_mask=trained,
                   response_attention=attended, group_ids=torch.tensor(groups, dtype=torch.long).reshape(n),
                   truncated=torch.tensor([r.truncated for r in rows], dtype=torch.bool).reshape(n),
                   completions=completions, example_index=list(groups), messages=messages, sample_logp=sample_logp)
