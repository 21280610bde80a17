"""Partial rollouts across steps (rollout.partial.*): a step trains on the groups that have ended; the rest go on.

Each step decodes B + extra groups through the fast engine's slots (`Engine.generate_until`): the groups
carried from earlier steps, oldest first, then new prompts drawn from the stream. The call stops once B groups
have ended (every row at its end of sequence or budget) and every group carried `max_age` times has. The
step trains on all the groups that ended; the rows still going are cut, and their groups are carried to the
next step, under the next step's weights (APRIL, Zhou et al. 2025, arXiv:2509.18521; the partial rollouts of
Kimi k1.5, 2025, arXiv:2501.12599).

A carried row goes on from its prompt and its own tokens so far, re-encoded under the new weights: its
earlier tokens keep the log-probs they were sampled with (`sample_logp`), so the sampler correction
(algo.tis.cap, which the plan requires) weights them by pi_old / mu like any token sampled from another
policy. Its ended siblings wait with it: a group's advantages compare all G rows.

The pool of carried groups is checkpointed with each row's tokens, log-probs and state and each group's age
and draw; a row's uniforms come from the global stream (checkpointed) or, with rollout.seeding=per_prompt,
from a seed of (run seed, draw, row, age): a resumed run samples what the uninterrupted one samples.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import torch

from covey.batch import Rollout
from covey.config import ConfigError
from covey.rollout.base import Quorum
from covey.training.global_batch import draw_share, prompt_seed


@dataclass
class CarriedGroup:
    """One prompt's G rows between steps."""
    example: int
    """Index of the prompt in the task's examples."""
    draw: int
    """The prompt's draw index in the stream (its seeds)."""
    prompt: list[int]
    """The prompt's token ids."""
    tokens: list[list[int]]
    """Each row's tokens so far."""
    logps: list[list[float]]
    """The sampler's log-prob of each of them, under the weights it was drawn with."""
    ended: list[bool]
    """Each row has ended (end of sequence or budget)."""
    truncated: list[bool] = field(default_factory=list)
    """Each ended row reached its budget without an end of sequence."""
    age: int = 0
    """Steps the group has been carried."""
    carried_tokens: int = 0
    """Tokens it held at the start of this step (sampled under earlier weights)."""


class CarryPool:
    """The groups carried to the next step (a checkpoint holds them: `state_dict`)."""

    def __init__(self):
        self.groups: list[CarriedGroup] = []

    def state_dict(self) -> dict:
        return {"groups": [asdict(g) for g in self.groups]}

    def load_state_dict(self, state: dict) -> None:
        self.groups = [CarriedGroup(**g) for g in state["groups"]]


def row_seed(run_seed: int, draw: int, row: int, age: int) -> int:
    """rollout.seeding=per_prompt: the seed of row `row` of the prompt drawn `draw`-th, in its age-th call."""
    return (prompt_seed(run_seed, draw) * 1_000_003 + row * 1_009 + age) % (2**63 - 1)


def sample_partial(run, engine, prompts: list[str]) -> tuple[Rollout, dict]:
    """This step's ended groups (example_index into the task's examples) and the partial/* metrics."""
    if run.world.size > 1:
        raise ConfigError("rollout.partial.extra needs one process: carried groups are not shared across ranks yet")
    sampling, pool = run.plan.sampling, run.carried
    want, group_size = sampling.prompts_per_step, sampling.group_size
    ids, draws = draw_share(run.stream, max(want + sampling.partial.extra - len(pool.groups), 0), run.world)
    encode = run.tokenizer(([prompts[i] for i in ids]), add_special_tokens=False)["input_ids"] if ids else []
    fresh = [CarriedGroup(example=i, draw=d, prompt=list(p), tokens=[[] for _ in range(group_size)],
                          logps=[[] for _ in range(group_size)], ended=[False] * group_size,
                          truncated=[False] * group_size) for i, d, p in zip(ids, draws, encode)]
    groups = pool.groups + fresh  # the oldest take the slots first
    for g in groups:
        g.carried_tokens = sum(len(t) for t in g.tokens)
    rows = [(k, j) for k, g in enumerate(groups) for j in range(group_size) if not g.ended[j]]
    must = frozenset(k for k, g in enumerate(groups) if g.age >= sampling.partial.max_age)
    seeds = None
    if sampling.seeding == "per_prompt":
        seeds = [row_seed(run.plan.schedule.seed, groups[k].draw, j, groups[k].age) for k, j in rows]
    out = engine.generate_until([groups[k].prompt + groups[k].tokens[j] for k, j in rows],
                                Quorum(groups=[k for k, _ in rows], needed=min(want, len(groups)), must=must),
                                budgets=[sampling.max_new_tokens - len(groups[k].tokens[j]) for k, j in rows],
                                seeds=seeds)
    for n, (k, j) in enumerate(rows):
        g, count = groups[k], int(out.response_mask[n].sum())
        g.tokens[j] += out.response_ids[n, :count].tolist()
        g.logps[j] += out.sample_logp[n, :count].tolist()
        if not bool(out.cut[n]):
            g.ended[j], g.truncated[j] = True, bool(out.truncated[n])
    done = [g for g in groups if all(g.ended)]
    pool.groups = [g for g in groups if not all(g.ended)]
    for g in pool.groups:
        g.age += 1
    metrics = {**partial_metrics(done, pool, len(must)), "partial/sampled_tokens": float(out.response_mask.sum())}
    return ended_rollout(done, run.tokenizer), metrics


def ended_rollout(groups: list[CarriedGroup], tokenizer) -> Rollout:
    """The ended groups as a step's rollout: prompts left-padded, each row's whole answer right-padded, the
    sampler's log-probs of every token (the earlier steps' included)."""
    rows = [(k, j) for k, g in enumerate(groups) for j in range(len(g.tokens))]
    pad = tokenizer.pad_token_id
    width = max((len(g.prompt) for g in groups), default=1)
    length = max((len(g.tokens[j]) for g in groups for j in range(len(g.tokens))), default=1)
    prompt_ids = torch.full((len(rows), width), pad, dtype=torch.long)
    prompt_mask = torch.zeros((len(rows), width), dtype=torch.long)
    response_ids = torch.full((len(rows), length), pad, dtype=torch.long)
    response_mask = torch.zeros((len(rows), length))
    logp = torch.zeros((len(rows), length))
    for n, (k, j) in enumerate(rows):
        g, count = groups[k], len(groups[k].tokens[j])
        prompt_ids[n, width - len(g.prompt):] = torch.tensor(g.prompt, dtype=torch.long)
        prompt_mask[n, width - len(g.prompt):] = 1
        response_ids[n, :count] = torch.tensor(g.tokens[j], dtype=torch.long)
        response_mask[n, :count] = 1.0
        logp[n, :count] = torch.tensor(g.logps[j])
    return Rollout(prompt_ids=prompt_ids, prompt_mask=prompt_mask, response_ids=response_ids,
                   response_mask=response_mask, group_ids=torch.tensor([k for k, _ in rows], dtype=torch.long),
                   truncated=torch.tensor([groups[k].truncated[j] for k, j in rows], dtype=torch.bool),
                   completions=tokenizer.batch_decode(response_ids, skip_special_tokens=True),
                   example_index=[groups[k].example for k, _ in rows], sample_logp=logp)


def partial_metrics(done: list[CarriedGroup], pool: CarryPool, forced: int) -> dict:
    """What carrying did this step (docs/metrics.md)."""
    tokens = sum(len(t) for g in done for t in g.tokens)
    return {
        "partial/trained_groups": float(len(done)),
        "partial/carried_groups": float(len(pool.groups)),
        "partial/carried_rows": float(sum(not e for g in pool.groups for e in g.ended)),
        "partial/forced_groups": float(forced),
        "partial/old_token_frac": sum(g.carried_tokens for g in done) / max(tokens, 1),
        "partial/max_age": float(max((g.age for g in done), default=0)),
    }
