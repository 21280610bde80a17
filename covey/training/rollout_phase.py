"""The first half of a step: sample B prompts x G completions, score them, refill uninformative groups.

`collect_rollout` draws this rank's share of the step's prompts (covey.training.global_batch),
samples a group per prompt, scores every completion, and, for an estimator whose baseline is
the reward of a greedy answer (its `greedy_baseline` trait: ReMax, Li et al. 2023,
arXiv:2310.10505), scores one greedy answer per prompt as well. With algo.dynamic_sampling
(DAPO, Yu et al. 2025, arXiv:2503.14476) groups whose rewards all tie are dropped and more
prompts are sampled until B informative groups or the round limit.
"""

from __future__ import annotations

import time

import torch

from covey.batch import Rollout, concat_rollouts
from covey.rewards.combine import TrainerState
from covey.rewards.scoring import score
from covey.rollout.base import Engine
from covey.runtime.memory import halving_on_oom
from covey.training.global_batch import draw_share, global_episode_metrics, prompt_seed
from covey.training.partial import sample_partial
from covey.training.setup import Run


def collect_rollout(run: Run, engine, rewarder, examples, prompts) -> tuple[Rollout, dict]:
    """One batch of scored samples; with dynamic sampling, only informative groups, refilled."""
    timings = {"time/generate": 0.0, "time/score": 0.0}
    rollout, metrics = sample_and_score(run, engine, rewarder, examples, prompts, timings)
    groups = max(len(rollout.group_ids.unique()), 1)  # none: every harness episode was dropped
    metrics["groups/zero_std_frac"] = 1 - len(informative_groups(rollout)) / groups
    if "correctness" in rollout.reward_parts:  # the verifier's share of right samples; no verifier, no accuracy
        metrics["accuracy"] = float(rollout.reward_parts["correctness"].mean())
    if run.plan.sampling.dynamic_sampling:
        rollout, metrics["groups/resampled"] = refill_groups(run, rollout, engine, rewarder, examples, prompts,
                                                             timings)
    rollout = drop_invalid(rollout)
    episodes = global_episode_metrics(engine)  # an engine of tool-calling episodes: turns, calls, errors
    return rollout, {**metrics, **episodes, **timings}


def sample_and_score(run: Run, engine, rewarder, examples, prompts, timings: dict) -> tuple[Rollout, dict]:
    """Draw B prompts (this rank's share of them), sample G completions each, score them."""
    t0 = time.perf_counter()
    rollout, metrics = sample_prompts(run, engine, prompts)
    timings["time/generate"] += time.perf_counter() - t0
    t0 = time.perf_counter()
    state = TrainerState(global_step=run.step, max_steps=run.plan.schedule.steps)
    metrics.update(score(rollout, rewarder, examples, prompts, state, watch=True))  # reward.max_failed_steps counts
    if run.plan.traits.greedy_baseline:
        first = dict(zip(reversed(rollout.group_ids.tolist()), reversed(rollout.example_index)))
        ids = [first[g] for g in sorted(first)]  # each group's prompt, in group order
        t1 = time.perf_counter()
        greedy = engine.generate([prompts[i] for i in ids], 1, greedy=True)
        greedy.example_index = [ids[i] for i in greedy.example_index]
        timings["time/generate"] += time.perf_counter() - t1
        score(greedy, rewarder, examples, prompts, state)
        rollout.baseline_scores = greedy.scores[rollout.group_ids]
    timings["time/score"] += time.perf_counter() - t0
    return rollout, metrics


def sample_prompts(run: Run, engine, prompts) -> tuple[Rollout, dict]:
    """B prompts (this rank's share of them) and G samples of each, example_index into the task's examples; with
    rollout.partial, the groups that ended this step (covey/training/partial.py)."""
    sampling = run.plan.sampling
    if sampling.partial.extra:
        return sample_partial(run, engine, prompts)
    ids, draws = draw_share(run.stream, sampling.prompts_per_step, run.world)
    seeds = [prompt_seed(run.plan.schedule.seed, d) for d in draws] if sampling.seeding == "per_prompt" else None
    rollout = halving_on_oom("generate", run.micro_batches, lambda per_call: sample_in_calls(
        engine, [prompts[i] for i in ids], sampling.group_size, seeds, per_call), run.world.device)
    rollout.example_index = [ids[i] for i in rollout.example_index]
    return rollout, {}


def sample_in_calls(engine, prompts: list[str], group_size: int, seeds: list[int] | None, per_call: int) -> Rollout:
    """G samples of each prompt, `per_call` prompts per generate call (fewer after an out-of-memory).

    With rollout.seeding=per_prompt each group has its own seed, so the samples are the same
    however the prompts are split; with one global stream they are new draws of the same
    distribution.
    """
    if per_call >= len(prompts):
        return engine.generate(prompts, group_size, seeds=seeds)
    parts = []
    for start in range(0, len(prompts), per_call):
        part = engine.generate(prompts[start:start + per_call], group_size,
                               seeds=seeds[start:start + per_call] if seeds is not None else None)
        part.example_index = [start + i for i in part.example_index]
        parts.append(part)
    return concat_rollouts(parts, engine.tokenizer.pad_token_id)


def informative_groups(rollout: Rollout) -> torch.Tensor:
    """Group ids whose rewards are not all equal (DAPO dynamic sampling keeps these)."""
    gids, inverse = rollout.group_ids.unique(return_inverse=True)
    lo = torch.full((len(gids),), float("inf")).scatter_reduce(0, inverse, rollout.scores, "amin")
    hi = torch.full((len(gids),), float("-inf")).scatter_reduce(0, inverse, rollout.scores, "amax")
    return gids[hi > lo]


def keep_informative(rollout: Rollout) -> Rollout:
    return rollout.select(torch.isin(rollout.group_ids, informative_groups(rollout)).nonzero().squeeze(1))


def refill_groups(run: Run, rollout: Rollout, engine, rewarder, examples, prompts, timings) -> tuple[Rollout, int]:
    """Keep informative groups; sample more prompts until B groups or the round limit.

    Returns the rollout and the number of extra prompts sampled. If the limit is
    reached with fewer than B groups, the step trains on what it has (the loss
    normaliser is global, so a smaller batch is still an unbiased estimate).
    """
    want = run.plan.sampling.prompts_per_step
    parts = [keep_informative(rollout)]
    kept, resampled = len(informative_groups(rollout)), 0
    for _ in range(run.plan.sampling.max_resample_rounds):
        if kept >= want:
            break
        extra, _ = sample_and_score(run, engine, rewarder, examples, prompts, timings)
        resampled += want
        parts.append(keep_informative(extra))
        kept += len(informative_groups(extra)) if len(parts[-1]) else 0
    nonempty = [p for p in parts if len(p)]
    if not nonempty:  # nothing informative at all: train on the original batch
        return rollout, resampled
    merged = concat_rollouts(nonempty, run.tokenizer.pad_token_id)
    first_groups = merged.group_ids.unique()[:want]
    return merged.select(torch.isin(merged.group_ids, first_groups).nonzero().squeeze(1)), resampled


def drop_invalid(rollout: Rollout) -> Rollout:
    """reward.on_error=drop: remove faulty samples from their groups."""
    if rollout.valid is None or bool(rollout.valid.all()):
        return rollout
    return rollout.select(rollout.valid.nonzero().squeeze(1))


def release_sampling_copy(engine: Engine) -> None:
    """A bf16 sampling copy (covey/rollout/precision.py) is not read again before the engine's
    `sync_weights` refreshes it: free it for the reference pass and the update, where a step's memory peaks."""
    engine.release_weights()
