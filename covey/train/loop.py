"""The RL loop, top to bottom in the order it runs.

One loop serves every algorithm: the plan (covey.train.plan, made once from the config)
says which estimator and policy loss of `covey.algos` run, whether a reference model and
a critic exist, and where the KL goes (loss term or per-token reward penalty).

    train: plan -> setup -> evaluate the untrained policy (or resume) -> steps -> evaluate -> save
    step:  sample -> score -> log-probs -> advantages -> update      (algo.learner=advantage)
           sample -> score -> best-vs-worst pairs -> DPO update       (algo.learner=dpo)

Deviations from the papers, on purpose:
- the importance ratio is taken against the sampling policy (pi_old), as in PPO
  (Schulman et al. 2017, arXiv:1707.06347); `algo.ratio_against=ref` takes it against
  the reference model instead, which is not a trust region;
- k3 (Schulman 2020, "Approximating KL divergence") uses r = pi_ref / pi_theta, the
  form whose expectation under pi_theta is KL(pi_theta || pi_ref);
- when one rollout gives one optimizer step (epochs = minibatches = 1),
  pi_old = pi_theta exactly, so no separate old-log-prob pass is run: the
  ratio is exp(logp - logp.detach()) = 1 with the right gradient.
"""

from __future__ import annotations

import time

import torch
from tqdm import tqdm

from covey import algos
from covey.batch import Rollout
from covey.config import Config, as_dict
from covey.passes.logprobs import batched_logprobs, batched_values
from covey.rewards.build import build_rewarder
from covey.rewards.combine import TrainerState
from covey.rewards.learned import load_learned_rewards
from covey.models.offload import release_weights
from covey.rewards.steps import add_outcome_to_last_step, process_step_inputs
from covey.runtime.memory import halving_on_oom, record_gpu_peak, take_gpu_peak_mb
from covey.runtime.dist import broadcast_object, close_distributed, reduce_eval, reduce_metrics, uneven_share
from covey.runtime.signals import TrainingStopped, fault_point, graceful_stop
from covey.tasks.data import load_task_data
from covey.train.checkpoint import (check_resume_request, load_checkpoint, resolve_resume, save_checkpoint,
                                    save_final)
from covey.train.dpo import dpo_update
from covey.train.evaluate import Judge, evaluate, read_cached_eval, settings_key, write_cached_eval
from covey.train.global_batch import decorrelate_ranks, global_advantages, global_batch_view, save_on_main, whole_tensors
from covey.train.gradvar import measure_grad_variance
from covey.train.plan import make_plan, print_plan
from covey.train.rollout_phase import collect_rollout, release_sampling_copy
from covey.train.setup import (Feed, Run, TrainResult, attach_reward_models, build_run, choose_verifier, open_feed,
                               open_world, prepare_run_dir, print_header, print_precision, seed_everything,
                               size_update_pass)
from covey.train.step_metrics import memory_metrics, rollout_metrics, sample_rows
from covey.train.update import record_skip, update_critic, update_policy


def train(cfg: Config, reward_funcs=None) -> TrainResult:
    """Train a policy; `covey train` and the Python API `covey.train(...)` both run this.

    reward_funcs: Python callables and/or "module:function[:weight]" strings, scored on top of
    the configured rewards (reward.functions) with weight 1 unless given; each is called with
    keyword arguments, TRL's convention, and reported as reward/<function name>.
    """
    plan = make_plan(cfg)  # every option checked once; below the loop only plain options travel
    check_resume_request(cfg)
    world = open_world(cfg)
    data = load_task_data(cfg.task, cfg.train.seed)  # bad data fails before a model is loaded
    run_dir = prepare_run_dir(cfg, plan.label)
    resume_from = resolve_resume(cfg, run_dir)  # so does a resume that cannot work
    print_header(run_dir, cfg.task.name, data)
    verifier = choose_verifier(cfg, data)
    print_plan(plan)
    seed_everything(cfg.train.seed)
    learned = load_learned_rewards(cfg.reward, world.device)
    rewarder = build_rewarder(cfg, learned, reward_funcs or (), verifier=verifier)
    run = build_run(cfg, run_dir, len(data.train), world, plan)
    attach_reward_models(run, learned)
    print_precision(run)
    feed = open_feed(run, data, rewarder)
    feed.judge = Judge("reward" if cfg.eval.metric == "reward" else verifier, rewarder, cfg.eval.reward_threshold)

    with graceful_stop() as stop:
        before = start_or_resume(run, resume_from, feed)
        decorrelate_ranks(world, cfg.train.seed, run.step)
        last = run_loop(run, feed, before, stop, last_saved=run.step if resume_from is not None else None)
    return finish(run, feed, before, last)


def start_or_resume(run: Run, resume_from, feed: Feed) -> dict:
    """Restore a checkpoint, or evaluate the untrained policy; returns the pre-training eval."""
    if resume_from is not None:
        with whole_tensors(run, gather=False):  # under FSDP: full states from disk into each rank's shards
            resumed = load_checkpoint(run, resume_from)
        feed.engine.sync_weights(run.policy)  # an engine with its own copy of the weights (vLLM) takes these
        if resume_from.resolve().parent.parent == run.run_dir.resolve():
            run.logger.truncate_to(resumed.log_positions)  # drop lines of the steps to be redone
        else:
            run.logger.reset()  # another run's checkpoint: this run's logs start here
        print(f"covey: resumed from {resume_from} at step {run.step}")
        return resumed.eval_before
    run.logger.reset()
    before, source = eval_before_training(run, feed)
    run.logger.log(0, {**before, "data/skipped_rows": feed.data.skipped_rows})
    print(f"covey: held-out {feed.judge.describe()} before training: {eval_figure(feed.judge, before)} "
          f"({before['eval/n']} problems, greedy{source})")
    return before


def eval_before_training(run: Run, feed: Feed) -> tuple[dict, str]:
    """The untrained policy's evaluation, and where it came from: run here, or read from
    train.eval_before_cache, where a run with the same settings stored it (then added there)."""
    path = run.cfg.train.eval_before_cache
    if not path:
        return run_eval(run, feed), ""
    settings = eval_settings(run.cfg)
    key = settings_key(settings)
    cached = broadcast_object(read_cached_eval(path, key) if run.world.is_main else None)
    if cached is not None:
        return cached, f"; from {path}, evaluated earlier with the same settings"
    before = run_eval(run, feed)
    if run.world.is_main:
        try:
            write_cached_eval(path, key, before, settings)
        except OSError as err:  # the run goes on; only the sharing is lost
            print(f"covey: warning: train.eval_before_cache: cannot write {path}: {err.strerror or err}")
    return before, ""


def eval_settings(cfg: Config) -> dict:
    """What the untrained policy's held-out figures depend on: every section but algo, optim and
    train, and of train the seed (it draws the held-out set), the device and pass@k."""
    sections = as_dict(cfg)
    settings = {name: sections[name] for name in ("model", "task", "rollout", "reward", "rm", "eval")}
    settings["train"] = {k: sections["train"][k] for k in ("seed", "device", "eval_pass_k")}
    return settings


def run_loop(run: Run, feed: Feed, before: dict, stop, last_saved: int | None) -> dict:
    """Steps until train.steps, the time budget or a stop signal; a checkpoint every save_every steps
    and at the end. Returns the last step's metrics."""
    cfg, metrics = run.cfg, {}
    bar = tqdm(total=cfg.train.steps, initial=run.step, disable=not cfg.train.progress, unit="step")
    while run.step < cfg.train.steps and not out_of_time(run) and not stop.agreed():
        metrics = train_step(run, feed.engine, feed.rewarder, feed.data, feed.prompts)
        if cfg.train.eval_every and run.step % cfg.train.eval_every == 0 and run.step < cfg.train.steps:
            metrics.update(run_eval(run, feed))
        run.logger.log(run.step, metrics)
        fault_point("step-logged", run.step)
        bar.set_postfix(reward=f"{metrics['reward/mean']:.2f}",
                        **({"acc": f"{metrics['accuracy']:.2f}"} if "accuracy" in metrics else {}),
                        kl=f"{metrics.get('kl/ref', 0.0):.3f}", s_step=f"{metrics['time/step']:.1f}")
        bar.update(1)
        if cfg.train.save_every and run.step % cfg.train.save_every == 0:
            save_on_main(run, lambda r: save_checkpoint(r, before))
            last_saved = run.step
    bar.close()
    if last_saved != run.step:  # the end of the run, or a stop between two checkpoints
        save_on_main(run, lambda r: save_checkpoint(r, before))
    if stop.requested:
        raise TrainingStopped(stop.signum, run.step, run.run_dir / "checkpoints" / f"step-{run.step:06d}")
    return metrics


def out_of_time(run: Run) -> bool:
    limit = run.cfg.train.max_minutes
    return limit > 0 and run.extra_state["clock"].seconds >= 60 * limit


# --------------------------------------------------------------------------- one step


def train_step(run: Run, engine, rewarder, data, prompts) -> dict:
    """One step: sample -> score -> (log-probs -> advantages -> update) or (pairs -> DPO update)."""
    t0 = time.perf_counter()
    take_gpu_peak_mb(run.world.device)  # each phase's peak is its own (runtime/memory.py)
    rollout, metrics = collect_rollout(run, engine, rewarder, data.train, prompts)
    record_gpu_peak(metrics, run.world.device, "generate")
    release_sampling_copy(engine)
    if len(rollout) == 0:  # reward.on_error=drop removed every sample: nothing to learn from
        return skip_empty_step(run, metrics, t0)
    if run.plan.learner == "dpo":  # the one learner without advantages
        metrics.update(learn_from_pairs(run, rollout))
    else:
        metrics.update(learn_from_advantages(run, rollout, data.train, prompts))
    metrics.update(sync_engine(run, engine))
    run.step += 1
    run.kl_controller.update(metrics.get("kl/ref", 0.0), 1)
    refresh_reference(run)
    metrics.update(refresh_reward_models(run, rollout, data.train, prompts))
    metrics.update(rollout_metrics(global_batch_view(rollout)))  # over every rank's samples
    metrics["kl/beta"] = run.kl_controller.value
    metrics["time/step"] = time.perf_counter() - t0 - metrics.get("time/grad_var", 0.0)  # measurement excluded
    metrics["time/elapsed"] = run.extra_state["clock"].add(metrics["time/step"])
    metrics["throughput/tokens_per_s"] = float(rollout.response_mask.sum()) / max(metrics["time/generate"], 1e-9)
    metrics.update(memory_metrics(run))
    every = run.cfg.train.samples_every
    if every and (run.step % every == 0 or run.step == 1):  # the first step too: a short run shows samples
        run.logger.log_samples(run.step, sample_rows(rollout, data.train))
    return reduce_metrics(metrics)  # under torchrun: pooled over ranks (docs/scale.md, Metrics)


def skip_empty_step(run: Run, metrics: dict, t0: float) -> dict:
    """A step whose samples were all dropped: no update, counted like a non-finite one."""
    record_skip(run.update_state, run.plan.update.max_skipped_steps, "policy",
                "every sample dropped by reward faults")
    run.step += 1
    metrics.update({"reward/mean": float("nan"), "optim/skipped_steps": run.update_state.skipped_steps,
                    "kl/beta": run.kl_controller.value, "time/step": time.perf_counter() - t0})
    return metrics


def learn_from_advantages(run: Run, rollout: Rollout, examples, prompts) -> dict:
    """Every learner but iterative DPO: step rewards -> log-probs -> advantages -> update."""
    steps, metrics = score_steps(run, rollout, examples, prompts)
    metrics.update(add_logprobs(run, rollout))
    metrics.update(add_advantages(run, rollout, steps))
    metrics.update(correct_sampler_mismatch(run, rollout))
    metrics.update(update(run, rollout))
    return metrics


def score_steps(run: Run, rollout: Rollout, examples, prompts) -> tuple[dict | None, dict]:
    """Process supervision (the estimator's `step_scores` trait): one reward per reasoning step,
    placed on the token where the step ends."""
    if not run.plan.traits.step_scores:
        return None, {}
    cfg, t0 = run.cfg, time.perf_counter()
    steps, metrics = process_step_inputs(rollout, run.tokenizer, prompts, examples, run.learned_rewards.process,
                                         cfg.reward.step_source, cfg.reward.step_separator)
    if cfg.reward.process_outcome_weight:
        steps["step_scores"] = add_outcome_to_last_step(steps["step_scores"], steps["step_mask"], rollout.scores,
                                                        cfg.reward.process_outcome_weight)
    metrics["time/score_steps"] = time.perf_counter() - t0
    return steps, metrics


def add_logprobs(run: Run, rollout: Rollout) -> dict:
    """pi_old and pi_ref log-probs and critic values, each only where something uses it."""
    plan, t0, sizes, device = run.plan, time.perf_counter(), run.extra_state["micro_batches"], run.world.device
    temp, prec = plan.update.temperature, plan.update.autocast
    if plan.needs_old_logprobs:
        rollout.old_logp = halving_on_oom("logprobs", sizes, lambda mb: batched_logprobs(
            run.policy, rollout, temp, mb, prec), device)
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


def correct_sampler_mismatch(run: Run, rollout: Rollout) -> dict:
    """Truncated IS (algo.tis_cap): vLLM sampled with its own kernels and weight copy, so each token's
    policy-loss term is weighted by min(pi_old/pi_sampler, cap). The weight (>= 0, no gradient) is folded
    into the advantage, which for ppo_clip and pg is the same as multiplying the token's loss term."""
    if not run.cfg.algo.tis_cap:
        return {}
    sampler_logp = getattr(rollout, "sample_logp", None)
    if sampler_logp is None:
        raise RuntimeError("algo.tis_cap is set but the engine returned no sampling log-probs")
    weights, metrics = algos.truncated_is_weights(rollout.old_logp, sampler_logp, rollout.response_mask,
                                                  run.cfg.algo.tis_cap)
    rollout.advantages = rollout.advantages * weights
    return metrics


def update(run: Run, rollout: Rollout) -> dict:
    """algo.epochs x algo.minibatches optimizer steps of the policy loss (and of the critic's)."""
    cfg, opts, metrics = run.cfg, run.plan.update, {}
    if cfg.train.grad_var_every and (run.step + 1) % cfg.train.grad_var_every == 0:
        metrics = measure_grad_variance(run.policy, rollout, opts, run.kl_controller.value,
                                        seed=cfg.train.seed * 100003 + run.step,
                                        num_batches=cfg.train.grad_var_batches)
    t0 = time.perf_counter()
    size_update_pass(run, rollout)  # on one GPU, before the first update
    sizes = run.extra_state["micro_batches"]
    metrics.update(update_policy(run.policy, run.optimizer, run.scheduler, rollout, opts, run.kl_controller.value,
                                 run.update_state, run.shuffle_generator, sizes))
    if run.critic is not None:
        metrics.update(update_critic(run.critic, run.critic_optimizer, rollout, opts, run.update_state,
                                     run.shuffle_generator, sizes))
    metrics.update(sizes.metrics())
    metrics["optim/lr"] = run.scheduler.get_last_lr()[0]
    metrics["time/update"] = time.perf_counter() - t0
    return record_gpu_peak(metrics, run.world.device, "update")


def learn_from_pairs(run: Run, rollout: Rollout) -> dict:
    """Iterative DPO (covey.train.dpo): best-vs-worst pairs of each group, DPO steps against the reference."""
    metrics = dpo_update(run.policy, run.reference, run.optimizer, run.scheduler, rollout, run.plan.update,
                         run.update_state, run.shuffle_generator)
    return record_gpu_peak({**metrics, "optim/lr": run.scheduler.get_last_lr()[0]}, run.world.device, "update")


def sync_engine(run: Run, engine) -> dict:
    """Push the updated weights to an engine that holds its own copy (vLLM); the HF engine shares the module."""
    t0 = time.perf_counter()
    engine.sync_weights(run.policy)
    return {"time/sync_weights": time.perf_counter() - t0}


@torch.no_grad()
def refresh_reference(run: Run) -> None:
    """Reset the reference to the policy every K steps, or mix it in (EMA) every step."""
    a = run.cfg.algo
    if run.reference is None:
        return
    if a.ref_refresh_every and run.step % a.ref_refresh_every == 0:
        run.reference.load_state_dict(run.policy.state_dict())
    elif a.ref_ema:
        for r, p in zip(run.reference.parameters(), run.policy.parameters()):
            r.lerp_(p, a.ref_ema)


def refresh_reward_models(run: Run, rollout: Rollout, examples, prompts) -> dict:
    """Iterative GRPO (Shao et al. 2024, arXiv:2402.03300): RM/verifier agreement each step; the RM
    retrained every K steps."""
    metrics = {}
    for refresher in run.reward_refreshers:
        metrics.update(refresher.after_step(run.step, rollout, examples, prompts))
    return metrics


# --------------------------------------------------------------------------- evaluation and the end


def run_eval(run: Run, feed: Feed) -> dict:
    """Held-out evaluation; under torchrun each rank evaluates every W-th problem and the counts are pooled."""
    cfg, t0 = run.cfg, time.perf_counter()
    mine = uneven_share(list(range(len(feed.eval_prompts))), run.world)
    feed.judge.state = TrainerState(global_step=run.step, max_steps=cfg.train.steps)
    out = evaluate(feed.eval_engine, [feed.eval_prompts[i] for i in mine], [feed.data.eval[i] for i in mine],
                   judge=feed.judge, batch_size=cfg.rollout.eval_batch_size,
                   max_new_tokens=cfg.rollout.eval_max_new_tokens, pass_k=cfg.train.eval_pass_k)
    out = reduce_eval(out)
    out["time/eval"] = time.perf_counter() - t0
    return record_gpu_peak(out, run.world.device, "eval")


def eval_figure(judge: Judge, result: dict) -> str:
    """'18.5%' for a verifier's accuracy; '31.0% (mean reward 0.42)' for the reward's pass rate."""
    if judge.by_reward:
        return f"{result['eval/reward_pass']:.1%} (mean reward {result['eval/reward_mean']:.3g})"
    return f"{result['eval/accuracy']:.1%}"


def finish(run: Run, feed: Feed, before: dict, last: dict) -> TrainResult:
    """Evaluate the trained policy, save it, close the process group."""
    by_budget = run.step < run.cfg.train.steps and out_of_time(run)
    after = run_eval(run, feed)
    run.logger.log(run.step, {**after, "final": 1, "train/stopped_by_budget": int(by_budget)})
    final_dir = save_on_main(run, save_final) or run.run_dir / "final"  # rank 0 writes it
    result = TrainResult(run_dir=run.run_dir, final_model=final_dir, steps=run.step, metrics=last,
                         accuracy_before=before.get("eval/accuracy"), accuracy_after=after.get("eval/accuracy"),
                         eval_before=before, eval_after=after)
    budget = run.cfg.train.max_minutes
    stopped = (f" (stopped by the time budget train.max_minutes={budget:g} before train.steps={run.cfg.train.steps}; "
               "train.max_minutes=0 for no limit)" if by_budget else "")
    print(f"covey: held-out {feed.judge.describe()} {eval_figure(feed.judge, before)} -> "
          f"{eval_figure(feed.judge, after)} after {run.step} steps; model saved to {final_dir}{stopped}")
    close_distributed()
    return result
