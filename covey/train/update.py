"""The optimisation phase of a step: mu epochs x mini-batches x micro-batches.

Each optimizer step builds one global `Normalizer` from the masks of its whole
mini-batch, so summing micro-batch losses gives exactly the mini-batch loss:
the gradient does not depend on `micro_batch_size`.
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass

import torch

from covey import algos
from covey.batch import Rollout
from covey.passes.logprobs import critic_values, encode_prompts, on_device, policy_logprobs
from covey.runtime.dist import all_finite
from covey.runtime.fsdp import plain_norm
from covey.runtime.memory import MicroBatchSizes, halving_on_oom
from covey.runtime.precision import model_device, shared_weight_casts
from covey.train.global_batch import global_normalizer
from covey.train.plan import UpdateOptions


class NonFiniteError(RuntimeError):
    """Too many consecutive non-finite updates."""


@dataclass
class UpdateState:
    """Counters that outlive one step (saved in checkpoints)."""
    consecutive_skips: int = 0
    """Policy updates skipped in a row (reset by an applied update)."""
    critic_consecutive_skips: int = 0
    """Critic updates skipped in a row (a healthy critic must not hide a broken policy)."""
    skipped_steps: int = 0
    """All skipped updates so far (reported as optim/skipped_steps)."""


def minibatch_schedule(n: int, epochs: int, minibatches: int, generator: torch.Generator):
    """Yield index tensors, one per optimizer step: mu epochs of shuffled mini-batches.

    With a single mini-batch the order is kept (shuffling changes nothing).
    """
    size = n // minibatches
    for _ in range(epochs):
        order = torch.randperm(n, generator=generator) if minibatches > 1 else torch.arange(n)
        yield from order.split(size)


def by_prompt(batch: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
    """The mini-batch's rows ordered by prompt, so micro-batches hold whole groups whose prompt is
    encoded once (forward.prefix_shared_logprobs); the order inside a mini-batch leaves its gradient as is."""
    return batch[torch.argsort(group_ids[batch], stable=True)]


class MetricAverager:
    """Token-weighted mean of micro-batch metrics."""

    def __init__(self):
        self.sums = defaultdict(float)
        self.weights = defaultdict(float)

    def add(self, metrics: dict, weight: float) -> None:
        for k, v in metrics.items():
            if isinstance(v, (int, float)) and math.isfinite(v):
                self.sums[k] += v * weight
                self.weights[k] += weight

    def merge(self, other: "MetricAverager") -> None:
        for k in other.sums:
            self.sums[k] += other.sums[k]
            self.weights[k] += other.weights[k]

    def result(self) -> dict:
        return {k: self.sums[k] / self.weights[k] for k in self.sums if self.weights[k] > 0}


def micro_policy_loss(policy, part: Rollout, norm, opts: UpdateOptions, kl_coef: float,
                      prompts=None) -> tuple[torch.Tensor, dict]:
    """Loss of one micro-batch (already scaled by the global normaliser) and its metrics.

    `prompts`: the step's encoded prompts and this micro-batch's index into them (passes.logprobs.encode_prompts).
    """
    # Entropy is always reported; it enters the loss only when entropy_coef > 0.
    logp, entropy, width = policy_logprobs(policy, part, opts.temperature, with_entropy=True,
                                           precision=opts.autocast, prompts=prompts)
    mask = part.response_mask[:, :width]
    old = part.old_logp[:, :width] if part.old_logp is not None else logp.detach()
    ref = part.ref_logp[:, :width] if part.ref_logp is not None else None
    loss, metrics = algos.policy_loss(opts.policy_loss, logp, old, part.advantages[:, :width], mask, norm,
                                      opts.loss, ref_logp=ref)
    tokens = mask.sum().clamp(min=1)
    if ref is not None:
        kl = algos.kl_penalty(logp, ref, opts.kl_estimator)
        metrics["kl/ref"] = float((kl.detach() * mask).sum() / tokens)
        if opts.kl_in_loss and kl_coef > 0:
            kl_term = algos.aggregate(kl, mask, norm)
            loss = loss + kl_coef * kl_term
    if entropy is not None:
        metrics["policy/entropy"] = float((entropy.detach() * mask).sum() / tokens)
        if opts.entropy_coef > 0:
            loss = loss - opts.entropy_coef * algos.aggregate(entropy, mask, norm)
    return loss, metrics


def record_skip(state: UpdateState, max_skips: int, what: str, reason: str) -> None:
    """Count an update of `what` (policy | critic) that was not applied; abort after `max_skips` in a row."""
    streak = streak_name(what)
    setattr(state, streak, getattr(state, streak) + 1)
    state.skipped_steps += 1
    if getattr(state, streak) >= max_skips:
        raise NonFiniteError(f"{what}: {getattr(state, streak)} consecutive updates skipped ({reason}); "
                             "aborting (optim.max_skipped_steps); lower optim.lr or check the rewards")


def streak_name(what: str) -> str:
    """The UpdateState counter of consecutive skips of `what`."""
    return "consecutive_skips" if what == "policy" else f"{what}_consecutive_skips"


def optimizer_step(params, optimizer, scheduler, max_grad_norm: float, state: UpdateState,
                   max_skips: int, what: str, loss_finite: bool = True) -> dict:
    """Clip, check finiteness, step. A non-finite loss or gradient skips the update and is counted."""
    if not loss_finite:
        optimizer.zero_grad(set_to_none=True)
        record_skip(state, max_skips, what, "non-finite loss")
        return {"optim/grad_norm": float("nan")}
    params = [p for p in params if p.grad is not None]
    norm = torch.nn.utils.clip_grad_norm_(params, max_grad_norm if max_grad_norm > 0 else float("inf"))
    norm = plain_norm(norm)
    if not torch.isfinite(norm):
        optimizer.zero_grad(set_to_none=True)
        record_skip(state, max_skips, what, "non-finite gradient")
        return {"optim/grad_norm": float("nan")}
    setattr(state, streak_name(what), 0)
    optimizer.step()
    if scheduler is not None:
        scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    return {"optim/grad_norm": float(norm)}


def policy_gradient(policy, rollout: Rollout, batch: torch.Tensor, norm, opts: UpdateOptions, kl_coef: float,
                    avg: MetricAverager, micro_batch_size: int | None = None) -> tuple[bool, float]:
    """Accumulate one optimizer step's gradient over its micro-batches: (all losses finite, the step's loss).
    `micro_batch_size`: the size in use (halved after an out-of-memory); default opts.micro_batch_size."""
    step_loss = 0.0
    # The step's distinct prompts run once; each micro-batch's backward stops at its slice of them.
    encoded = encode_prompts(policy, rollout, batch, opts.autocast)
    for micro in by_prompt(batch, rollout.group_ids).split(micro_batch_size or opts.micro_batch_size):
        part = on_device(rollout.select(micro), model_device(policy))
        prompts = (encoded[0], encoded[1][micro]) if encoded is not None else None
        loss, metrics = micro_policy_loss(policy, part, norm, opts, kl_coef, prompts)
        if not all_finite(loss):  # checked before backward: no NaN reaches a gradient
            return False, step_loss
        loss.backward()
        if encoded is not None:
            encoded[0].collect()
        step_loss += float(loss.detach())  # the micro-batch shares add up to the step's loss
        avg.add(metrics, float(part.response_mask.sum()))
    if encoded is not None:
        encoded[0].backward()  # the summed gradient of every micro-batch into the prompt pass
    return True, step_loss


def update_policy(policy, optimizer, scheduler, rollout: Rollout, opts: UpdateOptions, kl_coef: float,
                  state: UpdateState, generator: torch.Generator, sizes: MicroBatchSizes | None = None) -> dict:
    """mu epochs of clipped policy-gradient updates over the rollout. An optimizer step's gradient
    that runs out of memory is redone from zero at half the micro-batch (`sizes`, kept for the run)."""
    avg, sizes, device = MetricAverager(), sizes or MicroBatchSizes(opts.micro_batch_size), model_device(policy)
    for batch in minibatch_schedule(len(rollout), opts.epochs, opts.minibatches, generator):
        norm = global_normalizer(opts.loss_agg, rollout.response_mask[batch], opts.max_len)

        def attempt(size: int):
            step_avg = MetricAverager()
            with shared_weight_casts(opts.autocast, device):
                return policy_gradient(policy, rollout, batch, norm, opts, kl_coef, step_avg, size), step_avg
        (finite, step_loss), step_avg = halving_on_oom("update", sizes, attempt, device,
                                                       cleanup=lambda: policy.zero_grad(set_to_none=True))
        avg.merge(step_avg)
        step_metrics = optimizer_step(policy.parameters(), optimizer, scheduler, opts.max_grad_norm,
                                      state, opts.max_skipped_steps, "policy", finite)
        avg.add({**step_metrics, "policy/loss": step_loss}, 1.0)
    out = avg.result()
    out["optim/skipped_steps"] = state.skipped_steps
    return out


def critic_gradient(critic, rollout: Rollout, batch: torch.Tensor, norm, opts: UpdateOptions,
                    avg: MetricAverager, micro_batch_size: int | None = None) -> tuple[bool, float, list]:
    """Accumulate one optimizer step's value-loss gradient: (all losses finite, the step's loss, (V, R) fitted)."""
    step_loss, fitted = 0.0, []
    for micro in batch.split(micro_batch_size or opts.micro_batch_size):
        part = on_device(rollout.select(micro), model_device(critic))
        values, width = critic_values(critic, part, opts.autocast)
        mask = part.response_mask[:, :width]
        returns = part.returns[:, :width]
        loss, metrics = algos.value_loss(values, part.values[:, :width], returns, mask, norm, opts.value_clip)
        if not all_finite(loss):  # every rank skips, or none (FSDP collectives)
            return False, step_loss, fitted
        (opts.value_coef * loss).backward()
        # Loss shares add up to the mini-batch's loss (like policy/loss); explained variance is
        # not a mean of per-micro-batch values, so it is computed over the mini-batch's tokens.
        step_loss += metrics.pop("critic/loss")
        del metrics["critic/explained_var"]
        fitted.append((values.detach()[mask.bool()], returns[mask.bool()]))
        avg.add(metrics, float(mask.sum()))
    return True, step_loss, fitted


def update_critic(critic, optimizer, rollout: Rollout, opts: UpdateOptions, state: UpdateState,
                  generator: torch.Generator, sizes: MicroBatchSizes | None = None) -> dict:
    """Clipped value regression onto the returns, same schedule as the policy (and the same
    halving of the update's micro-batch on out-of-memory)."""
    avg, sizes = MetricAverager(), sizes or MicroBatchSizes(opts.micro_batch_size)
    for batch in minibatch_schedule(len(rollout), opts.epochs, opts.minibatches, generator):
        norm = global_normalizer(opts.loss_agg, rollout.response_mask[batch], opts.max_len)

        def attempt(size: int):
            step_avg = MetricAverager()
            return critic_gradient(critic, rollout, batch, norm, opts, step_avg, size), step_avg
        (finite, step_loss, fitted), step_avg = halving_on_oom("update", sizes, attempt, model_device(critic),
                                                               cleanup=lambda: critic.zero_grad(set_to_none=True))
        avg.merge(step_avg)
        step_metrics = optimizer_step(critic.parameters(), optimizer, None, opts.max_grad_norm, state,
                                      opts.max_skipped_steps, "critic", finite)
        step_metrics = {f"critic/{k.split('/')[-1]}": v for k, v in step_metrics.items()}
        if finite and fitted:
            v, r = (torch.cat(t) for t in zip(*fitted))
            every_token = torch.ones_like(v, dtype=torch.bool)
            step_metrics.update({"critic/loss": step_loss,
                                 "critic/explained_var": algos.explained_variance(v, r, every_token)})
        avg.add(step_metrics, 1.0)
    return avg.result()
