"""The RL loop, top to bottom in the order it runs.

One loop serves every algorithm: the plan (covey.training.plan, made once from the config)
says which estimator and policy loss of `covey.algos` run, whether a reference model and
a critic exist, and where the KL goes (loss term or per-token reward penalty).

    covey.train = open_run -> steps -> finish; a caller (covey compare, the benchmarks) drives the same three:
        session = open_run(cfg)          data -> plan -> setup -> evaluate the untrained policy (or resume)
        for metrics in steps(session):   one step each, logged and checkpointed; `break` stops early
            ...
        result = finish(session)         checkpoint -> evaluate -> save the final model
    step:  sample -> score -> log-probs -> advantages -> update      (algo.learner=advantage)
           sample -> score -> best-vs-worst pairs -> DPO update       (algo.learner=dpo)
           sample -> score -> teacher's log-probs -> update           (algo.learner=distill)
           demonstrations -> supervised update                        (algo.learner=sft; the first sft.num_steps)

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
from typing import Iterator

import torch
from tqdm import tqdm

from covey.batch import Rollout
from covey.config import Config, as_dict, validate_world
from covey.envs.verifiers import verifiers_data
from covey.passes.logprobs import training_pass
from covey.rewards.build import build_rewarder, user_terms
from covey.rewards.combine import TrainerState
from covey.rewards.learned import load_learned_rewards
from covey.runtime.cpu import apply_cpu_settings
from covey.runtime.dist import (
    World,
    broadcast_object,
    close_distributed,
    describe_device,
    reduce_eval,
    reduce_metrics,
    uneven_share,
)
from covey.runtime.memory import record_gpu_peak, take_gpu_peak_mb
from covey.runtime.metrics import make_run_dir
from covey.runtime.signals import StopFlag, TrainingStopped, fault_point, graceful_stop
from covey.tasks.data import load_run_data, settle_config
from covey.training.checkpoint import check_resume_request, load_checkpoint, resolve_resume, save_checkpoint, save_final
from covey.training.distill import check_teacher, learn_from_teacher, load_teacher
from covey.training.dpo import learn_from_pairs
from covey.training.evaluate import (
    HeldOutOptions,
    Judge,
    eval_settings,
    evaluate,
    read_cached_eval,
    settings_key,
    write_cached_eval,
)
from covey.training.global_batch import (
    decorrelate_ranks,
    global_batch_view,
    global_episode_metrics,
    save_on_main,
    whole_tensors,
)
from covey.training.inputs import CallerInputs, check_inputs
from covey.training.phases import supervised
from covey.training.plan import Plan, make_plan, print_plan
from covey.training.plan_setup import openenv_target, outside_source
from covey.training.rl import learn_from_advantages
from covey.training.rollout_phase import collect_rollout, release_sampling_copy
from covey.training.setup import (
    Feed,
    Run,
    Session,
    TrainResult,
    attach_reward_models,
    build_run,
    choose_verifier,
    open_feed,
    open_world,
    prepare_run_dir,
    print_header,
    print_precision,
    seed_everything,
)
from covey.training.sft import demo_stream, prepare_demos, sft_step
from covey.training.step_metrics import memory_metrics, rollout_metrics, sample_rows
from covey.training.update import record_skip


def open_run(config: Config, *, reward_funcs=None, reward_weights=None, tools=None, environment_factory=None,
             evaluate_before: bool = True) -> Session:
    """Everything before the first step: the data settled, the plan made from the config, the inputs checked,
    models built, the untrained policy evaluated (or a checkpoint restored); the keywords are covey.train's.
    `evaluate_before=False` skips that evaluation (a caller that measures held-out accuracy itself); step 0's
    line then holds no eval/ figures."""
    if not isinstance(config, Config):
        raise TypeError(f"covey.train and covey.open_run take the Config of covey.load_config(...), not "
                        f"{type(config).__name__}")
    given = CallerInputs(user_terms(reward_funcs, reward_weights), tools, environment_factory)
    scorers = bool(given.reward_funcs or config.rollout.environment or environment_factory
                   or openenv_target(config.task) or outside_source(config.task))  # an environment's reward scores
    # the data first: bad data fails before a model loads, and what it decides (eval.metric, reward.correctness)
    # is in the config the plan is made from and the run records; task.source=verifiers: its taskset's tasks
    tasks = verifiers_data(config.task.source, config.task.train_size, config.task.eval_size)
    config, data = load_run_data(config, scorers) if tasks is None else (settle_config(config, tasks, True), tasks)
    plan = make_plan(config, with_tools=bool(tools or environment_factory))  # every option checked once, here
    check_resume_request(plan.run.resume, plan.run.run_name)
    world = open_world(plan)
    validate_world(config, world.size)
    apply_cpu_settings(config.model.threads)
    return start_run(plan, data, given, world, as_dict(config), evaluate_before)


def start_run(plan: Plan, data, given: CallerInputs, world: World, record: dict, evaluate_before: bool) -> Session:
    """The run from its plan: inputs checked before any model loads, the run folder, the models, the feed, the
    session (`record`: the config as config.yaml holds it)."""
    run_dir = prepare_run_dir(plan.run, plan.label)
    resume_from = resolve_resume(plan.run.resume, run_dir)  # a resume that cannot work fails before loading too
    inputs = check_inputs(plan, data, run_dir, given)  # tools, environments, reward functions, model and prompts
    demos = prepare_demos(plan.sft, plan.model)  # sft.data rendered, and the teacher's tokenizer checked, before
    check_teacher(plan.distill, plan.model)      # any model loads
    run_dir = make_run_dir(run_dir, unique=not plan.run.run_name and world.size == 1)  # every check passed
    print(f"covey: device {describe_device(world.device)}")
    print(f"covey: model {inputs.family.describe()}; training pass {training_pass(inputs.family)}")
    print_header(run_dir, plan.run.task_name, data)
    verifier = choose_verifier(plan, data)
    print_plan(plan)
    seed_everything(plan.schedule.seed)
    r = plan.rewards
    learned = load_learned_rewards(r.model_path, r.prm_path, r.step_separator, world.device)
    rewarder = build_rewarder(r, learned, verifier=verifier, user=inputs.user_rewards, run_dir=run_dir,
                              environment=inputs.agent is not None and inputs.agent.environments is not None)
    run = build_run(plan, run_dir, len(data.train), world, record)
    run.teacher, run.sft_stream = load_teacher(plan, world), demo_stream(demos, plan.schedule.seed)
    attach_reward_models(run, learned)
    print_precision(run)
    feed = open_feed(run, data, rewarder, inputs.agent)
    feed.demos = demos
    feed.judge = Judge("reward" if plan.run.eval_metric == "reward" else verifier, rewarder, plan.run.reward_threshold)
    cache = plan.run.eval_before_cache
    session = Session(run=run, feed=feed, before={}, eval_cache=(cache, eval_settings(record)) if cache else None)
    session.stop = session.signals.enter_context(graceful_stop())
    try:
        session.before = start_or_resume(session, resume_from, evaluate_before)
    except BaseException:
        session.close()
        raise
    session.last_saved = run.step if resume_from is not None else None
    decorrelate_ranks(world, plan.schedule.seed, run.step)
    return session


def start_or_resume(session: Session, resume_from, evaluate_before: bool = True) -> dict:
    """Restore a checkpoint, or evaluate the untrained policy; returns the pre-training eval."""
    run, feed = session.run, session.feed
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
    before, source = eval_before_training(session) if evaluate_before and feed.data.eval else ({}, "")
    run.logger.log(0, {**before, "data/skipped_rows": feed.data.skipped_rows})
    if before:  # none when not asked for, or without a held-out set (task.eval_size=0)
        print(f"covey: held-out {feed.judge.describe()} before training: {eval_figure(feed.judge, before)} "
              f"({before['eval/n']} problems, greedy{source})")
        warning = session.watch.before_training(before)
        if warning and run.world.is_main:
            print(warning)
    return before


def eval_before_training(session: Session) -> tuple[dict, str]:
    """The untrained policy's evaluation, and where it came from: run here, or read from
    train.eval_before_cache, where a run with the same settings stored it (then added there)."""
    run, feed = session.run, session.feed
    if session.eval_cache is None:
        return run_eval(run, feed, session.stop), ""
    path, settings = session.eval_cache
    key = settings_key(settings)
    cached = broadcast_object(read_cached_eval(path, key) if run.world.is_main else None)
    if cached is not None:
        return cached, f"; from {path}, evaluated earlier with the same settings"
    before = run_eval(run, feed, session.stop)
    if run.world.is_main:
        try:
            write_cached_eval(path, key, before, settings)
        except OSError as err:  # the run goes on; only the sharing is lost
            print(f"covey: warning: train.eval_before_cache: cannot write {path}: {err.strerror or err}")
    return before, ""


def steps(session: Session) -> Iterator[dict]:
    """The run's steps, each yielded with its metrics once logged, until train.steps, the time budget or
    a stop signal; a checkpoint every save_every steps. On a stop signal: a checkpoint, then
    TrainingStopped. A caller may `break` at any step; `finish` saves what was not saved."""
    run, feed, schedule = session.run, session.feed, session.run.plan.schedule
    bar = tqdm(total=schedule.steps, initial=run.step, disable=not schedule.progress, unit="step")
    try:
        while run.step < schedule.steps and not out_of_time(run) and not session.stop.agreed():
            metrics = (sft_step(run, feed.demos, feed.engine) if supervised(run.plan.sft, run.step)
                       else train_step(run, feed.engine, feed.rewarder, feed.data, feed.prompts))
            if schedule.eval_every and run.step % schedule.eval_every == 0 and run.step < schedule.steps:
                metrics.update(run_eval(run, feed))
            run.logger.log(run.step, metrics)
            fault_point("step-logged", run.step)
            bar.set_postfix(**progress_fields(metrics))
            bar.update(1)
            note = session.watch.observe(run.step, metrics)
            if note and run.world.is_main:
                tqdm.write(note)  # above the progress bar, once: the first step that could not learn
            if schedule.save_every and run.step % schedule.save_every == 0:
                save_on_main(run, lambda r: save_checkpoint(r, session.before))
                session.last_saved = run.step
            session.last = metrics
            yield metrics
    finally:
        bar.close()
    if session.stop.requested:
        save_unsaved(session)
        raise TrainingStopped(session.stop.signum, run.step,
                              run.run_dir / "checkpoints" / f"step-{run.step:06d}")


def progress_fields(metrics: dict) -> dict:
    """The progress bar's figures of a step: its reward, accuracy and KL, or a supervised step's loss."""
    if "sft/loss" in metrics:
        return {"sft_loss": f"{metrics['sft/loss']:.3f}", "s_step": f"{metrics['time/step']:.1f}"}
    return {"reward": f"{metrics['reward/mean']:.2f}",
            **({"acc": f"{metrics['accuracy']:.2f}"} if "accuracy" in metrics else {}),
            "kl": f"{metrics.get('kl/ref', 0.0):.3f}", "s_step": f"{metrics['time/step']:.1f}"}


def save_unsaved(session: Session) -> None:
    """A checkpoint of the newest step, unless one was written at it."""
    if session.last_saved != session.run.step:
        save_on_main(session.run, lambda r: save_checkpoint(r, session.before))
        session.last_saved = session.run.step


def out_of_time(run: Run) -> bool:
    limit = run.plan.schedule.max_minutes
    return limit > 0 and run.clock.seconds >= 60 * limit


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
    elif run.plan.learner == "distill":  # the teacher's advantages, or GKD's loss
        metrics.update(learn_from_teacher(run, rollout))
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
    metrics["time/elapsed"] = run.clock.add(metrics["time/step"])
    sampled = metrics.get("partial/sampled_tokens", float(rollout.response_mask.sum()))  # this step's, not carried
    metrics["throughput/tokens_per_s"] = sampled / max(metrics["time/generate"], 1e-9)
    metrics.update(memory_metrics(run))
    every = run.plan.schedule.samples_every
    if every and (run.step % every == 0 or run.step == 1):  # the first step too: a short run shows samples
        run.logger.log_samples(run.step, sample_rows(rollout, data.train, tokenizer=run.tokenizer))
    return reduce_metrics(metrics)  # under torchrun: pooled over ranks (docs/scale.md, Metrics)


def skip_empty_step(run: Run, metrics: dict, t0: float) -> dict:
    """A step whose samples were all dropped: no update, counted like a non-finite one."""
    record_skip(run.update_state, run.plan.update.max_skipped_steps, "policy",
                "every sample dropped by reward faults")
    run.step += 1
    metrics.update({"reward/mean": float("nan"), "optim/skipped_steps": run.update_state.skipped_steps,
                    "kl/beta": run.kl_controller.value, "time/step": time.perf_counter() - t0})
    return metrics


def sync_engine(run: Run, engine) -> dict:
    """Push the updated weights to an engine that holds its own copy (vLLM); the HF engine shares the module."""
    t0 = time.perf_counter()
    engine.sync_weights(run.policy)
    return {"time/sync_weights": time.perf_counter() - t0}


@torch.no_grad()
def refresh_reference(run: Run) -> None:
    """Reset the reference to the policy every K steps, or mix it in (EMA) every step."""
    ref = run.plan.reference
    if run.reference is None:
        return
    if ref.refresh_every and run.step % ref.refresh_every == 0:
        run.reference.load_state_dict(run.policy.state_dict())
    elif ref.ema:
        for r, p in zip(run.reference.parameters(), run.policy.parameters()):
            r.lerp_(p, ref.ema)


def refresh_reward_models(run: Run, rollout: Rollout, examples, prompts) -> dict:
    """Iterative GRPO (Shao et al. 2024, arXiv:2402.03300): RM/verifier agreement each step; the RM
    retrained every K steps."""
    metrics = {}
    for refresher in run.reward_refreshers:
        metrics.update(refresher.after_step(run.step, rollout, examples, prompts))
    return metrics


# --------------------------------------------------------------------------- evaluation and the end


def run_eval(run: Run, feed: Feed, stop: StopFlag | None = None) -> dict:
    """Held-out evaluation, pooled over torchrun's ranks ({} with no held-out set; `stop`: one process only)."""
    sampling, schedule, t0 = run.plan.sampling, run.plan.schedule, time.perf_counter()
    if not feed.data.eval:
        return {}
    mine = uneven_share(list(range(len(feed.eval_prompts))), run.world)
    feed.judge.state = TrainerState(global_step=run.step, max_steps=schedule.steps)
    settings = HeldOutOptions(feed.judge, sampling.eval_batch_size, sampling.eval_max_new_tokens, schedule.eval_pass_k)
    out = evaluate(feed.eval_engine, [feed.eval_prompts[i] for i in mine], [feed.data.eval[i] for i in mine],
                   settings, stop=stop if run.world.size == 1 else None)
    out = reduce_eval(out)
    out.update({f"eval/{k}": v for k, v in global_episode_metrics(feed.eval_engine).items()})  # episodes
    out["time/eval"] = time.perf_counter() - t0
    return record_gpu_peak(out, run.world.device, "eval")


def eval_figure(judge: Judge, result: dict) -> str:
    """'18.5%' for a verifier's accuracy; '31.0% (mean reward 0.42)' for the reward's pass rate."""
    if judge.by_reward:
        return f"{result['eval/reward_pass']:.1%} (mean reward {result['eval/reward_mean']:.3g})"
    return f"{result['eval/accuracy']:.1%}"


def finish(session: Session, *, evaluate: bool = True, save: bool = True) -> TrainResult:
    """The end of a run: a checkpoint of the newest step, the trained policy evaluated and saved
    (runs/<name>/final), the process group closed. `evaluate=False` / `save=False` leave out the
    evaluation / the checkpoint and the final folder (a caller that measures or saves by itself)."""
    run, feed, before, schedule = session.run, session.feed, session.before, session.run.plan.schedule
    session.close()
    if save:
        save_unsaved(session)
    by_budget = run.step < schedule.steps and out_of_time(run)
    after = run_eval(run, feed) if evaluate else {}
    run.logger.log(run.step, {**after, "final": 1, "train/stopped_by_budget": int(by_budget)})
    run.logger.close()  # the trackers' runs (train.logger) finish
    final_dir = (save_on_main(run, save_final) or run.run_dir / "final") if save else None  # rank 0 writes it
    result = TrainResult(run_dir=run.run_dir, final_model=final_dir, steps=run.step, metrics=session.last,
                         accuracy_before=before.get("eval/accuracy"), accuracy_after=after.get("eval/accuracy"),
                         eval_before=before, eval_after=after)
    stopped = (f" (stopped by the time budget train.max_minutes={schedule.max_minutes:g} before "
               f"train.steps={schedule.steps}; train.max_minutes=0 for no limit)" if by_budget else "")
    if evaluate and before:
        print(f"covey: held-out {feed.judge.describe()} {eval_figure(feed.judge, before)} -> "
              f"{eval_figure(feed.judge, after)} after {run.step} steps"
              + (f"; model saved to {final_dir}" if save else "") + session.watch.summary(run.step) + stopped)
    elif save:
        print(f"covey: {run.step} steps; model saved to {final_dir}{session.watch.summary(run.step)}{stopped}")
    close_distributed()
    return result
