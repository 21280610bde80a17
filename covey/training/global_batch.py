"""What makes W ranks compute one global batch: the same prompts, samples, advantages and loss.

So that W processes compute what one process computes on the same B prompts (the tests in
tests/training/test_torchrun.py and, with tool episodes, tests/training/test_torchrun_tools.py):

1. prompts: every rank draws the same B ids from the same seeded PromptStream and keeps
   a contiguous share of B/W prompts; a prompt's G samples stay on one rank (`draw_share`);
2. samples: with ``rollout.seeding=per_prompt`` each group is sampled from its own seed
   (run seed, draw index of the prompt in the shuffled stream), so what is drawn does not
   depend on how the batch is split (with ``global`` it does: each rank has its own RNG);
3. advantages: computed on the gathered global batch (`global_advantages`), exact also for
   batch-wide whitening (REINFORCE++) and reward-side statistics;
4. loss: one ``Normalizer`` per optimizer step from all-reduced totals, times W
   because FSDP averages gradients over ranks (docs/algorithms.md, Aggregation);
5. mini-batches: each rank shuffles its own share; with ``algo.minibatches=1`` the
   optimizer steps see exactly the global batch, with more they see other (equally
   valid) splits than a single process would;
6. tool episodes: each rank runs its own groups' episodes (tools, environments); their metrics
   come from sums over every rank (`global_episode_metrics`);
7. the update's rows: after the advantages, handed out again so each rank trains about as many
   tokens (covey.training.balance, train.balance_ranks); the gradient is a sum over rows.

Generation with a local engine, tool episodes included, reads the sharded policy on whole
parameters (`GatheredGeneration`); checkpoints are written by rank 0 from whole tensors (`save_on_main`).
In one process every function here is a pass-through.
"""

from __future__ import annotations

import contextlib
import dataclasses
from types import SimpleNamespace
from typing import Sequence

import torch
import torch.distributed as dist
from torch import Tensor, nn

from covey import algos
from covey.batch import Rollout
from covey.rollout.base import Engine, EngineWrapper, Prompt
from covey.runtime.dist import World, all_reduce, barrier, gather_rows, is_main_process, rank_share, world_size
from covey.runtime.fsdp import (
    FullStateModel,
    FullStateOptimizer,
    fsdp_modules,
    full_optimizer_state,
    full_state_dict,
    unsharded,
)

# --------------------------------------------------------------------------- prompts and samples


def draw_share(stream, count: int, world: World) -> tuple[list[int], list[int]]:
    """This rank's prompt ids among the next `count` of the stream, and their absolute draw indices.

    Every rank draws the same global batch (same seeded stream); the draw index (position in
    the endless shuffled stream) names a prompt draw uniquely across steps and resampling rounds.
    """
    first = stream.epoch * stream.size + stream.position
    ids = stream.next(count)
    return rank_share(ids, world), rank_share(list(range(first, first + count)), world)


def prompt_seed(run_seed: int, draw: int) -> int:
    return (run_seed * 1_000_003 + draw) % (2**63 - 1)


class GatheredGeneration(EngineWrapper):
    """An engine that reads the (FSDP-sharded) policy itself, run on whole parameters.

    Generation runs a different number of forward passes on each rank; with sharded
    layers each would all-gather and the ranks would deadlock. Without FSDP this is a
    plain pass-through.
    """

    def __init__(self, engine: Engine, policy: nn.Module):
        super().__init__(engine)
        self.policy = policy

    def generate(self, prompts: list[Prompt], group_size: int, *, greedy: bool = False,
                 max_new_tokens: int | None = None, seeds: list[int] | None = None,
                 budgets: Sequence[int] | None = None) -> Rollout:
        """Under FSDP the parameters are gathered once for the whole call (every seeded group of it)."""
        with unsharded(self.policy):
            return super().generate(prompts, group_size, greedy=greedy, max_new_tokens=max_new_tokens, seeds=seeds,
                                    budgets=budgets)

    def decode_episodes(self, prompts: list[Prompt], group_size: int, hosts: list, options, *,
                        greedy: bool = False, seeds: list[int] | None = None) -> tuple[Rollout, dict]:
        """The fast engine's loop of whole tool episodes (covey/rollout/fast_episodes.py), whose decode
        steps differ between ranks as well (held-out evaluation, greedy baselines, seeding=global)."""
        with unsharded(self.policy):
            return super().decode_episodes(prompts, group_size, hosts, options, greedy=greedy, seeds=seeds)


# --------------------------------------------------------------------------- advantages and loss normaliser


def global_normalizer(mode: str, step_mask: Tensor, max_len: int) -> algos.Normalizer:
    """The optimizer step's normaliser over every rank's sequences (all-reduced totals). `step_mask`
    is the step's `response_mask`: tokens are counted where they are trained (the model's tokens,
    never an episode's environment tokens).

    Multiplied by the number of processes inside `aggregate`, because FSDP averages
    the gradients of the ranks: the average of W scaled shares is the global loss.
    """
    size = world_size()
    if size == 1:
        return algos.make_normalizer(mode, step_mask, max_len=max_len)
    tokens, seqs = (float(v) for v in all_reduce(algos.step_totals(step_mask)))
    return algos.Normalizer.from_totals(mode, tokens, seqs, max_len, num_processes=size)


def global_advantages(name: str, inp: algos.AdvantageInput, opts: algos.AdvantageOptions):
    """`algos.compute_advantages` on the batch of all ranks; returns this rank's rows.

    Group-relative estimators would be exact per rank (groups are whole), but batch-wide
    whitening (REINFORCE++, normalize=batch|global_token) needs every rank's sequences.
    """
    if world_size() == 1:
        return algos.compute_advantages(name, inp, opts)
    rows = {f.name: getattr(inp, f.name) for f in dataclasses.fields(inp)
            if getattr(inp, f.name) is None or isinstance(getattr(inp, f.name), Tensor)}
    if rows.get("step_scores") is not None and rows.get("step_mask") is None:
        rows["step_mask"] = torch.ones_like(rows["step_scores"], dtype=torch.bool)  # padded steps become 0
    rows["rank"] = torch.full((len(inp.scores),), dist.get_rank())
    every = gather_rows(rows)
    ranks = every.pop("rank")
    every["group_ids"] = every["group_ids"] + ranks * (int(every["group_ids"].max()) + 1)  # one rank's group
    adv, ret, metrics = algos.compute_advantages(name, dataclasses.replace(inp, **every), opts)
    start = int((ranks < dist.get_rank()).sum())
    mine, width = slice(start, start + len(inp.scores)), inp.response_mask.shape[1]
    return adv[mine, :width], ret[mine, :width], metrics


def global_batch_view(rollout) -> SimpleNamespace:
    """What rollout metrics read (scores, reward parts, masks, truncation), gathered from all ranks."""
    fields = {"scores": rollout.scores, "response_mask": rollout.response_mask, "truncated": rollout.truncated,
              **{f"part/{k}": v for k, v in rollout.reward_parts.items()}}
    every = gather_rows(fields)
    parts = {k.removeprefix("part/"): v for k, v in every.items() if k.startswith("part/")}
    return SimpleNamespace(scores=every["scores"], response_mask=every["response_mask"],
                           truncated=every["truncated"], reward_parts=parts)


def global_episode_metrics(engine: Engine) -> dict:
    """An engine of tool episodes: its episode and tool metrics (`take_metrics`) over every rank's episodes,
    from all-reduced sums, so W ranks log what one process logs on the same episodes; {} for another
    engine. Every rank calls it at the same point (after sampling, after an evaluation)."""
    return engine.take_metrics(total=all_reduce)


def decorrelate_ranks(world: World, seed: int, step: int) -> None:
    """seeding=global under torchrun: each rank continues its own torch stream (seed, step, rank).

    Every rank starts from the same seed (the models must initialise identically); left
    so, all ranks would drive their different prompts with the same random numbers.
    """
    if world.distributed:
        torch.manual_seed(prompt_seed(seed, (step + 1) * 1_000_003 + world.rank))


# --------------------------------------------------------------------------- checkpoints from whole tensors


@contextlib.contextmanager
def whole_tensors(run, gather: bool):
    """Within the block, `run`'s models and optimizers show whole tensors (a no-op without FSDP).

    gather=True (saving): every rank joins the all-gathers, rank 0 holds the full CPU states.
    gather=False (resuming): full states read from disk are loaded into each rank's shards.
    """
    names = [n for n in ("policy", "critic", "reference")
             if getattr(run, n) is not None and fsdp_modules(getattr(run, n))]
    if not names:
        yield run
        return
    saved = {n: getattr(run, n) for n in (*names, "optimizer", "critic_optimizer")}
    for name in names:
        setattr(run, name, FullStateModel(saved[name], full_state_dict(saved[name]) if gather else None))
    for opt_name, model_name in (("optimizer", "policy"), ("critic_optimizer", "critic")):
        if saved.get(opt_name) is not None and model_name in names:
            model, opt = saved[model_name], saved[opt_name]
            full = full_optimizer_state(model, opt) if gather else None
            setattr(run, opt_name, FullStateOptimizer(model, opt, full))
    try:
        yield run
    finally:
        for name, value in saved.items():
            setattr(run, name, value)


def save_on_main(run, write):
    """`write(run)` on rank 0 from whole tensors (its result; None elsewhere); every rank joins the gathers."""
    with whole_tensors(run, gather=True):
        path = write(run) if is_main_process() else None
    barrier()
    return path
