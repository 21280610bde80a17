"""Everything a run builds before its first step, in the order `train()` builds it.

The process world, the run folder, the models and their optimizers (`build_run`), the
metrics logger, the formatted prompts and the sampling engines (`open_feed`). `Run` holds
what a checkpoint restores; `Feed` what the steps read and never checkpoint.
"""

from __future__ import annotations

import importlib.util
import random
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import yaml

from covey import algos
from covey.config import Config, ConfigError, as_dict, validate_world
from covey.models.critic import ValueModel
from covey.models.load import enable_gradient_checkpointing, load_policy
from covey.models.lora import add_adapters, frozen_reference
from covey.models.offload import maybe_hold_reference_in_bf16, maybe_offload_reference
from covey.rm.refresh import make_refreshers
from covey.rollout.local import DecodeOptions, local_engine
from covey.rollout.precision import LowPrecisionEngine, resolve_precision
from covey.rollout.vllm import VLLMEngine
from covey.runtime.cpu import apply_cpu_settings
from covey.runtime.dist import (DeviceError, SilentLogger, World, broadcast_object, describe_device,
                                init_distributed, quiet_unless_main)
from covey.runtime.fsdp import shard_model
from covey.runtime.memory import MicroBatchSizes, on_gpu, rows_per_no_grad_pass, rows_per_update_pass
from covey.runtime.metrics import MetricsLogger
from covey.runtime.precision import resolve_autocast
from covey.tasks.data import PromptStream, check_prompt_lengths, format_prompts
from covey.tasks.verifiers import resolve_verifier, unreadable_answers
from covey.train.global_batch import GatheredGeneration
from covey.train.plan import KLOptions, Plan, make_plan
from covey.train.update import UpdateState


@dataclass
class Run:
    """What the loop holds between steps (everything a checkpoint must restore)."""
    cfg: Config
    plan: Plan
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
    reward_refreshers: list = field(default_factory=list)  # covey.rm.refresh.RewardModelRefresher


@dataclass
class Feed:
    """What the steps read and never checkpoint: task data, formatted prompts, the rewarder, the engines."""
    data: object  # covey.tasks.data.TaskData: train / eval examples
    prompts: list[str]
    eval_prompts: list[str]
    rewarder: object  # covey.rewards.combine.Rewarder
    engine: object
    eval_engine: object
    judge: object = None  # covey.train.evaluate.Judge: how held-out answers are scored


@dataclass
class TrainResult:
    """What `covey.train(...)` returns."""
    run_dir: Path
    """The run folder (metrics.jsonl, samples.jsonl, checkpoints/, final/)."""
    final_model: Path
    """The trained policy as a Hugging Face folder."""
    steps: int
    """Training steps done (resumed ones included)."""
    metrics: dict
    """The last step's metrics (empty when no step ran)."""
    accuracy_before: float | None
    """Held-out greedy accuracy of the untrained policy by the task's verifier (None with eval.metric=reward)."""
    accuracy_after: float | None
    """Held-out greedy accuracy after training (None with eval.metric=reward)."""
    eval_before: dict = field(default_factory=dict)
    """Every held-out metric before training (eval/accuracy, or eval/reward_mean and eval/reward_pass, ...)."""
    eval_after: dict = field(default_factory=dict)
    """Every held-out metric after training."""


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


# --------------------------------------------------------------------------- process and run folder


def open_world(cfg: Config) -> World:
    """This process among the torchrun processes (one without torchrun); rank 0 alone prints."""
    world = init_distributed(cfg.train.device, timeout_s=cfg.train.dist_timeout_s)
    if cfg.rollout.engine == "vllm" and not world.device.startswith("cuda"):
        raise DeviceError("rollout.engine=vllm samples on a GPU: it needs train.device=cuda (or auto with a GPU)")
    validate_world(cfg, world.size)
    quiet_unless_main(world)
    apply_cpu_settings(cfg)
    print(f"covey: device {describe_device(world.device)}")
    check_extras(cfg)
    return world


def check_extras(cfg: Config) -> None:
    """An optional package a setting needs is one line naming its pip extra, before any model loads."""
    needs = (("train.logger=tensorboard", cfg.train.logger == "tensorboard", "tensorboard", "tensorboard"),
             (f"model.lora_rank={cfg.model.lora_rank}", cfg.model.lora_rank > 0, "peft", "lora"),
             ("task.name=hf", cfg.task.name == "hf", "datasets", "datasets"),
             ("rollout.engine=vllm", cfg.rollout.engine == "vllm", "vllm", "vllm"))
    for setting, used, package, extra in needs:
        if used and importlib.util.find_spec(package) is None:
            raise ConfigError(f"{setting} needs the optional package {package}: pip install 'covey[{extra}]'")


def prepare_run_dir(cfg: Config, label: str) -> Path:
    """runs/<train.run_name>, or runs/<label>-<start time> (rank 0's clock on every rank)."""
    name = cfg.train.run_name or broadcast_object(f"{label}-{time.strftime('%Y%m%d-%H%M%S')}")
    run_dir = Path(cfg.train.output_dir) / name
    run_dir.mkdir(parents=True, exist_ok=True)
    return run_dir


def print_header(run_dir: Path, task: str, data) -> None:
    print(f"covey: run folder {run_dir}")
    print(f"covey: task {task}: {len(data.train)} train / {len(data.eval)} held-out examples"
          + (f" ({data.skipped_rows} bad rows skipped)" if data.skipped_rows else ""))
    if data.overlap:
        print(f"covey: warning: {data.overlap} of {len(data.eval)} held-out examples are also training "
              "examples (same prompt and answer): held-out accuracy overstates what was learned")


def choose_verifier(cfg: Config, data) -> str:
    """The verifier of the correctness reward and of held-out accuracy (eval.metric, `auto` resolved
    from the answers), printed with a warning when the math verifier cannot read some answers."""
    metric = cfg.eval.metric
    answers = [ex.answer for ex in (*data.train, *data.eval)]
    verifier = resolve_verifier(metric, answers)
    what = (f"reward >= {cfg.eval.reward_threshold:g} (eval.metric=reward)" if metric == "reward"
            else f"accuracy by the {verifier} verifier" + (" (eval.metric=auto)" if metric == "auto" else ""))
    print(f"covey: held-out metric: {what}")
    bad = unreadable_answers(verifier, answers)
    if bad and (cfg.reward.correctness or metric != "reward"):
        print(f"covey: warning: {bad} of {len(answers)} reference answers are not numbers, which the math "
              "verifier scores 0 whatever the model writes: set eval.metric=normalized, exact or contains")
    return verifier


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


# --------------------------------------------------------------------------- models and optimizers


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
    updates on a 2-core CPU (dev/LOG.md, 2026-11-25). Allocated before any pass, they sit below
    the activations. The steps are bit-identical (tests/test_speed_update.py).
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


def make_kl_controller(kl: KLOptions):
    if kl.target > 0:
        return algos.AdaptiveKLController(kl.beta, kl.target, kl.horizon)
    return algos.FixedKLController(kl.beta)


def build_run(cfg: Config, run_dir: Path, train_size: int, world: World | None = None,
              plan: Plan | None = None) -> Run:
    """Models, optimizers and controllers, in the order they are needed (`plan`: made from cfg if None)."""
    plan, dtype, world = plan or make_plan(cfg), getattr(torch, cfg.model.dtype), world or World()
    policy, tokenizer = load_policy(cfg.model.path, dtype=dtype)
    if cfg.model.lora_rank:  # train adapters only; the reference is then the base with adapters off
        policy = add_adapters(policy, cfg.model.lora_rank, cfg.model.lora_alpha, cfg.model.lora_targets)
    reference = frozen_reference(policy) if plan.needs_reference else None
    critic = (ValueModel.from_policy_path(cfg.model.critic_path or cfg.model.path, dtype=dtype)
              if plan.needs_critic else None)
    if cfg.model.gradient_checkpointing:
        checkpoint_activations(policy, critic)
    # On the training device; under torchrun sharded with FSDP2 (optimizers are built on the shards).
    policy, reference, critic = (shard_model(m, world.device) for m in (policy, reference, critic))
    moves = bool(cfg.algo.ref_refresh_every or cfg.algo.ref_ema)  # a refreshed or EMA reference changes
    maybe_offload_reference(reference, cfg.model, world.size, reference_moves=moves)  # read from disk for its pass only
    maybe_hold_reference_in_bf16(reference, cfg.model, world.size, reference_moves=moves)  # weight casts made once
    optimizer = make_optimizer(policy.parameters(), cfg.optim.lr, cfg)
    critic_opt = make_optimizer(critic.parameters(), cfg.optim.critic_lr, cfg) if critic is not None else None
    run = Run(cfg=cfg, plan=plan, run_dir=run_dir, policy=policy, tokenizer=tokenizer, reference=reference,
              critic=critic, optimizer=optimizer, scheduler=make_scheduler(optimizer, cfg.optim.warmup_steps),
              critic_optimizer=critic_opt, kl_controller=make_kl_controller(plan.kl),
              stream=PromptStream(train_size, cfg.train.seed), world=world)
    run.shuffle_generator.manual_seed(cfg.train.seed + 1)
    run.extra_state["clock"] = StepClock()
    run.extra_state["micro_batches"] = MicroBatchSizes(plan.update.micro_batch_size,  # halved on out-of-memory
                                                       prompts_per_call=cfg.rollout.prompts_per_step)
    return run


def checkpoint_activations(*models) -> None:
    """model.gradient_checkpointing on the trained models (the reference runs without gradients)."""
    for model in models:
        if model is not None and not enable_gradient_checkpointing(model):
            raise ConfigError(f"model.gradient_checkpointing: {type(model).__name__} does not support it")


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


def print_precision(run: Run) -> None:
    """What model.autocast=auto and rollout.precision=auto resolved to on this device."""
    cfg, device = run.cfg, run.world.device
    rollout = rollout_precision(run) if cfg.rollout.engine != "vllm" else "vllm's"
    print(f"covey: precision: parameters {cfg.model.dtype}, forward passes autocast="
          f"{resolve_autocast(cfg.model.autocast, device)}, rollouts {rollout}")


# --------------------------------------------------------------------------- logger, prompts, engines


def open_feed(run: Run, data, rewarder) -> Feed:
    """The metrics logger and config.yaml (rank 0 alone writes files), the prompts, the engines."""
    cfg = run.cfg
    run.logger = (MetricsLogger(run.run_dir, tensorboard=cfg.train.logger == "tensorboard") if run.world.is_main
                  else SilentLogger())
    if run.world.is_main:
        (run.run_dir / "config.yaml").write_text(yaml.safe_dump(as_dict(cfg), sort_keys=False))
    prompts = format_prompts(run.tokenizer, data.train, cfg.task.system_prompt)
    eval_prompts = format_prompts(run.tokenizer, data.eval, cfg.task.system_prompt)
    context = getattr(run.policy.config, "max_position_embeddings", 2048)
    check_prompt_lengths(run.tokenizer, prompts, context - cfg.rollout.max_new_tokens, "train")
    check_prompt_lengths(run.tokenizer, eval_prompts, context - cfg.rollout.eval_max_new_tokens, "held-out")
    size_no_grad_passes(run, prompts)
    engine = make_engine(run)
    return Feed(data=data, prompts=prompts, eval_prompts=eval_prompts, rewarder=rewarder, engine=engine,
                eval_engine=make_eval_engine(run, engine))


def size_no_grad_passes(run: Run, prompts: list[str]) -> None:
    """On one GPU the no-grad log-prob passes (old policy, reference, values) take as many sequences as
    fit in a quarter of the free memory (covey/runtime/memory.py), at least algo.micro_batch_size: fewer,
    larger passes. Halved on out-of-memory like any phase; under torchrun every rank keeps the
    configured size (their passes must pair up)."""
    if not on_gpu(run.world.device) or run.world.size > 1 or not prompts:
        return
    r, sizes = run.cfg.rollout, run.extra_state["micro_batches"]
    longest = max(len(run.tokenizer(p, add_special_tokens=False)["input_ids"]) for p in prompts)
    free, _ = torch.cuda.mem_get_info(torch.device(run.world.device))
    sizes.sizes["logprobs"] = rows_per_no_grad_pass(run.policy.config, longest + r.max_new_tokens, free,
                                                    sizes.sizes["logprobs"], r.prompts_per_step * r.group_size)


def size_update_pass(run: Run, rollout) -> None:
    """Before the first update on one GPU: its micro-batches take as many sequences as fit in
    algo.update_memory_share of the free GPU memory, less the gradients and optimizer state not yet
    allocated (covey/runtime/memory.py), at least algo.micro_batch_size; fewer, larger micro-batches
    launch fewer kernels, and the gradient does not change. Once per process, and never after an
    out-of-memory halved a size (a resumed run keeps its checkpointed sizes then)."""
    sizes, share = run.extra_state["micro_batches"], run.cfg.algo.update_memory_share
    if not on_gpu(run.world.device) or run.world.size > 1 or share <= 0 or sizes.oom_retries or sizes.update_sized:
        return
    sizes.update_sized = True
    device = torch.device(run.world.device)
    pending = 0
    for model, optimizer in ((run.policy, run.optimizer), (run.critic, run.critic_optimizer)):
        if model is None:
            continue
        trained = [p for p in model.parameters() if p.requires_grad]
        pending += sum(p.numel() * p.element_size() for p in trained if p.grad is None)  # gradients
        if not optimizer.state:  # AdamW's two moments, made at the first optimizer step
            pending += 2 * sum(p.numel() * p.element_size() for p in trained)
    free, _ = torch.cuda.mem_get_info(device)
    cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    element = 2 if resolve_autocast(run.cfg.model.autocast, device) == "bfloat16" else 4
    positions = rollout.prompt_ids.shape[1] + rollout.response_ids.shape[1]
    least = sizes.sizes["update"]
    sizes.sizes["update"] = rows_per_update_pass(run.policy.config, positions, free + cached - pending,
                                                 least, len(rollout), element, share)
    if sizes.sizes["update"] > least:  # the memory this takes is the user's to know (and to refuse)
        print(f"covey: update micro-batches of {sizes.sizes['update']} sequences, sized to "
              f"algo.update_memory_share={share:g} of {free / 2**30:.1f} GiB free GPU memory "
              f"(algo.update_memory_share=0 keeps {least})")


def make_engine(run: Run):
    """hf / fast: generate with the policy module itself (whole parameters under FSDP); vllm: its own copy."""
    r = run.cfg.rollout
    if r.engine == "vllm":
        return VLLMEngine.from_config(run.cfg.rollout, run.cfg.model, run.policy, run.tokenizer,
                                      seed=run.cfg.train.seed)
    engine = local_engine(r.engine, run.policy, run.tokenizer, max_new_tokens=r.max_new_tokens,
                          temperature=r.temperature, top_p=r.top_p, top_k=r.top_k, precision=rollout_precision(run),
                          decode=decode_options(r))
    return GatheredGeneration(engine, run.policy)


def decode_options(r, persistent: bool = True) -> DecodeOptions:
    """The fast engine's static cache and CUDA graphs (rollout.decode)."""
    return DecodeOptions(r.decode, persistent)


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
    # its buffers and graphs are freed after each evaluation: it runs seldom, and holds the fp32 policy's
    return GatheredGeneration(local_engine(r.engine, run.policy, run.tokenizer, max_new_tokens=r.max_new_tokens,
                                           temperature=r.temperature, top_p=r.top_p, top_k=r.top_k,
                                           decode=decode_options(r, persistent=False)), run.policy)
