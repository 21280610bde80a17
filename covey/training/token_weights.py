"""What acts on single tokens before the update, decided once per rollout over every rank's tokens:
the sampler correction (algo.tis.*), the high-entropy tokens (algo.top_entropy_quantile),
the covariance control (algo.cov_control) and the entropy bonus's coefficient (algo.adaptive_entropy).

Each runs after the advantages and before `update`, on the quantities of the policy that sampled the
rollout (pi_old: its log-probs and entropies from the log-prob pass), so the choice of tokens is made
over the whole batch and never depends on the micro-batch size or the number of processes; on the
rollout's first optimizer step (the only one with algo.epochs = algo.minibatches = 1) pi_old is the
policy being trained, so these are the current policy's entropies and log-probs, as in the papers.
None of them touches `Rollout.advantages`: the importance weights go to `Rollout.is_weights`, the
high-entropy tokens to `Rollout.kept_tokens`, the covariance control's to `Rollout.cov_tokens`, and the
policy loss reads each as its registry trait says (covey.algos.loss_registry.WEIGHT_USES; the plan refuses
a pair that means nothing).
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist

from covey import algos
from covey.batch import Rollout
from covey.runtime.dist import all_reduce, gather_rows, world_size


def make_entropy_controller(plan):
    """Skywork-OR1's adaptive controller when algo.adaptive_entropy, else the fixed algo.entropy_coef."""
    t, coef = plan.tokens, plan.update.entropy_coef
    ent = t.adaptive_entropy
    if ent.enabled:
        return algos.AdaptiveEntropyController(coef, ent.target, ent.coef_delta, ent.coef_max)
    return algos.FixedEntropyController(coef)


def on_global_batch(fn, **rows):
    """`fn(**rows)` -> ((N, L) tensor, metrics) on the rows of every rank (gathered in rank order); this
    rank's rows of the tensor back. In one process, `fn(**rows)`."""
    if world_size() == 1:
        return fn(**rows)
    first = next(iter(rows.values()))
    n, width, rank = first.shape[0], first.shape[1], dist.get_rank()
    every = gather_rows({**rows, "rank": torch.full((n,), rank)})
    ranks = every.pop("rank")
    out, metrics = fn(**every)
    start = int((ranks < rank).sum())
    return out[start:start + n, :width], metrics


def correct_sampler_mismatch(run, rollout: Rollout) -> dict:
    """Importance sampling (algo.tis.cap, .mode, .min): the engine sampled with its own kernels or weight copy,
    so each token gets its mode's bounded pi_old/pi_sampler (no gradient, >= 0) in `rollout.is_weights`."""
    tis = run.plan.tokens.tis
    if not tis.cap:
        return {}
    sampler_logp = getattr(rollout, "sample_logp", None)
    if sampler_logp is None:
        raise RuntimeError("algo.tis.cap is set but the engine returned no sampling log-probs")
    weights, metrics = algos.importance_weights(rollout.old_logp, sampler_logp, rollout.response_mask,
                                                tis.cap, tis.mode, tis.min)
    rollout.is_weights = weights
    return metrics


def selection_seed(seed: int, step: int) -> int:
    """The seed of step `step`'s random choice of tokens: the same on every rank and on a resumed run."""
    return (seed * 1_000_003 + 7_919 * (step + 1)) % (2**63 - 1)


def select_tokens(run, rollout: Rollout) -> dict:
    """High-entropy tokens (`rollout.kept_tokens`) and the covariance control's tokens (`rollout.cov_tokens`),
    each over the whole rollout of every rank. The covariance is that of the advantage each token's policy
    term carries: A_t times its importance weight and its selection."""
    t, metrics = run.plan.tokens, {}
    mask = rollout.response_mask
    if t.top_entropy_quantile < 1.0:
        kept, found = on_global_batch(functools.partial(algos.high_entropy_mask, quantile=t.top_entropy_quantile),
                                      entropy=rollout.old_entropy, response_mask=mask)
        rollout.kept_tokens = kept
        metrics.update(found)
    if t.cov.control != "none":
        carried = rollout.advantages
        if rollout.is_weights is not None:
            carried = carried * rollout.is_weights
        if rollout.kept_tokens is not None:
            carried = carried * rollout.kept_tokens.to(carried.dtype)
        generator = torch.Generator().manual_seed(selection_seed(run.plan.schedule.seed, run.step))
        chosen, found = on_global_batch(functools.partial(algos.select_cov_tokens, opts=t.cov, generator=generator),
                                        advantages=carried, logp=rollout.old_logp, response_mask=mask)
        rollout.cov_tokens = chosen
        metrics.update(found)
    return metrics


def observe_entropy(run, rollout: Rollout) -> dict:
    """Adaptive entropy control: the rollout's mean token entropy under pi_old (every rank's tokens) sets
    this step's coefficient and moves the next one. Metrics: policy/entropy_coef, and with the adaptive
    controller select/rollout_entropy."""
    controller = run.entropy_controller
    if not run.plan.tokens.adaptive_entropy.enabled:
        return {"policy/entropy_coef": controller.value} if controller.value else {}
    mask = rollout.response_mask.bool()
    totals = torch.stack([rollout.old_entropy.double()[mask].sum(), mask.sum().double()])
    total, count = (float(v) for v in all_reduce(totals))
    entropy = total / max(count, 1.0)
    controller.observe(entropy)
    return {"policy/entropy_coef": controller.value, "select/rollout_entropy": entropy}
