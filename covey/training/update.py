"""The optimisation phase of a step: mu epochs x mini-batches x micro-batches, in one loop
(`optimizer_steps`) that the policy, the critic and DPO (covey.training.dpo) each feed with the
gradient function of one optimizer step.

Each optimizer step builds one global `Normalizer` from the masks of its whole
mini-batch, so summing micro-batch losses gives exactly the mini-batch loss:
the gradient does not depend on `micro_batch_size`.
"""

from __future__ import annotations

import contextlib
import math
from collections import defaultdict
from dataclasses import dataclass, field, replace
from functools import partial
from typing import Callable

import torch

from covey import algos
from covey.batch import Rollout
from covey.passes.logprobs import critic_values, encode_prompts, on_device, policy_logprobs
from covey.runtime.dist import all_finite
from covey.runtime.fsdp import plain_norm
from covey.runtime.memory import MicroBatchSizes, halving_on_oom
from covey.runtime.precision import model_device, shared_weight_casts
from covey.training.global_batch import global_normalizer
from covey.training.plan import UpdateOptions
from covey.training.router_aux import router_aux


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
    """Yield index tensors, one per optimizer step: `epochs` shuffled passes over n rows in
    min(minibatches, n) parts (equal when minibatches divides n, as the config requires of a rollout).

    With a single part the order is kept (shuffling changes nothing) and the generator is not drawn.
    """
    parts = min(minibatches, n)
    for _ in range(epochs):
        order = torch.randperm(n, generator=generator) if parts > 1 else torch.arange(n)
        yield from torch.tensor_split(order, parts)


def by_prompt(batch: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
    """The mini-batch's rows ordered by prompt, so micro-batches hold whole groups whose prompt is
    encoded once (forward.prefix_shared_logprobs); the order inside a mini-batch leaves its gradient as is."""
    return batch[torch.argsort(group_ids[batch], stable=True)]


class MetricAverager:
    """Token-weighted mean of micro-batch metrics; the largest value for the names in MAXIMA."""

    MAXIMA = ("sampler/log_ratio_max",)

    def __init__(self):
        self.sums = defaultdict(float)
        self.weights = defaultdict(float)
        self.maxima: dict[str, float] = {}

    def add(self, metrics: dict, weight: float) -> None:
        for k, v in metrics.items():
            if not (isinstance(v, (int, float)) and math.isfinite(v)):
                continue
            if k in self.MAXIMA:
                self.maxima[k] = max(self.maxima.get(k, v), v)
                continue
            self.sums[k] += v * weight
            self.weights[k] += weight

    def merge(self, other: "MetricAverager") -> None:
        for k in other.sums:
            self.sums[k] += other.sums[k]
            self.weights[k] += other.weights[k]
        for k, v in other.maxima.items():
            self.maxima[k] = max(self.maxima.get(k, v), v)

    def result(self) -> dict:
        return {**{k: self.sums[k] / self.weights[k] for k in self.sums if self.weights[k] > 0}, **self.maxima}


def micro_policy_loss(policy, part: Rollout, norm, opts: UpdateOptions, kl_coef: float,
                      prompts=None) -> tuple[torch.Tensor, dict]:
    """Loss of one micro-batch (already scaled by the global normaliser) and its metrics.

    `prompts`: the step's encoded prompts and this micro-batch's index into them (passes.logprobs.encode_prompts).
    """
    # Entropy is always reported; it enters the loss only when entropy_coef > 0 (algos.policy_objective).
    logp, entropy, width = policy_logprobs(policy, part, opts.temperature, with_entropy=True,
                                           precision=opts.autocast, prompts=prompts)
    old = part.old_logp[:, :width] if part.old_logp is not None else logp.detach()

    def cut(t: torch.Tensor | None) -> torch.Tensor | None:
        return t[:, :width] if t is not None else None
    inp = algos.PolicyInputs(logp, old, part.advantages[:, :width], part.response_mask[:, :width],
                             ref_logp=cut(part.ref_logp), entropy=entropy, kept=cut(part.kept_tokens),
                             is_weights=cut(part.is_weights), sample_logp=cut(part.sample_logp),
                             cov_tokens=cut(part.cov_tokens))
    loss, metrics = algos.policy_objective(inp, norm, objective_options(opts, kl_coef))
    if part.sample_logp is not None:  # pi_old (the weights that sampled) against the sampler's own log-probs
        metrics.update(algos.sampler_mismatch(old, inp.sample_logp, inp.response_mask, opts.mismatch_cap))
    return loss, metrics


def objective_options(opts: UpdateOptions, kl_coef: float) -> algos.ObjectiveOptions:
    """The objective's options from the update's, with this step's KL coefficient (the controller's value)."""
    return algos.ObjectiveOptions(policy_loss=opts.policy_loss, loss=opts.loss,
                                  kl_coef=kl_coef if opts.kl_in_loss else 0.0, kl_kind=opts.kl_estimator,
                                  entropy_coef=opts.entropy_coef, cov=opts.cov)


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


def optimizer_step(target: Optimized, max_grad_norm: float, max_skips: int, loss_finite: bool = True) -> dict:
    """Clip, check finiteness, step. A non-finite loss or gradient skips the update and is counted."""
    optimizer, scheduler, state, what = target.optimizer, target.scheduler, target.state, target.what
    params = target.model.parameters()
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
                    avg: MetricAverager) -> tuple[bool, float]:
    """Accumulate one optimizer step's gradient over its micro-batches of opts.micro_batch_size (the size in
    use: halved after an out-of-memory): (all losses finite, the step's loss).
    With a router loss (opts.router_aux_coef), each micro-batch's share of it joins that micro-batch's
    backward (covey/training/router_aux.py); it is logged as loss/router_aux, not in the step's loss."""
    step_loss = 0.0
    # The step's distinct prompts run once; each micro-batch's backward stops at its slice of them.
    encoded = encode_prompts(policy, rollout, batch, opts.autocast)
    with router_aux(policy, rollout, batch, opts.router_aux_coef) as router:  # None without a router loss
        for micro in by_prompt(batch, rollout.group_ids).split(opts.micro_batch_size):
            part = on_device(rollout.select(micro), model_device(policy))
            prompts = (encoded[0], encoded[1][micro]) if encoded is not None else None
            with router.recording() if router is not None else contextlib.nullcontext():
                loss, metrics = micro_policy_loss(policy, part, norm, opts, kl_coef, prompts)
            aux = router.term(part, avg) if router is not None else None  # the routers' load-balancing share
            total = loss if aux is None else loss + aux
            if not all_finite(total):  # checked before backward: no NaN reaches a gradient
                return False, step_loss
            total.backward()
            if encoded is not None:
                encoded[0].collect()
            step_loss += float(loss.detach())  # the micro-batch shares add up to the step's loss
            avg.add(metrics, float(part.response_mask.sum()))
    if encoded is not None:
        encoded[0].backward()  # the summed gradient of every micro-batch into the prompt pass
    return True, step_loss


@dataclass
class StepGradient:
    """One optimizer step's gradient, accumulated by a gradient function (policy, critic or DPO)."""
    finite: bool
    """Every micro-batch loss was finite (checked before its backward; else accumulation stopped)."""
    micro: MetricAverager
    """The step's micro-batch metrics, weighted as the gradient function chose."""
    step: dict = field(default_factory=dict)
    """Metrics of the whole step (its loss ...), averaged over steps."""


@dataclass
class Optimized:
    """What `optimizer_steps` steps: a model, its optimizer and schedule, and where a skipped step is counted."""
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: object | None
    """A learning-rate schedule stepped with the optimizer, or None."""
    state: UpdateState
    what: str = "policy"
    """The UpdateState counter a skipped step goes to (policy | critic)."""
    grad_norm_key: str = "optim/grad_norm"
    """The metric the gradient norm is reported as."""


def optimizer_steps(target: Optimized, n: int, gradient: Callable[[torch.Tensor, int], StepGradient],
                    opts: UpdateOptions, generator: torch.Generator, sizes: MicroBatchSizes | None = None) -> dict:
    """The one optimizer loop of the policy, the critic and DPO: opts.epochs x opts.minibatches steps
    over n rows (minibatch_schedule). Each step: `gradient(rows, micro_batch_size)` accumulates the
    step's gradient; out of memory, it is undone and redone from zero at half the micro-batch
    (halving_on_oom on `sizes`, kept for the run); a non-finite loss or gradient skips the step
    (counted in `target.state` as `target.what`); else the gradient is clipped and the optimizer steps.
    Returns the metrics averaged over the steps (the gradient norm as `target.grad_norm_key`)."""
    model = target.model
    avg, device = MetricAverager(), model_device(model)
    sizes = sizes or MicroBatchSizes(opts.micro_batch_size)
    for rows in minibatch_schedule(n, opts.epochs, opts.minibatches, generator):
        grad = halving_on_oom("update", sizes, partial(gradient, rows), device,
                              cleanup=lambda: model.zero_grad(set_to_none=True))
        avg.merge(grad.micro)
        applied = optimizer_step(target, opts.max_grad_norm, opts.max_skipped_steps, grad.finite)
        avg.add({target.grad_norm_key: applied["optim/grad_norm"], **grad.step}, 1.0)
    return avg.result()


def update_policy(target: Optimized, rollout: Rollout, opts: UpdateOptions, kl_coef: float,
                  generator: torch.Generator, sizes: MicroBatchSizes | None = None) -> dict:
    """mu epochs of clipped policy-gradient updates of `target` (the policy, its optimizer and schedule) over
    the rollout (optimizer_steps). An optimizer step's gradient that runs out of memory is redone from zero at
    half the micro-batch (`sizes`)."""
    policy = target.model
    device = model_device(policy)

    def gradient(batch: torch.Tensor, size: int) -> StepGradient:
        norm = global_normalizer(opts.loss_agg, rollout.response_mask[batch], opts.max_len)
        avg = MetricAverager()
        with shared_weight_casts(opts.autocast, device):
            finite, step_loss = policy_gradient(policy, rollout, batch, norm, replace(opts, micro_batch_size=size),
                                                kl_coef, avg)
        return StepGradient(finite, avg, {"policy/loss": step_loss})
    out = optimizer_steps(target, len(rollout), gradient, opts, generator, sizes)
    out["optim/skipped_steps"] = target.state.skipped_steps
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
    halving of the update's micro-batch on out-of-memory): optimizer_steps."""
    def gradient(batch: torch.Tensor, size: int) -> StepGradient:
        norm = global_normalizer(opts.loss_agg, rollout.response_mask[batch], opts.max_len)
        avg = MetricAverager()
        finite, step_loss, fitted = critic_gradient(critic, rollout, batch, norm, opts, avg, size)
        if not (finite and fitted):
            return StepGradient(finite, avg)
        v, r = (torch.cat(t) for t in zip(*fitted))
        explained = algos.explained_variance(v, r, torch.ones_like(v, dtype=torch.bool))
        return StepGradient(finite, avg, {"critic/loss": step_loss, "critic/explained_var": explained})
    return optimizer_steps(Optimized(critic, optimizer, None, state, "critic", "critic/grad_norm"), len(rollout),
                           gradient, opts, generator, sizes)
