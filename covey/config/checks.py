"""Checks of a Config, run when it is loaded: closed option sets, positive sizes, combinations
that cannot work, and what a run on several processes needs; then the sizes a config implies.

covey.config imports no torch and no covey.algos: the names of estimators, policy losses and
KL estimators, and what an estimator needs (groups of at least two samples, per-token rewards,
step scores), are checked by the plan from the registries' traits (covey/training/plan_checks.py).
Every error is one line naming the key.
"""

from __future__ import annotations

from covey.config.schema import REASONING_GYM, Config, ConfigError, TaskConfig, parse_loggers, parse_source

MULTISTEP_OPS = ("+", "-", "*")
"""Operations a multistep problem may draw (task.ops is a subset)."""

WORD_MAX_STEPS = 4
"""Most arithmetic operations a word problem may take (task.word_steps lies in 1..WORD_MAX_STEPS)."""

CORRUPTION_KINDS = ("result", "operand", "operator", "carry", "unrelated", "stopped")
"""Errors that PRM training data may inject into a reference solution (rm.corruption_kinds)."""

FILE_TASKS = ("file", "jsonl", "hf")
"""task.name values that read task.path (one loader: the path's suffix or folder decides)."""

CHOICES = {
    "model.dtype": ("float32", "bfloat16"),
    "model.autocast": ("none", "bfloat16", "auto"),
    "optim.name": ("adamw", "adamw_8bit", "adamw_4bit", "adamw_bf16", "paged_adamw_8bit"),
    "model.fused_kernels": ("auto", "on", "off"),
    "task.name": ("arithmetic", "multistep", "wordproblems", "file", "jsonl", "hf", f"{REASONING_GYM}<dataset>"),
    "task.on_bad_row": ("raise", "skip"),
    "task.kind": ("add", "sub", "mul", "mixed"),
    "rollout.engine": ("hf", "fast", "vllm"),
    "rollout.seeding": ("global", "per_prompt"),
    "rollout.precision": ("auto", "float32", "bfloat16"),
    "rollout.decode": ("auto", "plain", "static", "graphs", "compile"),
    "reward.on_error": ("raise", "zero", "drop"),
    "reward.step_source": ("prm", "exact", "turns"),
    "reward.language_target": ("en", "fr", "de", "es", "it", "pt", "latin", "zh", "ja", "ko", "cjk"),
    "rm.objective": ("bt", "prm"),
    "algo.learner": ("advantage", "dpo", "sft", "distill"),
    "algo.distill.loss": ("reverse_kl", "jsd"),
    "algo.kl_in": ("loss", "reward", "none"),
    "train.device": ("auto", "cpu", "cuda"),
    "eval.metric": ("auto", "math", "exact", "normalized", "contains", "reasoning_gym", "reward"),
}

POSITIVE = ("rollout.prompts_per_step", "rollout.group_size", "rollout.max_new_tokens",
            "algo.epochs", "algo.minibatches", "algo.micro_batch_size", "train.steps",
            "rollout.eval_batch_size", "rollout.eval_max_new_tokens", "reward.remote_batch_size",
            "rm.num_examples", "rm.train_epochs", "rm.batch_size", "rm.max_length",
            "rm.replay_capacity")

# Numbers with a floor, checked before any model loads: key -> (least value, whether it is allowed).
AT_LEAST = {
    **{key: (0, False) for key in POSITIVE},
    "optim.lr": (0.0, False), "optim.critic_lr": (0.0, False), "rm.learning_rate": (0.0, False),
    "optim.weight_decay": (0.0, True), "optim.max_grad_norm": (0.0, True), "optim.warmup_steps": (0, True),
    "optim.max_skipped_steps": (1, True), "algo.beta": (0.0, True), "algo.adaptive_kl.target": (0.0, True),
    "algo.sapo.temperature_pos": (0.0, False), "algo.sapo.temperature_neg": (0.0, False),
    "algo.gmpo.log_clip_low": (0.0, True), "algo.gmpo.log_clip_high": (0.0, True),
    "algo.vespo.k_pos": (0.0, True), "algo.vespo.k_neg": (0.0, True),
    "algo.vespo.lambda_pos": (0.0, False), "algo.vespo.lambda_neg": (0.0, False),
    "algo.adaptive_kl.horizon": (1, True), "algo.entropy_coef": (0.0, True), "algo.gae.value_clip": (0.0, True),
    "algo.gae.value_coef": (0.0, True), "algo.adv_eps": (0.0, True), "algo.ddof": (0, True),
    "algo.dynamic_sampling.max_rounds": (0, True), "algo.ref_refresh_every": (0, True), "rollout.top_k": (0, True),
    "rollout.slots": (0, True), "rollout.speculate": (0, True),
    "reward.timeout_s": (0.0, True), "rollout.max_turns": (1, True), "rollout.max_turn_tokens": (0, True),
    "rollout.max_episode_tokens": (0, True), "rollout.tool_timeout_s": (0.0, False),
    "reward.overlong_buffer": (0, True), "model.threads": (0, True),
    "train.eval_every": (0, True), "train.save_every": (0, True), "train.keep_checkpoints": (1, True),
    "train.samples_every": (0, True), "train.eval_pass_k": (0, True), "task.train_size": (1, True),
    "task.eval_size": (0, True),  # 0: every row trains, no held-out evaluation
    "sft.num_steps": (0, True), "sft.batch_size": (0, False), "algo.distill.top_k": (0, True),
}

CLIP_HIGH_MAX = 10.0
"""Largest algo.clip_eps_high accepted: the ratio's upper bound 1 + eps (0.2 is PPO's, 0.28 DAPO's)."""


def parse_corruptions(spec: str) -> tuple[str, ...]:
    """'result, carry' -> ('result', 'carry'); ValueError for an empty list or an unknown kind."""
    kinds = tuple(k.strip() for k in spec.split(",") if k.strip())
    if not kinds or set(kinds) - set(CORRUPTION_KINDS):
        raise ValueError(f"{spec!r}: choose from {', '.join(CORRUPTION_KINDS)}")
    return kinds


def value_of(cfg: Config, key: str):
    """The value of a dotted key, e.g. value_of(cfg, 'algo.beta')."""
    value = cfg
    for part in key.split("."):
        value = getattr(value, part)
    return value


def validate(cfg: Config) -> None:
    """Every check of a loaded config (load_config runs it)."""
    validate_choices(cfg)
    validate_algo(cfg)
    validate_task(cfg)
    validate_rewards(cfg)
    validate_dpo_and_budget(cfg)
    validate_scale(cfg)


VALUE_HINTS = {
    ("algo.estimator", "ppo"): "PPO's advantages are algo.estimator=gae (with a critic); the preset: covey train ppo",
    ("algo.estimator", "dapo"): "DAPO uses GRPO's advantages (algo.estimator=grpo); the preset: covey train dapo",
    ("algo.estimator", "dr_grpo"): "Dr. GRPO is a preset: covey train dr_grpo",
}
"""Values users reach for that name something else here: what to set instead."""


def check_choices(cfg: Config, choices: dict) -> None:
    """Each key's value is one of its options ({dotted key: options}); else one line naming the key."""
    for key, options in choices.items():
        value = value_of(cfg, key)
        if value not in options:
            hint = VALUE_HINTS.get((key, str(value).lower()))
            raise ConfigError(f"{key}={value!r} is not one of: {', '.join(options)}" + (f" ({hint})" if hint else ""))


def validate_choices(cfg: Config) -> None:
    """Closed option sets and sizes that must be positive."""
    check_choices(cfg, {k: v for k, v in CHOICES.items()  # reasoning_gym:<dataset>: the dataset is checked as it loads
                        if k != "task.name" or not cfg.task.name.startswith(REASONING_GYM)})
    try:
        parse_loggers(cfg.train.logger)
    except ValueError as err:
        raise ConfigError(f"train.logger={cfg.train.logger!r}: {err}") from None
    for key, (least, allowed) in AT_LEAST.items():
        value = value_of(cfg, key)
        if value < least or (value == least and not allowed):
            raise ConfigError(f"{key} must be {'>=' if allowed else '>'} {least}, got {value}")
    if not 0.0 < cfg.rollout.top_p <= 1.0:
        raise ConfigError(f"rollout.top_p must lie in (0, 1], got {cfg.rollout.top_p}")
    betas = cfg.optim.betas.split(",")
    try:
        ok = len(betas) == 2 and all(0.0 <= float(b) < 1.0 for b in betas)
    except ValueError:
        ok = False
    if not ok:
        raise ConfigError(f"optim.betas must be two numbers in [0, 1) such as '0.9,0.99', got {cfg.optim.betas!r}")


def validate_algo(cfg: Config) -> None:
    """Ranges of the algorithm's numbers, and what the estimator needs from the rollout."""
    a, r = cfg.algo, cfg.rollout
    if not 0.0 <= a.gamma <= 1.0 or not 0.0 <= a.gae.lam <= 1.0:
        raise ConfigError("algo.gamma and algo.gae.lam must lie in [0, 1]")
    if a.dual_clip and a.dual_clip <= 1.0:
        raise ConfigError(f"algo.dual_clip must be > 1 (or 0 = off), got {a.dual_clip}")
    if not 0.0 <= a.clip_eps_low <= 1.0:
        raise ConfigError(f"algo.clip_eps_low must lie in [0, 1] (the ratio's lower bound is 1 - eps, PPO's 0.2; "
                          f"1 = no lower bound, as CISPO's paper has it), got {a.clip_eps_low}")
    if not 0.0 <= a.clip_eps_high <= CLIP_HIGH_MAX:
        raise ConfigError(f"algo.clip_eps_high must lie in [0, {CLIP_HIGH_MAX:g}] (the ratio's upper bound is "
                          f"1 + eps; PPO's is 0.2, DAPO's 0.28), got {a.clip_eps_high}")
    if r.temperature <= 0:
        raise ConfigError("rollout.temperature must be > 0 (log-probs divide by it)")
    if a.ref_ema and not 0.0 < a.ref_ema <= 1.0:
        raise ConfigError("algo.ref_ema must lie in (0, 1]")
    n_seq = r.prompts_per_step * r.group_size
    if n_seq % a.minibatches:
        raise ConfigError(f"algo.minibatches={a.minibatches} must divide prompts_per_step*group_size={n_seq}")


def validate_task(cfg: Config) -> None:
    """Question templates, the multistep and word-problem generators' settings and data files."""
    validate_template(cfg.task.template)
    validate_template(cfg.task.multistep_template, "task.multistep_template", start="12", steps="Add 7")
    validate_multistep(cfg.task)
    if not 1 <= cfg.task.word_steps <= WORD_MAX_STEPS:
        raise ConfigError(f"task.word_steps={cfg.task.word_steps}: word problems take 1 to "
                          f"{WORD_MAX_STEPS} operations")
    if cfg.task.name in FILE_TASKS and not cfg.task.path:
        raise ConfigError(f"task.name={cfg.task.name} needs task.path")
    try:
        parse_source(cfg.task.source)
    except ValueError as err:
        raise ConfigError(f"task.source={cfg.task.source!r}: {err}") from None


def validate_template(template: str, key: str = "task.template", **example: str) -> None:
    """A question template must show every placeholder's value and name nothing else.

    Defaults to the arithmetic question: both operands and the operation.
    """
    example = example or {"a": "12", "op": "*", "b": "3"}
    names = ", ".join(f"{{{name}}}" for name in example)
    try:
        text = template.format(**example)
    except (KeyError, IndexError, ValueError) as err:
        raise ConfigError(f"{key}={template!r} is not a valid template ({err!r}); "
                          f"use the placeholders {names}") from None
    if not all(value in text for value in example.values()):
        raise ConfigError(f"{key}={template!r} must contain {names}")


def validate_multistep(t: TaskConfig) -> None:
    if not 1 <= t.min_ops <= t.max_ops:
        raise ConfigError(f"task.min_ops={t.min_ops}, task.max_ops={t.max_ops}: need 1 <= min_ops <= max_ops")
    if not t.ops or set(t.ops) - set(MULTISTEP_OPS):
        raise ConfigError(f"task.ops={t.ops!r}: choose one or more of + - * (for example '+-')")
    if t.operand_max < 2:
        raise ConfigError(f"task.operand_max={t.operand_max}: operands are drawn from 2..operand_max, "
                          "so it must be >= 2")
    if t.start_digits < 1:
        raise ConfigError(f"task.start_digits={t.start_digits}: must be >= 1")
    if t.max_value < 10 ** t.start_digits - 1:
        raise ConfigError(f"task.max_value={t.max_value}: must be >= the largest start value "
                          f"({10 ** t.start_digits - 1} for task.start_digits={t.start_digits})")


def validate_rm_data(cfg: Config) -> None:
    """How `covey train-rm` generates its data."""
    rm = cfg.rm
    if not 0.0 < rm.eval_fraction < 1.0:
        raise ConfigError(f"rm.eval_fraction must lie in (0, 1), got {rm.eval_fraction}")
    if rm.samples_per_prompt < (1 if rm.objective == "bt" else 0):
        raise ConfigError(f"rm.samples_per_prompt must be >= 1 for bt pairs and >= 0 for prm data, "
                          f"got {rm.samples_per_prompt}")
    if rm.counterfactuals < 0:
        raise ConfigError(f"rm.counterfactuals must be >= 0, got {rm.counterfactuals}")
    if rm.counterfactuals and rm.objective == "prm" and cfg.task.name != "multistep":
        raise ConfigError("rm.counterfactuals for a PRM needs exact step labels: use task.name=multistep")
    if rm.corruptions_per_prompt < 0:
        raise ConfigError(f"rm.corruptions_per_prompt must be >= 0, got {rm.corruptions_per_prompt}")
    try:
        parse_corruptions(rm.corruption_kinds)
    except ValueError as err:
        raise ConfigError(f"rm.corruption_kinds={err}") from None
    if rm.objective == "prm" and rm.samples_per_prompt == 0 and rm.corruptions_per_prompt == 0 and not rm.data:
        raise ConfigError("rm.samples_per_prompt=0 with rm.corruptions_per_prompt=0 leaves only correct "
                          "solutions: a PRM needs wrong steps too")


def validate_rewards(cfg: Config) -> None:
    """Learned / remote reward sources, iterative GRPO and the step rewards of process supervision."""
    r = cfg.reward
    if not 0.0 <= r.replay_fraction < 1.0:
        raise ConfigError(f"reward.replay_fraction must lie in [0, 1), got {r.replay_fraction}")
    validate_rm_data(cfg)
    if r.iterative_every < 0 or r.remote_retries < 0 or r.remote_timeout_s <= 0:
        raise ConfigError("reward.iterative_every and reward.remote_retries must be >= 0, remote_timeout_s > 0")
    if r.iterative_every and not (r.model_path or r.prm_path):
        raise ConfigError("reward.iterative_every needs a learned reward model (reward.model_path or reward.prm_path)")
    if r.iterative_every and r.prm_path and cfg.task.name != "multistep":
        raise ConfigError("refreshing a PRM needs exact step labels: use task.name=multistep")


def validate_dpo_and_budget(cfg: Config) -> None:
    """Iterative DPO, the wall-clock budget and the gradient-variance measurement."""
    a, t = cfg.algo, cfg.train
    if a.learner == "dpo":
        if cfg.rollout.group_size < 2:
            raise ConfigError("algo.learner=dpo pairs the best and worst sample of a prompt: "
                              "rollout.group_size must be >= 2")
        if a.dpo.beta <= 0:
            raise ConfigError(f"algo.dpo.beta must be > 0, got {a.dpo.beta}")
        if t.grad_var_every:
            raise ConfigError("train.grad_var_every measures advantage-weighted policy gradients; "
                              "it is not defined for algo.learner=dpo")
    if t.max_minutes < 0:
        raise ConfigError(f"train.max_minutes must be >= 0 (0 = no limit), got {t.max_minutes}")
    if t.gpu_memory_gib < 0:
        raise ConfigError(f"train.gpu_memory_gib must be >= 0 (0 = the card's memory less 10%), got {t.gpu_memory_gib}")
    if t.grad_var_every < 0:
        raise ConfigError(f"train.grad_var_every must be >= 0 (0 = off), got {t.grad_var_every}")
    n_seq = cfg.rollout.prompts_per_step * cfg.rollout.group_size
    if t.grad_var_every and not 2 <= t.grad_var_batches <= n_seq:
        raise ConfigError(f"train.grad_var_batches must lie in [2, prompts_per_step*group_size={n_seq}], "
                          f"got {t.grad_var_batches}")


def validate_scale(cfg: Config) -> None:
    """LoRA, vLLM, truncated importance sampling and the fast engine's static decoding."""
    m, r, a = cfg.model, cfg.rollout, cfg.algo
    if m.lora_rank < 0 or m.lora_alpha <= 0:
        raise ConfigError(f"model.lora_rank must be >= 0 and model.lora_alpha > 0, "
                          f"got {m.lora_rank} and {m.lora_alpha}")
    if m.load_in_4bit and m.lora_rank <= 0:
        raise ConfigError("model.load_in_4bit=true freezes the base weights in 4-bit: it trains adapters only, "
                          "set model.lora_rank > 0 (e.g. 16)")
    if m.load_in_4bit and (r.precision == "bfloat16" or r.engine == "vllm"):
        raise ConfigError(f"model.load_in_4bit=true samples through the 4-bit policy itself: rollout.precision="
                          f"{r.precision} / rollout.engine={r.engine} is not supported with it (use auto / fast or hf)")
    if m.lora_rank and (a.ref_refresh_every or a.ref_ema):
        raise ConfigError("with model.lora_rank > 0 the reference is the base model (adapters off): "
                          "algo.ref_refresh_every / algo.ref_ema cannot move it")
    validate_router_aux(cfg)
    validate_optimizer(cfg)
    tis = a.tis
    if tis.cap and tis.cap < 1:
        raise ConfigError(f"algo.tis.cap must be 0 (off) or >= 1, got {tis.cap}")
    if tis.min < 0 or (tis.cap and tis.min >= tis.cap):
        raise ConfigError(f"algo.tis.min must lie in [0, algo.tis.cap={tis.cap:g}), got {tis.min}")
    if tis.min and not tis.cap:
        raise ConfigError(f"algo.tis.min={tis.min:g} is a lower bound of importance sampling: set algo.tis.cap > 0")
    if tis.cap and a.dynamic_sampling.enabled:
        raise ConfigError("algo.tis.cap with algo.dynamic_sampling is not supported yet (refilled groups "
                          "lose their sampling log-probs)")
    validate_token_selection(cfg)
    if r.engine != "fast" and r.decode not in ("auto", "plain"):
        raise ConfigError(f"rollout.decode={r.decode} sets the fast engine's decoding: "
                          f"rollout.engine={r.engine} does not use it")
    if r.slots and r.engine != "fast":
        raise ConfigError(f"rollout.slots={r.slots} sets the fast engine's slots: rollout.engine={r.engine} does not "
                          "use them")
    if r.speculate and (r.engine != "fast" or r.decode in ("static", "graphs", "compile") or r.speculate > 16):
        raise ConfigError(f"rollout.speculate={r.speculate}: at most 16 draft tokens, verified in the fast engine's "
                          f"plain steps (rollout.engine={r.engine}, rollout.decode={r.decode})")
    if r.slots and r.decode in ("static", "graphs", "compile"):
        raise ConfigError(f"rollout.slots={r.slots}: the slots decode with plain steps, not rollout.decode={r.decode}")
    if not 0 < r.vllm_gpu_memory_utilization < 1:
        raise ConfigError(f"rollout.vllm_gpu_memory_utilization must lie in (0, 1), "
                          f"got {r.vllm_gpu_memory_utilization}")
    if r.vllm_sync_bucket_mb <= 0 or r.vllm_sync_timeout_s <= 0 or cfg.train.dist_timeout_s <= 0:
        raise ConfigError("rollout.vllm_sync_bucket_mb, rollout.vllm_sync_timeout_s and "
                          "train.dist_timeout_s must be > 0")


def validate_router_aux(cfg: Config) -> None:
    """model.router_aux_coef: not negative, and only where the update adds it (whether the model has
    experts is checked from its config before it loads: covey/models/routers.py)."""
    coef = cfg.model.router_aux_coef
    if coef is not None and coef < 0:
        raise ConfigError(f"model.router_aux_coef must be >= 0 (0 = off; unset = the model's own), got {coef}")
    if coef and cfg.algo.learner != "advantage":
        raise ConfigError(f"model.router_aux_coef={coef:g} joins the policy loss of algo.learner=advantage; "
                          f"algo.learner={cfg.algo.learner} does not add it")


def validate_optimizer(cfg: Config) -> None:
    """optim.name against the weights' dtype and optim.offload (the device and the packages are checked when
    the run opens: covey/training/optim.py)."""
    o = cfg.optim
    if o.name == "adamw_bf16" and cfg.model.dtype != "bfloat16":
        raise ConfigError(f"optim.name=adamw_bf16 updates bf16 weights with stochastic rounding: set "
                          f"model.dtype=bfloat16 (got {cfg.model.dtype}), or use optim.name=adamw for fp32 weights")
    if o.offload and o.name == "paged_adamw_8bit":
        raise ConfigError("optim.offload=true with optim.name=paged_adamw_8bit: the paged optimizer already moves "
                          "its state to CPU memory; choose one")


def validate_token_selection(cfg: Config) -> None:
    """High-entropy tokens, adaptive entropy and the covariance controls (their names: the plan's registries)."""
    a = cfg.algo
    if not 0.0 <= a.top_entropy_quantile <= 1.0:
        raise ConfigError(f"algo.top_entropy_quantile must lie in [0, 1] (1 = every token), "
                          f"got {a.top_entropy_quantile}")
    ent, clip, kl = a.adaptive_entropy, a.clip_cov, a.kl_cov
    if ent.enabled and not (ent.target > 0 and ent.coef_delta > 0):
        raise ConfigError(f"algo.adaptive_entropy needs algo.adaptive_entropy.target > 0 and "
                          f"algo.adaptive_entropy.coef_delta > 0, got {ent.target} and {ent.coef_delta}")
    if ent.enabled and not 0.0 <= a.entropy_coef <= ent.coef_max:
        raise ConfigError(f"algo.adaptive_entropy starts from algo.entropy_coef, which must lie in [0, "
                          f"algo.adaptive_entropy.coef_max={ent.coef_max}], got {a.entropy_coef}")
    for key, value in (("clip_cov.ratio", clip.ratio), ("kl_cov.ratio", kl.ratio)):
        if not 0.0 <= value <= 1.0:
            raise ConfigError(f"algo.{key} must lie in [0, 1], got {value}")
    if not clip.lb < clip.ub:
        raise ConfigError(f"algo.clip_cov.lb must be below algo.clip_cov.ub, got {clip.lb} and {clip.ub}")
    if kl.coef < 0:
        raise ConfigError(f"algo.kl_cov.coef must be >= 0, got {kl.coef}")
    selects = a.top_entropy_quantile < 1 or ent.enabled or a.cov_control != "none"
    if selects and a.learner == "dpo":
        raise ConfigError("algo.top_entropy_quantile, algo.adaptive_entropy and algo.cov_control act on the "
                          "policy loss; algo.learner=dpo has none")


def validate_world(cfg: Config, world_size: int) -> None:
    """What must hold to run on `world_size` processes (torchrun); nothing to check for one."""
    if world_size == 1:
        return
    if cfg.rollout.prompts_per_step % world_size:
        raise ConfigError(f"rollout.prompts_per_step={cfg.rollout.prompts_per_step} must be a multiple of the "
                          f"{world_size} processes (each takes whole groups)")
    # These change the number of sequences per rank, hence the number of FSDP collectives: ranks would deadlock.
    if cfg.algo.dynamic_sampling.enabled or cfg.reward.on_error == "drop":
        raise ConfigError("under torchrun, algo.dynamic_sampling and reward.on_error=drop are not supported yet "
                          "(ranks would hold different numbers of sequences)")
    if cfg.optim.name != "adamw" or cfg.optim.offload:  # single-process optimizers, untested on FSDP2's shards
        raise ConfigError(f"under torchrun, optim.name={cfg.optim.name}"
                          + (" with optim.offload=true" if cfg.optim.offload else "") + " is not supported yet: "
                          "use optim.name=adamw, optim.offload=false")
    # Each of these runs per-rank work that the other ranks would not mirror (deadlock or diverging models).
    unsupported = [key for key, on in (("algo.learner=dpo", cfg.algo.learner == "dpo"),
                                       ("train.grad_var_every", cfg.train.grad_var_every),
                                       ("reward.iterative_every", cfg.reward.iterative_every),
                                       ("task.source=" + cfg.task.source.split(":")[0] + ":...",  # a server each
                                        parse_source(cfg.task.source)[0] in ("harness", "verifiers")),
                                       ("rollout.precision=bfloat16 (a copy of a sharded policy)",
                                        cfg.rollout.precision == "bfloat16" and cfg.rollout.engine != "vllm"))
                  if on]
    if unsupported:
        raise ConfigError(f"under torchrun, {', '.join(unsupported)} is not supported yet")
