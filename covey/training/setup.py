"""Everything a run builds before its first step, in the order `open_run` builds it.

The process world, the run folder, the models and their optimizers (`build_run`), the
metrics logger, the formatted prompts and the sampling engines (`open_feed`). `Run` holds
what a checkpoint restores, in typed fields; `Feed` what the steps read and never checkpoint.
Each function here reads the Plan's sections (covey/training/plan_setup.py), never the Config.
"""

from __future__ import annotations

import contextlib
import importlib.util
import random
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import yaml

from covey.config import ConfigError
from covey.envs.harness import harness_prompts
from covey.envs.served import served_engines
from covey.models.critic import ValueModel
from covey.models.kernels import apply_liger_kernels, check_model_options, resolve_fused_kernels, use_fused_head
from covey.models.load import ModelOptions, enable_gradient_checkpointing, load_policy
from covey.models.lora import add_adapters, frozen_reference
from covey.models.offload import maybe_hold_reference_in_bf16, maybe_offload_reference
from covey.rm.refresh import make_refreshers
from covey.rollout.agents import EpisodeEngine
from covey.rollout.factory import make_engine, make_eval_engine, sampling_precision
from covey.runtime.dist import DeviceError, SilentLogger, World, broadcast_object, init_distributed, quiet_unless_main
from covey.runtime.fsdp import shard_model
from covey.runtime.loggers import PACKAGES, TrackerOptions, missing_tracker, open_trackers
from covey.runtime.memory import MicroBatchSizes, on_gpu, size_update_pass
from covey.runtime.metrics import MetricsLogger
from covey.runtime.precision import resolve_autocast
from covey.runtime.signals import StopFlag
from covey.serve import context_length
from covey.tasks.data import PromptStream, format_prompts
from covey.tasks.verifiers import resolve_verifier, unreadable_answers
from covey.training.global_batch import GatheredGeneration
from covey.training.inputs import AgentInputs, make_agent
from covey.training.memory_fit import GpuFit, check_loaded_policy, fit_batches, trained_pairs
from covey.training.optim import check_optimizer, make_kl_controller, make_optimizer, make_scheduler
from covey.training.partial import CarryPool
from covey.training.plan import Plan
from covey.training.plan_setup import RunOptions
from covey.training.router_aux import with_router_aux
from covey.training.signal_watch import SignalWatch
from covey.training.token_weights import make_entropy_controller
from covey.training.update import UpdateState


@dataclass
class Run:
    """What the loop holds between steps (everything a checkpoint must restore)."""
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
    config_record: dict
    """The resolved config as config.yaml holds it: written with each checkpoint and compared on resume;
    never read for options (the plan holds those)."""
    update_state: UpdateState = field(default_factory=UpdateState)
    step: int = 0
    shuffle_generator: torch.Generator = field(default_factory=torch.Generator)
    logger: MetricsLogger | None = None
    world: World = field(default_factory=World)  # rank, process count, device (torchrun)
    clock: "StepClock" = field(default_factory=lambda: StepClock())
    """Seconds spent in training steps (train.max_minutes is a budget over them, resumes included)."""
    micro_batches: MicroBatchSizes = field(default_factory=lambda: MicroBatchSizes(8))
    """Batch sizes of the phases that halve on out-of-memory."""
    carried: CarryPool = field(default_factory=CarryPool)
    """rollout.partial: the groups carried to the next step (checkpointed when partial rollouts are on)."""
    learned_rewards: object = None  # covey.rewards.learned.LearnedRewards: learned RM / PRM
    reward_refreshers: list = field(default_factory=list)  # covey.rm.refresh.RewardModelRefresher
    entropy_controller: object = None
    """The entropy bonus's coefficient: algos.FixedEntropyController or AdaptiveEntropyController."""
    gpu_fit: GpuFit | None = None
    """On one GPU, the memory budget and what the update's sizing reads (covey/training/memory_fit.py)."""
    teacher: torch.nn.Module | None = None
    """algo.learner=distill's frozen teacher (covey/training/distill.py)."""
    sft_stream: PromptStream | None = None
    """The order of sft.data's conversations over the supervised steps (covey/training/sft.py)."""

    def checkpointed(self) -> dict:
        """The state objects a checkpoint holds beside models and optimizers, by name (each has state_dict):
        the step clock, the micro-batch sizes and, with iterative refresh, each refreshed reward model."""
        state = {"clock": self.clock, "micro_batches": self.micro_batches}
        if self.entropy_controller is not None:
            state["entropy_controller"] = self.entropy_controller
        if self.sft_stream is not None:
            state["sft_stream"] = self.sft_stream
        if self.plan.sampling.partial.extra:
            state["carried"] = self.carried
        state.update({f"reward_model/{r.name}": r for r in self.reward_refreshers if r.every})
        return state


@dataclass
class Feed:
    """What the steps read and never checkpoint: task data, formatted prompts, the rewarder, the engines."""
    data: object  # covey.tasks.data.TaskData: train / eval examples
    prompts: list[str]
    eval_prompts: list[str]
    rewarder: object  # covey.rewards.combine.Rewarder
    engine: object
    eval_engine: object
    judge: object = None  # covey.training.evaluate.Judge: how held-out answers are scored
    demos: object = None  # covey.training.sft.Demos: sft.data rendered to token ids (supervised steps)


@dataclass
class Session:
    """An open run: what `open_run` built, what `steps` advances and what `finish` closes. `run` holds
    the models, optimizers and typed state (a checkpoint restores it); `feed` the data, prompts,
    rewarder and engines; `before` the untrained policy's held-out metrics (or the resumed run's);
    `last` the newest step's metrics. A caller attaches module hooks to `run.policy` (a FLOP counter,
    a profiler) and stops early with `break`.
    """
    run: Run
    feed: Feed
    before: dict
    eval_cache: tuple[str, dict] | None = None  # train.eval_before_cache and the settings it is keyed by
    last: dict = field(default_factory=dict)
    last_saved: int | None = None
    stop: StopFlag = field(default_factory=StopFlag)
    signals: contextlib.ExitStack = field(default_factory=contextlib.ExitStack)
    watch: SignalWatch | None = None  # steps without learning signal (covey/training/signal_watch.py)

    def __post_init__(self):
        if self.watch is None:
            self.watch = SignalWatch.of(self.run.plan)

    def close(self) -> None:
        """Give the stop-signal handlers back (finish calls it; so does a caller that never finishes)."""
        self.signals.close()


@dataclass
class TrainResult:
    """What `covey.train(...)` returns."""
    run_dir: Path
    """The run folder (metrics.jsonl, samples.jsonl, checkpoints/, final/)."""
    final_model: Path | None
    """The trained policy as a Hugging Face folder (None when finish(..., save=False))."""
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


def open_world(plan: Plan) -> World:
    """This process among the torchrun processes (one without torchrun); then, before any model loads, what the
    device and the installed packages allow (open_run checks the config against the process count)."""
    world = init_distributed(plan.run.device, timeout_s=plan.run.dist_timeout_s)
    if plan.engine.engine == "vllm" and not world.device.startswith("cuda"):
        raise DeviceError("rollout.engine=vllm samples on a GPU: it needs train.device=cuda (or auto with a GPU)")
    quiet_unless_main(world)
    check_extras(plan)
    check_optimizer(plan.optimizer, world.device)  # optim.name / optim.offload: package and device
    check_model_options(plan.model.fused_kernels, plan.model.load_in_4bit, world.device)
    return world


def check_extras(plan: Plan) -> None:
    """An optional package a setting needs is one line naming its pip extra, before any model loads."""
    m = plan.model
    missing = missing_tracker(plan.run.logger)
    needs = ((f"train.logger={','.join(plan.run.logger)}", missing is not None, PACKAGES.get(missing), missing),
             (f"model.lora_rank={m.lora_rank}", m.lora_rank > 0, "peft", "lora"),
             ("task.name=hf", plan.run.task_name == "hf", "datasets", "datasets"),
             ("rollout.engine=vllm", plan.engine.engine == "vllm", "vllm", "vllm"))
    for setting, used, package, extra in needs:
        if used and importlib.util.find_spec(package) is None:
            raise ConfigError(f"{setting} needs the optional package {package}: pip install 'covey[{extra}]'")


def prepare_run_dir(run: RunOptions, label: str) -> Path:
    """runs/<train.run_name>, or runs/<label>-<start time> (rank 0's clock on every rank); not made yet: a run
    refused before its model loads leaves no empty folder (a reward function's traceback makes it, to keep the
    traceback)."""
    name = run.run_name or broadcast_object(f"{label}-{time.strftime('%Y%m%d-%H%M%S')}")
    return Path(run.output_dir) / name


def print_header(run_dir: Path, task: str, data) -> None:
    print(f"covey: run folder {run_dir}")
    print(f"covey: task {task}: {len(data.train)} train / {len(data.eval)} held-out examples"
          + (f" ({data.skipped_rows} bad rows skipped)" if data.skipped_rows else ""))
    if data.overlap:
        print(f"covey: warning: {data.overlap} of {len(data.eval)} held-out examples are also training "
              "examples (same prompt and answer): held-out accuracy overstates what was learned")
    for note in data.notes:  # what the data decided (no held-out set, no answers, a large held-out share)
        print(f"covey: {note}")


def choose_verifier(plan: Plan, data) -> str:
    """The verifier of the correctness reward and of held-out accuracy (eval.metric, `auto` resolved
    from the answers), printed with a warning when the math verifier cannot read some answers."""
    metric = plan.run.eval_metric
    answers = [ex.answer for ex in (*data.train, *data.eval) if ex.answer is not None]  # none: prompt-only data
    verifier = resolve_verifier(metric, answers)
    what = (f"reward >= {plan.run.reward_threshold:g} (eval.metric=reward)" if metric == "reward"
            else f"accuracy by the {verifier} verifier" + (" (eval.metric=auto)" if metric == "auto" else ""))
    print(f"covey: held-out metric: {what}")
    bad = unreadable_answers(verifier, answers)
    if bad and (plan.rewards.correctness or metric != "reward"):
        print(f"covey: warning: {bad} of {len(answers)} reference answers are not numbers, which the math "
              "verifier scores 0 whatever the model writes: set eval.metric=normalized, exact or contains")
    return verifier


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


# --------------------------------------------------------------------------- models and optimizers


def build_run(plan: Plan, run_dir: Path, train_size: int, world: World | None = None,
              record: dict | None = None) -> Run:
    """Models, optimizers and controllers, in the order they are needed; `record`: the config as config.yaml
    holds it (covey.config.as_dict)."""
    m, o, seed, world = plan.model, plan.optimizer, plan.schedule.seed, world or World()
    plan = with_router_aux(plan, m.path, plan.update.router_aux_coef)  # from the model's config, before it loads
    policy, tokenizer = load_trained_policy(m, world)
    check_loaded_policy(policy, plan, world.device, world.size)  # a run that cannot fit stops here
    reference = frozen_reference(policy) if plan.needs_reference else None
    critic = (ValueModel.from_policy_path(m.critic_path, dtype=getattr(torch, m.dtype)) if plan.needs_critic
              else None)
    if m.gradient_checkpointing:
        checkpoint_activations(policy, critic)
    # On the training device; under torchrun sharded with FSDP2 (optimizers are built on the shards).
    policy, reference, critic = (shard_model(model, world.device) for model in (policy, reference, critic))
    moves = plan.reference.moves  # a refreshed or EMA reference changes
    maybe_offload_reference(reference, m, world.size, reference_moves=moves)  # read from disk for its pass only
    maybe_hold_reference_in_bf16(reference, m, world.size, reference_moves=moves)  # weight casts made once
    optimizer = make_optimizer(policy.parameters(), o.lr, o)
    critic_opt = make_optimizer(critic.parameters(), o.critic_lr, o) if critic is not None else None
    run = Run(plan=plan, run_dir=run_dir, policy=policy, tokenizer=tokenizer, reference=reference,
              critic=critic, optimizer=optimizer, scheduler=make_scheduler(optimizer, o.warmup_steps),
              critic_optimizer=critic_opt, kl_controller=make_kl_controller(plan.kl),
              entropy_controller=make_entropy_controller(plan),
              stream=PromptStream(train_size, seed), config_record=record or {}, world=world,
              micro_batches=MicroBatchSizes(plan.update.micro_batch_size,  # halved on out-of-memory
                                            prompts_per_call=plan.sampling.prompts_per_step))
    run.shuffle_generator.manual_seed(seed + 1)
    return run


def load_trained_policy(m: ModelOptions, world: World) -> tuple:
    """(policy, tokenizer): the policy loaded (4-bit straight onto the GPU with model.load_in_4bit), Liger's
    kernels patched in where model.fused_kernels resolves to on (printed on a GPU), then the LoRA adapters."""
    policy, tokenizer = load_policy(m.path, dtype=getattr(torch, m.dtype), load_in_4bit=m.load_in_4bit,
                                    device=world.device if m.load_in_4bit else "cpu")
    fused, why = resolve_fused_kernels(m.fused_kernels, world.device)
    if on_gpu(world.device):  # on a CPU there is nothing to choose: the line would only be noise
        print(f"covey: fused kernels {why}" + (", model weights 4-bit NF4 (QLoRA)" if m.load_in_4bit else ""))
    if fused:
        apply_liger_kernels(policy)
    if m.lora_rank:  # train adapters only; the reference is then the base with adapters off
        policy = add_adapters(policy, m.lora_rank, m.lora_alpha, m.lora_targets)
    if fused and world.size == 1:  # log-prob passes without micro-batch-wide logits (not under FSDP's root)
        use_fused_head(policy)
    return policy, tokenizer


def checkpoint_activations(*models) -> None:
    """model.gradient_checkpointing on the trained models (the reference runs without gradients)."""
    for model in models:
        if model is not None and not enable_gradient_checkpointing(model):
            raise ConfigError(f"model.gradient_checkpointing: {type(model).__name__} does not support it")


def attach_reward_models(run: Run, learned) -> None:
    """The learned RM / PRM; with iterative refresh their weights change, so they are checkpointed."""
    r = run.plan.rewards
    run.learned_rewards = learned
    run.reward_refreshers = make_refreshers(learned, r.rm, every=r.iterative_every, replay_fraction=r.replay_fraction,
                                            seed=run.plan.schedule.seed, autocast=run.plan.model.autocast)


def print_precision(run: Run) -> None:
    """What model.autocast=auto and rollout.precision=auto resolved to on this device."""
    device, m, plan = run.world.device, run.plan.model, run.plan
    rollout = (sampling_precision(plan.engine, run.world.size, device, m.load_in_4bit) if plan.engine.engine != "vllm"
               else "vllm's")
    if rollout == "float32" and m.dtype == "bfloat16":  # bf16 weights sample themselves (rollout/local.py)
        rollout = "bfloat16"
    print(f"covey: precision: parameters {m.dtype}, forward passes autocast="
          f"{resolve_autocast(m.autocast, device)}, rollouts {rollout}")
    if plan.gpu_memory_gib and not on_gpu(device):
        print(f"covey: note: train.gpu_memory_gib={plan.gpu_memory_gib:g} budgets a GPU's memory: on the CPU it "
              "is not used (micro-batches stay at algo.micro_batch_size)")


# --------------------------------------------------------------------------- logger, prompts, engines


def open_feed(run: Run, data, rewarder, agent: AgentInputs | None = None) -> Feed:
    """The metrics logger and config.yaml (rank 0 alone writes files), the prompts, the engines; with
    tools or an environment (`agent`, from `prepare_agent`), engines that sample whole episodes
    (covey/rollout/agents.py)."""
    plan = run.plan
    trackers = TrackerOptions(plan.run.logger, plan.run.logger_project, run.run_dir, resume=bool(plan.run.resume),
                              config=run.config_record)
    run.logger = MetricsLogger(run.run_dir, open_trackers(trackers)) if run.world.is_main else SilentLogger()
    if run.world.is_main:
        (run.run_dir / "config.yaml").write_text(yaml.safe_dump(run.config_record, sort_keys=False))
    agents = None
    if run.plan.episodes is not None:  # one Agent for training, one for evaluation: their tool counts apart
        agents = [make_agent(plan.tools, run.tokenizer, agent) for _ in range(2)]
        prompts = agents[0].prompts(data.train, plan.run.system_prompt)
        eval_prompts = agents[1].prompts(data.eval, plan.run.system_prompt)
    else:
        prompts = format_prompts(run.tokenizer, data.train, plan.run.system_prompt)
        eval_prompts = format_prompts(run.tokenizer, data.eval, plan.run.system_prompt)
    if on_gpu(run.world.device) and run.world.size == 1 and prompts:  # torchrun: ranks keep the configured size
        fit_batches(run, max(len(run.tokenizer(p, add_special_tokens=False)["input_ids"]) for p in prompts))
    engine, eval_engine = open_engines(run)
    if run.world.is_main:  # which engine, decode step, cache and episode runner, and why
        print(f"covey: sampling with the {engine.decode_path()}")
    if agents is not None:
        engine, eval_engine = (EpisodeEngine(e, a.episodes, run.plan.episodes, a.metrics)
                               for e, a in zip((engine, eval_engine), agents))
    if plan.tools.outside is not None:  # task.source=harness: / verifiers: (covey/envs/served.py)
        prompts, eval_prompts = (harness_prompts(run.tokenizer, rows, plan.run.system_prompt)
                                 for rows in (data.train, data.eval))
        engine, eval_engine = served_engines(plan.tools.outside, engine, eval_engine, context_length(run.policy))
    return Feed(data=data, prompts=prompts, eval_prompts=eval_prompts, rewarder=rewarder, engine=engine,
                eval_engine=eval_engine)


def open_engines(run: Run) -> tuple:
    """The sampling engine and the held-out one (the same engine where it samples the policy's own weights)."""
    options = run.plan.engine
    engine = make_engine(options, run.plan.model, run.policy, run.tokenizer, world_size=run.world.size,
                         device=run.world.device)
    if options.engine != "vllm":  # a local engine reads the policy module itself (whole parameters under FSDP)
        engine = GatheredGeneration(engine, run.policy)
    eval_engine = make_eval_engine(options, run.policy, run.tokenizer, engine)
    return engine, engine if eval_engine is None else GatheredGeneration(eval_engine, run.policy)


def size_update(run: Run, rollout) -> None:
    """Before the first update on one GPU: the update's micro-batches fitted to what is left of train.gpu_memory_gib
    (covey/runtime/memory.py); nothing on a CPU or under torchrun."""
    if run.gpu_fit is None:
        return
    size_update_pass(run.micro_batches, run.gpu_fit.update_per_position, trained_pairs(run),
                     rollout.prompt_ids.shape[1] + rollout.response_ids.shape[1], len(rollout), run.world.device,
                     run.gpu_fit.budget)
