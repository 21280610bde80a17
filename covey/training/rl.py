"""The advantage learner, every learner but iterative DPO: a step's scored samples -> step rewards (process
supervision) -> pi_old, pi_ref log-probs and critic values -> advantages -> the token devices (the sampler
correction, the token selections, the entropy controller) -> the optimizer steps of the policy loss (and of the
critic's). Called once a step by covey/training/loop.py; each stage is a few lines of its own.
"""

from __future__ import annotations

import dataclasses
import time

from covey import algos
from covey.batch import Rollout
from covey.models.offload import release_weights
from covey.passes.logprobs import batched_logprobs, batched_logprobs_and_entropy, batched_values
from covey.rewards.steps import add_outcome_to_last_step, process_step_inputs
from covey.runtime.memory import halving_on_oom, record_gpu_peak
from covey.training.balance import balance_ranks
from covey.training.global_batch import global_advantages
from covey.training.gradvar import measure_grad_variance
from covey.training.setup import Run, size_update
from covey.training.signal_watch import signal_metrics
from covey.training.token_weights import correct_sampler_mismatch, observe_entropy, select_tokens
from covey.training.update import Optimized, update_critic, update_policy


def learn_from_advantages(run: Run, rollout: Rollout, examples, prompts) -> dict:
    """Every learner but iterative DPO: step rewards -> log-probs -> advantages -> update."""
    steps, metrics = score_steps(run, rollout, examples, prompts)
    metrics.update(add_logprobs(run, rollout))
    metrics.update(add_advantages(run, rollout, steps))
    metrics.update(correct_sampler_mismatch(run, rollout))
    if run.plan.update.mask_truncated:  # DAPO's overlong filtering: in the advantages above, out of the loss below
        rollout.response_mask = algos.mask_truncated(rollout.response_mask, rollout.truncated)
    metrics.update(select_tokens(run, rollout))  # over the trained tokens of every rank
    metrics.update(signal_metrics(rollout))  # tokens in the loss and their largest |advantage| (signal_watch.py)
    metrics.update(observe_entropy(run, rollout))
    # under torchrun: the rows spread over the ranks by tokens for the update (train.balance_ranks); the same gradient
    trained, spread = balance_ranks(rollout, run.tokenizer.pad_token_id, run.plan.run.balance_ranks)
    metrics.update(spread)
    metrics.update(update(run, trained))
    return metrics


def score_steps(run: Run, rollout: Rollout, examples, prompts) -> tuple[dict | None, dict]:
    """Process supervision (the estimator's `step_scores` trait): one reward per reasoning step,
    placed on the token where the step ends."""
    scoring, t0 = run.plan.step_scoring, time.perf_counter()
    if not scoring.enabled:
        return None, {}
    steps, metrics = process_step_inputs(rollout, run.tokenizer, prompts, examples, run.learned_rewards.process,
                                         scoring.source, scoring.separator)
    if scoring.outcome_weight:
        steps["step_scores"] = add_outcome_to_last_step(steps["step_scores"], steps["step_mask"], rollout.scores,
                                                        scoring.outcome_weight)
    metrics["time/score_steps"] = time.perf_counter() - t0
    return steps, metrics


def add_logprobs(run: Run, rollout: Rollout) -> dict:
    """pi_old and pi_ref log-probs and critic values, each only where something uses it."""
    plan, t0, sizes, device = run.plan, time.perf_counter(), run.micro_batches, run.world.device
    temp, prec = plan.update.temperature, plan.update.autocast
    if plan.needs_old_logprobs:
        rollout.old_logp, rollout.old_entropy = halving_on_oom("logprobs", sizes, lambda mb: (
            batched_logprobs_and_entropy(run.policy, rollout, temp, mb, prec, plan.tokens.needs_entropy)), device)
    if run.reference is not None:
        rollout.ref_logp = halving_on_oom("logprobs", sizes, lambda mb: batched_logprobs(
            run.reference, rollout, temp, mb, prec), device)
        release_weights(run.reference)  # an offloaded reference leaves memory before the update
    if run.critic is not None:
        rollout.values = halving_on_oom("logprobs", sizes, lambda mb: batched_values(run.critic, rollout, mb, prec),
                                        device)
    return record_gpu_peak({"time/logprobs": time.perf_counter() - t0}, run.world.device, "logprobs")


def add_advantages(run: Run, rollout: Rollout, steps: dict | None = None) -> dict:
    """Advantages and returns from the plan's estimator on every rank's batch; KL-in-reward when asked."""
    kl, token_kl, metrics = run.plan.kl, None, {}
    if kl.placement == "reward" and rollout.ref_logp is not None:
        token_kl = algos.kl_penalty(rollout.old_logp, rollout.ref_logp, kl.estimator) * rollout.response_mask
        tokens = rollout.response_mask.sum().clamp(min=1)
        metrics["kl/ref"] = float(token_kl.sum() / tokens)
        metrics["kl/reward_penalty"] = float(run.kl_controller.value * token_kl.sum(1).mean())
    inp = algos.AdvantageInput(scores=rollout.scores, response_mask=rollout.response_mask,
                               group_ids=rollout.group_ids, values=rollout.values, token_kl=token_kl,
                               kl_coef=run.kl_controller.value if token_kl is not None else 0.0,
                               baseline_scores=rollout.baseline_scores, **(steps or {}))
    adv, ret, adv_metrics = global_advantages(run.plan.estimator, inp, run.plan.advantage)
    rollout.advantages, rollout.returns = adv, ret
    metrics.update(adv_metrics)
    metrics["returns/mean"] = float((ret * rollout.response_mask).sum() / rollout.response_mask.sum().clamp(min=1))
    return metrics


def update(run: Run, rollout: Rollout) -> dict:
    """algo.epochs x algo.minibatches optimizer steps of the policy loss (and of the critic's)."""
    schedule, metrics = run.plan.schedule, {}
    opts = dataclasses.replace(run.plan.update, entropy_coef=run.entropy_controller.value)  # adaptive: this step's
    if schedule.grad_var_every and (run.step + 1) % schedule.grad_var_every == 0:
        metrics = measure_grad_variance(run.policy, rollout, opts, run.kl_controller.value,
                                        seed=schedule.seed * 100003 + run.step,
                                        num_batches=schedule.grad_var_batches)
    t0 = time.perf_counter()
    size_update(run, rollout)  # on one GPU, before the first update
    sizes = run.micro_batches
    target = Optimized(run.policy, run.optimizer, run.scheduler, run.update_state)
    metrics.update(update_policy(target, rollout, opts, run.kl_controller.value, run.shuffle_generator, sizes))
    if run.critic is not None:
        metrics.update(update_critic(run.critic, run.critic_optimizer, rollout, opts, run.update_state,
                                     run.shuffle_generator, sizes))
    metrics.update(sizes.metrics())
    metrics["optim/lr"] = run.scheduler.get_last_lr()[0]
    metrics["time/update"] = time.perf_counter() - t0
    return record_gpu_peak(metrics, run.world.device, "update")
