"""The Plan's set-up sections: what `open_run` builds before the first step, in plain options.

`setup_sections` reads the Config once, when `make_plan` runs (after the data settled it), and gives
the Plan its sections:

    model      models.load.ModelOptions       the policy, its dtype, LoRA, kernels, the critic's backbone
    engine     rollout.factory.EngineOptions  the sampling engine, its precision, decode loop and vLLM settings
    optimizer  OptimizerOptions               optim.name, learning rates, betas, warm-up, offload
    rewards    rewards.build.RewardOptions    the reward terms, user functions, learned and remote scorers, the judge
    run        RunOptions                     the process (device), the run folder, resume, logger, held-out judge
    tools      ToolOptions                    rollout.tools / rollout.environment of tool-calling episodes, task.source

A section that a lower layer reads is defined beside the code that reads it (models/, rollout/,
rewards/ cannot import train/); each builder here takes the config sections it reads. Set-up functions
take these options, never the Config.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from covey.config import (
    Config,
    ConfigError,
    EvalConfig,
    ModelConfig,
    OptimConfig,
    RewardConfig,
    RMConfig,
    RolloutConfig,
    TaskConfig,
    TrainConfig,
    parse_loggers,
    parse_source,
)
from covey.config.schema_rewards import JudgeConfig
from covey.envs.harness import harness_options
from covey.envs.served import PlayOptions
from covey.envs.verifiers import verifiers_options
from covey.models.load import ModelOptions
from covey.rewards.build import RewardOptions
from covey.rewards.judge import JudgeOptions
from covey.rollout.factory import EngineOptions


@dataclass(frozen=True)
class OptimizerOptions:
    """The optimizers of the policy and the critic (optim.*; each field is the key of its name)."""
    name: str
    """adamw | adamw_8bit | adamw_4bit | adamw_bf16 | paged_adamw_8bit (covey.training.optim.OPTIMIZERS)."""
    lr: float
    critic_lr: float
    betas: tuple[float, float]
    """optim.betas, read as numbers."""
    weight_decay: float
    warmup_steps: int
    """Linear warm-up of the learning rate over this many steps (0: none)."""
    offload: bool
    """The optimizer state and its step on the CPU (torchao)."""


@dataclass(frozen=True)
class RunOptions:
    """The run's process, its folder and how held-out answers are judged (train.*, task.*, eval.*)."""
    device: str
    """train.device: auto | cpu | cuda."""
    dist_timeout_s: float
    balance_ranks: bool
    """train.balance_ranks: the update's rows spread over the ranks by tokens (covey/training/balance.py)."""
    output_dir: str
    run_name: str
    """'' = <label>-<start time> (covey/training/setup.py, prepare_run_dir)."""
    resume: str
    """train.resume: '' | auto | a checkpoint or run folder."""
    logger: tuple[str, ...]
    """train.logger read: the experiment trackers beside metrics.jsonl, e.g. ('trackio', 'tensorboard'); () = none."""
    logger_project: str
    eval_before_cache: str
    task_name: str
    system_prompt: str
    eval_metric: str
    """eval.metric as the data settled it (auto resolved; reward for prompt-only data)."""
    reward_threshold: float


@dataclass(frozen=True)
class ToolOptions:
    """The tools and the environment of tool-calling episodes (rollout.*; the turn budgets are the plan's
    `episodes`)."""
    tools: str
    """rollout.tools: built-in names, module:function or file.py:function, comma-separated."""
    environment: str
    """rollout.environment: module:Class or file.py:Class ('' = none)."""
    timeout_s: float
    """rollout.tool_timeout_s."""
    demo: str
    """rollout.tool_demo."""
    outside: PlayOptions | None = None
    """task.source=harness:<command> or verifiers:<taskset> (covey/envs/): who plays the episodes against
    covey's policy server; None: covey's engine."""
    openenv: str = ""
    """task.source=openenv:<target>: module:Class or the server's URL (covey/envs/openenv.py); '' = none."""

    @property
    def names(self) -> list[str]:
        """The items of rollout.tools."""
        return [item.strip() for item in self.tools.split(",") if item.strip()]


def setup_sections(cfg: Config) -> dict:
    """The Plan's set-up sections by field name (make_plan passes them to the Plan)."""
    return {"model": model_options(cfg.model), "engine": engine_options(cfg.rollout, cfg.train.seed),
            "optimizer": optimizer_options(cfg.optim),
            "rewards": reward_options(cfg.reward, cfg.rm, answer_key=cfg.task.answer_key,
                                      max_new_tokens=cfg.rollout.max_new_tokens,
                                      environment=bool(cfg.rollout.environment or openenv_target(cfg.task))
                                      or outside_source(cfg.task),
                                      max_steps=cfg.train.steps,
                                      judge=judge_options(cfg.reward.judge, cfg.rollout.group_size, cfg.train.device)),
            "run": run_options(cfg.train, cfg.task, cfg.eval), "tools": tool_options(cfg.rollout, cfg.task)}


def outside_source(t: TaskConfig) -> bool:
    """task.source=harness: or verifiers:: the harness's or the environment's reward is the term `environment`."""
    return parse_source(t.source)[0] in ("harness", "verifiers")


def openenv_target(t: TaskConfig) -> str:
    """task.source=openenv:<target>: the target, the episodes' environment (covey/envs/openenv.py); else ''."""
    kind, target = parse_source(t.source)
    return target if kind == "openenv" else ""


def model_options(m: ModelConfig) -> ModelOptions:
    return ModelOptions(path=m.path, dtype=m.dtype, autocast=m.autocast, critic_path=m.critic_path or m.path,
                        offload_reference=m.offload_reference, gradient_checkpointing=m.gradient_checkpointing,
                        lora_rank=m.lora_rank, lora_alpha=m.lora_alpha, lora_targets=m.lora_targets,
                        fused_kernels=m.fused_kernels, load_in_4bit=m.load_in_4bit, threads=m.threads)


def engine_options(r: RolloutConfig, seed: int) -> EngineOptions:
    return EngineOptions(engine=r.engine, precision=r.precision, decode=r.decode, max_new_tokens=r.max_new_tokens,
                         temperature=r.temperature, top_p=r.top_p, top_k=r.top_k, seed=seed,
                         vllm_gpu_memory_utilization=r.vllm_gpu_memory_utilization, vllm_sleep=r.vllm_sleep,
                         vllm_max_model_len=r.vllm_max_model_len, vllm_sync_bucket_mb=r.vllm_sync_bucket_mb,
                         vllm_sync_timeout_s=r.vllm_sync_timeout_s, slots=r.slots,
                         speculate=r.speculate)


def optimizer_options(o: OptimConfig) -> OptimizerOptions:
    b1, b2 = (float(x) for x in o.betas.split(","))
    return OptimizerOptions(name=o.name, lr=o.lr, critic_lr=o.critic_lr, betas=(b1, b2), weight_decay=o.weight_decay,
                            warmup_steps=o.warmup_steps, offload=o.offload)


def judge_options(j: JudgeConfig, group_size: int, device: str) -> JudgeOptions:
    return JudgeOptions(model=j.model.strip(), weight=j.weight, template=j.template, max_new_tokens=j.max_new_tokens,
                        endpoint_model=j.endpoint_model, token_env=j.token_env, timeout_s=j.timeout_s,
                        group_size=group_size, device=device)


def reward_options(r: RewardConfig, rm: RMConfig, *, answer_key: str, max_new_tokens: int, environment: bool,
                   max_steps: int, judge: JudgeOptions) -> RewardOptions:
    return RewardOptions(
        correctness=r.correctness, format=r.format, tool_use=r.tool_use, overlong_buffer=r.overlong_buffer,
        overlong_weight=r.overlong_weight, functions=tuple(s.strip() for s in r.functions.split(",") if s.strip()),
        on_error=r.on_error, timeout_s=r.timeout_s, max_failed_steps=r.max_failed_steps, model_path=r.model_path,
        model_weight=r.model_weight, prm_path=r.prm_path, prm_weight=r.prm_weight, step_separator=r.step_separator,
        remote_url=r.remote_url, remote_weight=r.remote_weight, remote_token_env=r.remote_token_env,
        remote_timeout_s=r.remote_timeout_s, remote_retries=r.remote_retries, remote_batch_size=r.remote_batch_size,
        iterative_every=r.iterative_every, replay_fraction=r.replay_fraction, language=r.language,
        language_target=r.language_target, rm=replace(rm), answer_key=answer_key, max_new_tokens=max_new_tokens,
        environment=environment, max_steps=max_steps, judge=judge)


def run_options(t: TrainConfig, task: TaskConfig, e: EvalConfig) -> RunOptions:
    return RunOptions(device=t.device, dist_timeout_s=t.dist_timeout_s, balance_ranks=t.balance_ranks,
                      output_dir=t.output_dir, run_name=t.run_name,
                      resume=t.resume, logger=parse_loggers(t.logger), logger_project=t.logger_project,
                      eval_before_cache=t.eval_before_cache, task_name=task.name,
                      system_prompt=task.system_prompt, eval_metric=e.metric, reward_threshold=e.reward_threshold)


def tool_options(r: RolloutConfig, t: TaskConfig) -> ToolOptions:
    kind, target = parse_source(t.source)
    if kind == "openenv" and r.environment:
        raise ConfigError(f"task.source={t.source} is the episodes' environment and rollout.environment="
                          f"{r.environment} another: set one or the other")
    if kind and kind != "openenv" and (r.tools or r.environment):
        raise ConfigError(f"task.source={kind}:... plays its episodes with its own tools: rollout.tools and "
                          "rollout.environment are covey's tool loop; set one or the other")
    play = {"harness": harness_options, "verifiers": verifiers_options}.get(kind)
    outside = (play(target, t.harness.concurrency, t.harness.timeout_s, r.max_turn_tokens or r.max_new_tokens,
                    r.temperature, r.top_p) if play is not None else None)
    return ToolOptions(tools=r.tools, environment=r.environment, timeout_s=r.tool_timeout_s, demo=r.tool_demo,
                       outside=outside, openenv=target if kind == "openenv" else "")
