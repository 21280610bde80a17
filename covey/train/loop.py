"""The RL loop, top to bottom in the order it runs.

One loop serves every algorithm: the config picks the advantage estimator and
policy loss from `covey.algos`, whether a reference model and a critic exist,
and where the KL goes (loss term or per-token reward penalty).

Deviations from the papers, on purpose:
- the importance ratio is taken against the sampling policy (pi_old), not the
  reference as reference 001 writes (`algo.ratio_against=ref` gives 001's form);
- k3 uses r = pi_ref / pi_theta (reference 003 writes the inverse, which is
  not an unbiased KL estimate);
- when one rollout gives one optimizer step (epochs = minibatches = 1),
  pi_old = pi_theta exactly, so no separate old-log-prob pass is run: the
  ratio is exp(logp - logp.detach()) = 1 with the right gradient.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from covey import algos
from covey.train.checkpoint import (check_resume_request, load_checkpoint, resolve_resume, save_checkpoint,
                              save_final)
from covey.config import Config, as_dict, derived_sizes, uses_critic, validate_world
from covey.runtime.cpu import apply_cpu_settings
from covey.tasks.data import PromptStream, check_prompt_lengths, format_prompts, load_task_data
from covey.runtime.dist import (GatheredGeneration, SilentLogger, World, broadcast_object, close_distributed,
                               decorrelate_ranks, draw_share, global_advantages, global_batch_view,
                               init_distributed, prompt_seed, quiet_unless_main, reduce_eval, reduce_metrics,
                               sample_groups, save_on_main, shard_model, uneven_share, whole_tensors)
from covey.train.dpo import dpo_update
from covey.train.evaluate import evaluate
from covey.passes.logprobs import batched_logprobs, batched_values
from covey.runtime.precision import resolve_autocast
from covey.train.gradvar import measure_grad_variance
from covey.models.lora import add_adapters, frozen_reference
from covey.runtime.metrics import MetricsLogger, current_rss_mb, peak_rss_mb
from covey.models.critic import ValueModel
from covey.models.load import load_policy, param_memory_mb
from covey.models.offload import maybe_hold_reference_in_bf16, maybe_offload_reference, release_weights
from covey.rewards.steps import add_outcome_to_last_step, process_step_inputs
from covey.rm.refresh import make_refreshers
from covey.rewards.build import build_rewarder
from covey.rewards.learned import load_learned_rewards
from covey.batch import Rollout, concat_rollouts
from covey.rollout.local import local_engine
from covey.rollout.precision import LowPrecisionEngine, resolve_precision
from covey.runtime.signals import TrainingStopped, fault_point, graceful_stop
from covey.train.update import UpdateState, record_skip, update_critic, update_policy


@dataclass
class Run:
    """What the loop holds between steps (everything a checkpoint must restore)."""
    cfg: Config
    run_dir: Path
    policy: torch.nn.Module
    tokenizer: object
    reference: torch.nn.Module | None
    critic: torch.nn.Module | None
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    critic_optimizer: torch.optim.Optimizer | None
    kl_controller: object
    stream: PromptStream
    update_state: UpdateState = field(default_factory=UpdateState)
    step: int = 0
    shuffle_generator: torch.Generator = field(default_factory=torch.Generator)
    logger: MetricsLogger | None = None
    extra_state: dict = field(default_factory=dict)  # name -> object with state_dict(); checkpointed
    world: World = field(default_factory=World)  # rank, process count, device (torchrun)
    learned_rewards: object = None  # covey.rewards.learned.LearnedRewards: learned RM / PRM
    reward_refreshers: list = field(default_factory=list)  # covey.rm.trainer.RewardModelRefresher


class StepClock:
    """Seconds spent in training steps (evaluation excluded); checkpointed, so train.max_minutes
    is a budget for the whole run, resumes included."""

    def __init__(self):
        self.seconds = 0.0

    def add(self, seconds: float) -> float:
        self.seconds += seconds
        return self.seconds

    def state_dict(self) -> dict:
        return {"seconds": self.seconds}

    def load_state_dict(self, state: dict) -> None:
        self.seconds = float(state["seconds"])


def out_of_time(run) -> bool:
    limit = run.cfg.train.max_minutes
    return limit > 0 and run.extra_state["clock"].seconds >= 60 * limit


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def needs_reference(cfg: Config) -> bool:
    a = cfg.algo
    return (a.beta > 0 and a.kl_in != "none") or a.ratio_against == "ref" or a.learner == "dpo"


def make_optimizer(params, lr: float, cfg: Config) -> torch.optim.Optimizer:
    b1, b2 = (float(x) for x in cfg.optim.betas.split(","))
    params = [p for p in params if p.requires_grad]
    # Fused: one pass over each tensor instead of ~10 (0.7 s -> 0.2 s per step for 135M on one core);
    # the same update up to float rounding. Plain tensors only (not FSDP2's DTensors).
    fused = all(type(p.data) is torch.Tensor and p.device.type in ("cpu", "cuda") for p in params)
    optimizer = torch.optim.AdamW(params, lr=lr, betas=(b1, b2), weight_decay=cfg.optim.weight_decay,
                                  fused=fused or None)
    allocate_adamw_state(optimizer)
    return optimizer


def allocate_adamw_state(optimizer: torch.optim.AdamW) -> None:
    """Allocate the moments of a fused AdamW now, as its first step would (zeros, step 0).

    Left to the first step, the moments (1 GiB for 135M parameters) land in the heap that the
    first update's activations have just freed, so the second update grows the heap by about
    as much again and faults its pages in: 0.37M page faults, 9.4 s against ~6 s for later
    updates on a 2-core CPU (LOG.md, 2026-11-25, seventeenth session). Allocated before any
    pass, they sit below the activations. The steps are bit-identical (tests/test_train_loop.py).
    """
    for group in optimizer.param_groups:
        if not group["fused"]:  # torch's own lazy path for the rest (FSDP2's DTensors)
            continue
        for p in group["params"]:
            state = optimizer.state[p]
            if state:
                continue
            state["step"] = torch.zeros((), dtype=torch.float32, device=p.device)  # fused: a float32 tensor
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            if group["amsgrad"]:
                state["max_exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)


def make_scheduler(optimizer, warmup_steps: int):
    """Linear warm-up to the configured lr, constant after."""
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min(1.0, (s + 1) / warmup_steps) if warmup_steps > 0 else 1.0)


def make_kl_controller(cfg: Config):
    a = cfg.algo
    if a.kl_target > 0:
        return algos.AdaptiveKLController(a.beta, a.kl_target, a.kl_horizon)
    return algos.FixedKLController(a.beta)


def build_run(cfg: Config, run_dir: Path, train_size: int, world: World | None = None) -> Run:
    """Models, optimizers and controllers, in the order they are needed."""
    dtype, world = getattr(torch, cfg.model.dtype), world or World()
    policy, tokenizer = load_policy(cfg.model.path, dtype=dtype)
    if cfg.model.lora_rank:  # train adapters only; the reference is then the base with adapters off
        policy = add_adapters(policy, cfg.model.lora_rank, cfg.model.lora_alpha, cfg.model.lora_targets)
    reference = frozen_reference(policy) if needs_reference(cfg) else None
    critic = (ValueModel.from_policy_path(cfg.model.critic_path or cfg.model.path, dtype=dtype)
              if uses_critic(cfg) else None)
    # On the training device; under torchrun sharded with FSDP2 (optimizers are built on the shards).
    policy, reference, critic = (shard_model(m, world.device) for m in (policy, reference, critic))
    moves = bool(cfg.algo.ref_refresh_every or cfg.algo.ref_ema)  # a refreshed or EMA reference changes
    maybe_offload_reference(reference, cfg.model, world.size, reference_moves=moves)  # read from disk for its pass only
    maybe_hold_reference_in_bf16(reference, cfg.model, world.size, reference_moves=moves)  # weight casts made once
    optimizer = make_optimizer(policy.parameters(), cfg.optim.lr, cfg)
    critic_opt = make_optimizer(critic.parameters(), cfg.optim.critic_lr, cfg) if critic is not None else None
    run = Run(cfg=cfg, run_dir=run_dir, policy=policy, tokenizer=tokenizer, reference=reference,
              critic=critic, optimizer=optimizer, scheduler=make_scheduler(optimizer, cfg.optim.warmup_steps),
              critic_optimizer=critic_opt, kl_controller=make_kl_controller(cfg),
              stream=PromptStream(train_size, cfg.train.seed), world=world)
    run.shuffle_generator.manual_seed(cfg.train.seed + 1)
    run.extra_state["clock"] = StepClock()
    return run


def attach_reward_models(run: Run, learned) -> None:
    """The learned RM / PRM; with iterative refresh their weights change, so they are checkpointed."""
    run.learned_rewards = learned
    cfg = run.cfg
    run.reward_refreshers = make_refreshers(learned, cfg.rm, every=cfg.reward.iterative_every,
                                            replay_fraction=cfg.reward.replay_fraction, seed=cfg.train.seed,
                                            autocast=cfg.model.autocast)
    if run.cfg.reward.iterative_every:
        for refresher in run.reward_refreshers:
            run.extra_state[f"reward_model/{refresher.name}"] = refresher


# --------------------------------------------------------------------------- rollout


def score(rollout: Rollout, rewarder, examples, prompts) -> dict:
    """Fill rollout.scores; returns reward metrics (errors counted)."""
    picked = [examples[i] for i in rollout.example_index]
    columns = {"answer": [ex.answer for ex in picked],
               "completion_lengths": rollout.response_mask.sum(1).long().tolist()}
    for key in picked[0].meta if picked else ():
        columns[key] = [ex.meta.get(key) for ex in picked]
    scores = rewarder([prompts[i] for i in rollout.example_index], rollout.completions, columns)
    rollout.scores, rollout.reward_parts, rollout.valid = scores.total, scores.parts, scores.valid
    return {"reward/errors": scores.errors, "reward/dropped": int((~scores.valid).sum())}


def drop_invalid(rollout: Rollout) -> Rollout:
    """reward.on_error=drop: remove faulty samples from their groups."""
    if rollout.valid is None or bool(rollout.valid.all()):
        return rollout
    return rollout.select(rollout.valid.nonzero().squeeze(1))


def informative_groups(rollout: Rollout) -> torch.Tensor:
    """Group ids whose rewards are not all equal (DAPO dynamic sampling keeps these)."""
    gids, inverse = rollout.group_ids.unique(return_inverse=True)
    lo = torch.full((len(gids),), float("inf")).scatter_reduce(0, inverse, rollout.scores, "amin")
    hi = torch.full((len(gids),), float("-inf")).scatter_reduce(0, inverse, rollout.scores, "amax")
    return gids[hi > lo]


def sample_and_score(run: Run, engine, rewarder, examples, prompts, timings: dict) -> tuple[Rollout, dict]:
    """Draw B prompts (this rank's share of them), sample G completions each, score them."""
    cfg = run.cfg
    ids, draws = draw_share(run.stream, cfg.rollout.prompts_per_step, run.world)
    seeds = [prompt_seed(cfg.train.seed, d) for d in draws] if cfg.rollout.seeding == "per_prompt" else None
    t0 = time.perf_counter()
    rollout = sample_groups(engine, [prompts[i] for i in ids], cfg.rollout.group_size, seeds)
    rollout.example_index = [ids[i] for i in rollout.example_index]
    timings["time/generate"] += time.perf_counter() - t0
    t0 = time.perf_counter()
    metrics = score(rollout, rewarder, examples, prompts)
    if cfg.algo.estimator == "remax":
        t1 = time.perf_counter()
        greedy = engine.generate([prompts[i] for i in ids], 1, greedy=True)
        greedy.example_index = [ids[i] for i in greedy.example_index]
        timings["time/generate"] += time.perf_counter() - t1
        score(greedy, rewarder, examples, prompts)
        rollout.baseline_scores = greedy.scores[rollout.group_ids]
    timings["time/score"] += time.perf_counter() - t0
    return rollout, metrics


def collect_rollout(run: Run, engine, rewarder, examples, prompts) -> tuple[Rollout, dict]:
    """One batch of scored samples; with dynamic sampling, only informative groups, refilled."""
    cfg = run.cfg
    timings = {"time/generate": 0.0, "time/score": 0.0}
    rollout, metrics = sample_and_score(run, engine, rewarder, examples, prompts, timings)
    metrics["groups/zero_std_frac"] = 1 - len(informative_groups(rollout)) / len(rollout.group_ids.unique())
    metrics["accuracy"] = float(rollout.reward_parts.get("correctness", rollout.scores).mean())
    if cfg.algo.dynamic_sampling:
        rollout, metrics["groups/resampled"] = refill_groups(run, rollout, engine, rewarder, examples, prompts,
                                                             timings)
    rollout = drop_invalid(rollout)
    return rollout, {**metrics, **timings}


def keep_informative(rollout: Rollout) -> Rollout:
    return rollout.select(torch.isin(rollout.group_ids, informative_groups(rollout)).nonzero().squeeze(1))


def refill_groups(run: Run, rollout: Rollout, engine, rewarder, examples, prompts, timings) -> tuple[Rollout, int]:
    """Keep informative groups; sample more prompts until B groups or the round limit.

    Returns the rollout and the number of extra prompts sampled. If the limit is
    reached with fewer than B groups, the step trains on what it has (the loss
    normaliser is global, so a smaller batch is still an unbiased estimate).
    """
    want = run.cfg.rollout.prompts_per_step
    parts = [keep_informative(rollout)]
    kept, resampled = len(informative_groups(rollout)), 0
    for _ in range(run.cfg.algo.max_resample_rounds):
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


# --------------------------------------------------------------------------- log-probs and advantages


def add_logprobs(run: Run, rollout: Rollout) -> dict:
    """pi_old and pi_ref log-probs and critic values, each only where something uses it."""
    cfg, t0 = run.cfg, time.perf_counter()
    mb, temp, prec = cfg.algo.micro_batch_size, cfg.rollout.temperature, cfg.model.autocast
    old_needed = derived_sizes(cfg)["reuses_old_logprobs"] or cfg.algo.kl_in == "reward" or cfg.algo.tis_cap > 0
    if old_needed:
        rollout.old_logp = batched_logprobs(run.policy, rollout, temp, mb, prec)
    if run.reference is not None:
        rollout.ref_logp = batched_logprobs(run.reference, rollout, temp, mb, prec)
        release_weights(run.reference)  # an offloaded reference leaves memory before the update
    if run.critic is not None:
        rollout.values = batched_values(run.critic, rollout, mb, prec)
    return {"time/logprobs": time.perf_counter() - t0}


def advantage_options(cfg: Config) -> algos.AdvantageOptions:
    a = cfg.algo
    return algos.AdvantageOptions(gamma=a.gamma, lam=a.lam, eps=a.adv_eps, std_normalize=a.std_normalize,
                                  ddof=a.ddof, token_credit=a.token_credit, normalize=a.normalize)


def score_steps(run: Run, rollout: Rollout, examples, prompts) -> tuple[dict | None, dict]:
    """Process supervision (ref. 000): one reward per reasoning step, placed on the token where it ends."""
    cfg = run.cfg
    if cfg.algo.estimator != "grpo_process":
        return None, {}
    t0 = time.perf_counter()
    steps, metrics = process_step_inputs(rollout, run.tokenizer, prompts, examples, run.learned_rewards.process,
                                         cfg.reward.step_source, cfg.reward.step_separator)
    if cfg.reward.process_outcome_weight:
        steps["step_scores"] = add_outcome_to_last_step(steps["step_scores"], steps["step_mask"], rollout.scores,
                                                        cfg.reward.process_outcome_weight)
    metrics["time/score_steps"] = time.perf_counter() - t0
    return steps, metrics


def add_advantages(run: Run, rollout: Rollout, steps: dict | None = None) -> dict:
    """Advantages and returns from the configured estimator; KL-in-reward when asked."""
    cfg = run.cfg
    token_kl, metrics = None, {}
    if cfg.algo.kl_in == "reward" and rollout.ref_logp is not None:
        token_kl = algos.kl_penalty(rollout.old_logp, rollout.ref_logp, cfg.algo.kl_estimator) * rollout.response_mask
        tokens = rollout.response_mask.sum().clamp(min=1)
        metrics["kl/ref"] = float(token_kl.sum() / tokens)
        metrics["kl/reward_penalty"] = float(run.kl_controller.value * token_kl.sum(1).mean())
    inp = algos.AdvantageInput(scores=rollout.scores, response_mask=rollout.response_mask,
                               group_ids=rollout.group_ids, values=rollout.values, token_kl=token_kl,
                               kl_coef=run.kl_controller.value if token_kl is not None else 0.0,
                               baseline_scores=rollout.baseline_scores, **(steps or {}))
    adv, ret, adv_metrics = global_advantages(cfg.algo.estimator, inp, advantage_options(cfg))  # all ranks' batch
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


# --------------------------------------------------------------------------- update and reference refresh


def update(run: Run, rollout: Rollout) -> dict:
    """algo.epochs x algo.minibatches optimizer steps of the policy loss (and of the critic's)."""
    metrics = {}
    if run.cfg.train.grad_var_every and (run.step + 1) % run.cfg.train.grad_var_every == 0:
        metrics = measure_grad_variance(run.policy, rollout, run.cfg, run.kl_controller.value,
                                        seed=run.cfg.train.seed * 100003 + run.step)
    cfg, t0 = run.cfg, time.perf_counter()
    metrics.update(update_policy(run.policy, run.optimizer, run.scheduler, rollout, cfg, run.kl_controller.value,
                                 run.update_state, run.shuffle_generator))
    if run.critic is not None:
        metrics.update(update_critic(run.critic, run.critic_optimizer, rollout, cfg, run.update_state,
                                     run.shuffle_generator))
    metrics["optim/lr"] = run.scheduler.get_last_lr()[0]
    metrics["time/update"] = time.perf_counter() - t0
    return metrics


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
    """Iterative GRPO (ref. 000): RM/verifier agreement each step; the RM retrained every K steps."""
    metrics = {}
    for refresher in run.reward_refreshers:
        metrics.update(refresher.after_step(run.step, rollout, examples, prompts))
    return metrics


# --------------------------------------------------------------------------- metrics


def rollout_metrics(rollout: Rollout) -> dict:
    lengths = rollout.response_mask.sum(1)
    return {
        "reward/mean": float(rollout.scores.mean()),
        "reward/std": float(rollout.scores.std(unbiased=False)),
        **{f"reward/{k}": float(v.mean()) for k, v in rollout.reward_parts.items()},
        "response/len_mean": float(lengths.mean()),
        "response/len_max": float(lengths.max()),
        "response/truncated_frac": float(rollout.truncated.float().mean()),
    }


def memory_metrics(run: Run) -> dict:
    out = {"memory/peak_rss_mb": peak_rss_mb(), "memory/rss_mb": current_rss_mb(),
           "memory/params_mb/actor": param_memory_mb(run.policy)}
    if run.reference is not None:
        out["memory/params_mb/reference"] = param_memory_mb(run.reference)
    if run.critic is not None:
        out["memory/params_mb/critic"] = param_memory_mb(run.critic)
    opt_bytes = sum(t.numel() * t.element_size() for opt in (run.optimizer, run.critic_optimizer) if opt
                    for state in opt.state.values() for t in state.values() if torch.is_tensor(t))
    out["memory/params_mb/optimizer"] = opt_bytes / 2**20
    return out


def sample_rows(rollout: Rollout, examples, limit: int = 8) -> list[dict]:
    rows = []
    for i in range(min(limit, len(rollout))):
        ex = examples[rollout.example_index[i]]
        rows.append({"prompt": ex.prompt, "answer": ex.answer, "completion": rollout.completions[i],
                     "reward": float(rollout.scores[i]), "advantage": float(rollout.advantages[i][0])})
    return rows


# --------------------------------------------------------------------------- the loop


def run_eval(run: Run, engine, prompts, examples) -> dict:
    """Held-out accuracy; under torchrun each rank evaluates every W-th problem and the counts are pooled."""
    cfg, t0 = run.cfg, time.perf_counter()
    mine = uneven_share(list(range(len(prompts))), run.world)
    out = evaluate(engine, [prompts[i] for i in mine], [examples[i] for i in mine],
                   batch_size=cfg.rollout.eval_batch_size, max_new_tokens=cfg.rollout.eval_max_new_tokens,
                   pass_k=cfg.train.eval_pass_k)
    out = reduce_eval(out)
    out["time/eval"] = time.perf_counter() - t0
    return out


def release_sampling_copy(engine) -> None:
    """A bf16 sampling copy (covey/rollout/precision.py) is not read again before `sync_engine`
    refreshes it: free it for the reference pass and the update, where a step's memory peaks."""
    release = getattr(engine, "release_weights", None)
    if release is not None:
        release()


def sync_engine(run: Run, engine) -> dict:
    """Push the updated weights to an engine that holds its own copy (vLLM); the HF engine shares the module."""
    t0 = time.perf_counter()
    engine.sync_weights(run.policy)
    return {"time/sync_weights": time.perf_counter() - t0}


def learn_from_advantages(run: Run, rollout: Rollout, examples, prompts) -> dict:
    """Every algorithm but iterative DPO: step rewards -> log-probs -> advantages -> update."""
    steps, metrics = score_steps(run, rollout, examples, prompts)
    metrics.update(add_logprobs(run, rollout))
    metrics.update(add_advantages(run, rollout, steps))
    metrics.update(correct_sampler_mismatch(run, rollout))
    metrics.update(update(run, rollout))
    return metrics


def learn_from_pairs(run: Run, rollout: Rollout) -> dict:
    """Iterative DPO (covey/dpo.py): best-vs-worst pairs of each group, DPO steps against the reference."""
    metrics = dpo_update(run.policy, run.reference, run.optimizer, run.scheduler, rollout, run.cfg,
                         run.update_state, run.shuffle_generator)
    return {**metrics, "optim/lr": run.scheduler.get_last_lr()[0]}


def train_step(run: Run, engine, rewarder, data, prompts) -> dict:
    """One step: sample -> score -> (log-probs -> advantages -> update) or (pairs -> DPO update)."""
    t0 = time.perf_counter()
    rollout, metrics = collect_rollout(run, engine, rewarder, data.train, prompts)
    release_sampling_copy(engine)
    if len(rollout) == 0:  # reward.on_error=drop removed every sample: nothing to learn from
        return skip_empty_step(run, metrics, t0)
    if run.cfg.algo.learner == "dpo":  # the one learner without advantages
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
    if run.cfg.train.samples_every and run.step % run.cfg.train.samples_every == 0:
        run.logger.log_samples(run.step, sample_rows(rollout, data.train))
    return reduce_metrics(metrics)  # under torchrun: pooled over ranks (docs/scale.md, Metrics)


def skip_empty_step(run: Run, metrics: dict, t0: float) -> dict:
    """A step whose samples were all dropped: no update, counted like a non-finite one."""
    record_skip(run.update_state, run.cfg.optim.max_skipped_steps, "policy",
                "every sample dropped by reward faults")
    run.step += 1
    metrics.update({"reward/mean": float("nan"), "optim/skipped_steps": run.update_state.skipped_steps,
                    "kl/beta": run.kl_controller.value, "time/step": time.perf_counter() - t0})
    return metrics


def make_engine(run: Run):
    """hf / fast: generate with the policy module itself (whole parameters under FSDP); vllm: its own copy."""
    r = run.cfg.rollout
    if r.engine == "vllm":
        from covey.rollout.vllm import VLLMEngine
        return VLLMEngine.from_config(run.cfg.rollout, run.cfg.model, run.policy, run.tokenizer,
                                      seed=run.cfg.train.seed)
    engine = local_engine(r.engine, run.policy, run.tokenizer, max_new_tokens=r.max_new_tokens,
                          temperature=r.temperature, top_p=r.top_p, top_k=r.top_k, precision=rollout_precision(run))
    return GatheredGeneration(engine, run.policy)


def rollout_precision(run: Run) -> str:
    """A local engine's sampling precision; under torchrun the policy's own (a bf16 copy of a sharded policy is not built)."""
    return resolve_precision(run.cfg.rollout.precision, run.world.device) if run.world.size == 1 else "float32"


def make_eval_engine(run: Run, engine):
    """Held-out evaluation runs in the policy's own precision (what `covey eval` of the saved model
    measures): the rollout engine itself, or, when that samples from a bf16 copy, a local engine on
    the policy module (no second copy)."""
    if not isinstance(getattr(engine, "engine", None), LowPrecisionEngine):
        return engine
    r = run.cfg.rollout
    return GatheredGeneration(local_engine(r.engine, run.policy, run.tokenizer, max_new_tokens=r.max_new_tokens,
                                           temperature=r.temperature, top_p=r.top_p, top_k=r.top_k), run.policy)


def run_label(cfg: Config) -> str:
    """What the run trains, for its folder name: the DPO learner, or the advantage estimator."""
    return "dpo" if cfg.algo.learner == "dpo" else cfg.algo.estimator


def prepare_run_dir(cfg: Config) -> Path:
    name = cfg.train.run_name or broadcast_object(f"{run_label(cfg)}-{time.strftime('%Y%m%d-%H%M%S')}")
    run_dir = Path(cfg.train.output_dir) / name
    run_dir.mkdir(parents=True, exist_ok=True)
    return run_dir


def print_header(cfg: Config, run_dir: Path, data) -> None:
    sizes = derived_sizes(cfg)
    print(f"covey: run folder {run_dir}")
    print(f"covey: {run_label(cfg)} | estimator={cfg.algo.estimator} loss={cfg.algo.policy_loss} "
          f"agg={cfg.algo.loss_agg} beta={cfg.algo.beta} kl_in={cfg.algo.kl_in}")
    print("covey: sizes " + " ".join(f"{k}={v}" for k, v in sizes.items()))
    print(f"covey: task {cfg.task.name}: {len(data.train)} train / {len(data.eval)} held-out examples"
          + (f" ({data.skipped_rows} bad rows skipped)" if data.skipped_rows else ""))


def print_precision(run: Run) -> None:
    """What model.autocast=auto and rollout.precision=auto resolved to on this device."""
    cfg, device = run.cfg, run.world.device
    rollout = rollout_precision(run) if cfg.rollout.engine != "vllm" else "vllm's"
    print(f"covey: precision: parameters {cfg.model.dtype}, forward passes autocast="
          f"{resolve_autocast(cfg.model.autocast, device)}, rollouts {rollout}")


def start_or_resume(run: Run, resume_from: Path | None, engine, eval_engine, eval_prompts, data) -> dict:
    """Restore a checkpoint, or evaluate the untrained policy; returns the pre-training eval."""
    if resume_from is not None:
        with whole_tensors(run, gather=False):  # under FSDP: full states from disk into each rank's shards
            resumed = load_checkpoint(run, resume_from)
        engine.sync_weights(run.policy)  # an engine with its own copy of the weights (vLLM) takes these
        if resume_from.resolve().parent.parent == run.run_dir.resolve():
            run.logger.truncate_to(resumed.log_positions)  # drop lines of the steps to be redone
        else:
            run.logger.reset()  # another run's checkpoint: this run's logs start here
        print(f"covey: resumed from {resume_from} at step {run.step}")
        return resumed.eval_before
    run.logger.reset()
    before = run_eval(run, eval_engine, eval_prompts, data.eval)
    run.logger.log(0, {**before, "data/skipped_rows": data.skipped_rows})
    print(f"covey: held-out accuracy before training: {before['eval/accuracy']:.1%} "
          f"({before['eval/n']} problems, greedy)")
    return before


def run_loop(run: Run, engines: tuple, rewarder, data, prompts, eval_prompts, before: dict, stop,
             last_saved: int | None) -> None:
    """Steps until train.steps or a stop signal; a checkpoint every save_every steps and at the end."""
    from tqdm import tqdm
    cfg, (engine, eval_engine) = run.cfg, engines
    bar = tqdm(total=cfg.train.steps, initial=run.step, disable=not cfg.train.progress, unit="step")
    while run.step < cfg.train.steps and not out_of_time(run) and not stop.agreed():
        metrics = train_step(run, engine, rewarder, data, prompts)
        if cfg.train.eval_every and run.step % cfg.train.eval_every == 0 and run.step < cfg.train.steps:
            metrics.update(run_eval(run, eval_engine, eval_prompts, data.eval))
        run.logger.log(run.step, metrics)
        fault_point("step-logged", run.step)
        bar.set_postfix(reward=f"{metrics['reward/mean']:.2f}", acc=f"{metrics['accuracy']:.2f}",
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


def train(cfg: Config) -> dict:
    """Run training; returns a summary with held-out accuracy before and after."""
    import yaml

    check_resume_request(cfg)
    world = init_distributed(use_cuda=cfg.rollout.engine == "vllm", timeout_s=cfg.train.dist_timeout_s)
    validate_world(cfg, world.size)
    quiet_unless_main(world)
    apply_cpu_settings(cfg)
    data = load_task_data(cfg.task, cfg.train.seed)  # bad data fails before a model is loaded
    run_dir = prepare_run_dir(cfg)
    resume_from = resolve_resume(cfg, run_dir)  # so does a resume that cannot work
    print_header(cfg, run_dir, data)
    seed_everything(cfg.train.seed)
    learned = load_learned_rewards(cfg.reward)
    rewarder = build_rewarder(cfg, learned)
    run = build_run(cfg, run_dir, len(data.train), world)
    attach_reward_models(run, learned)
    print_precision(run)
    run.logger = (MetricsLogger(run_dir, tensorboard=cfg.train.logger == "tensorboard") if world.is_main
                  else SilentLogger())  # rank 0 alone writes files
    if world.is_main:
        (run_dir / "config.yaml").write_text(yaml.safe_dump(as_dict(cfg), sort_keys=False))
    prompts = format_prompts(run.tokenizer, data.train, cfg.task.system_prompt)
    eval_prompts = format_prompts(run.tokenizer, data.eval, cfg.task.system_prompt)
    context = getattr(run.policy.config, "max_position_embeddings", 2048)
    check_prompt_lengths(run.tokenizer, prompts, context - cfg.rollout.max_new_tokens, "train")
    check_prompt_lengths(run.tokenizer, eval_prompts, context - cfg.rollout.eval_max_new_tokens, "held-out")
    engine = make_engine(run)
    eval_engine = make_eval_engine(run, engine)

    with graceful_stop() as stop:
        before = start_or_resume(run, resume_from, engine, eval_engine, eval_prompts, data)
        decorrelate_ranks(world, cfg.train.seed, run.step)
        run_loop(run, (engine, eval_engine), rewarder, data, prompts, eval_prompts, before, stop,
                 last_saved=run.step if resume_from is not None else None)

    after = run_eval(run, eval_engine, eval_prompts, data.eval)
    run.logger.log(run.step, {**after, "final": 1})
    final_dir = save_on_main(run, save_final)
    summary = {"accuracy_before": before["eval/accuracy"], "accuracy_after": after["eval/accuracy"],
               "steps": run.step, "run_dir": str(run_dir), "final_model": str(final_dir)}
    print(f"covey: held-out accuracy {summary['accuracy_before']:.1%} -> {summary['accuracy_after']:.1%} "
          f"after {run.step} steps; model saved to {final_dir}")
    close_distributed()
    return summary
