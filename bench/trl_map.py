"""A covey GRPO config as TRL GRPOTrainer settings: the one mapping the benchmarks share.

`trl_grpo_kwargs(cfg)` reads a covey `Config` (the `grpo` preset plus overrides) and returns the
`trl.GRPOConfig` keyword arguments that train with the same update, so that both libraries run
from one source of truth. Every covey setting that changes the update is either mapped or
refused with a one-line error naming its key; nothing is silently dropped.

What maps, and why it is the same computation (TRL 1.16, trl/trainer/grpo_trainer.py):

- B prompts x G samples per step: `num_generations=G`; the generation batch B*G is split into
  micro-batches of `per_device_train_batch_size` whose gradients accumulate
  (`gradient_accumulation_steps = B*G / micro`), and `steps_per_generation` defaults to the
  accumulation steps, so one generation batch makes exactly one optimizer step
  (`num_iterations=1`); TRL then skips its old-log-prob pass, as covey does (the ratio is
  exp(logp - logp.detach()) on both sides).
- `algo.loss_agg` -> `loss_type` (LOSS_TYPES): covey's default `seq_mean_token_mean`
  (1/N sum_i 1/|o_i| sum_t over the step's N sequences) is TRL's `grpo`: each micro-batch
  takes the mean over its sequences of their token means and is divided by the accumulation
  steps; micro-batches all hold the same number of sequences, so the accumulated gradient is
  the mean over all N sequences, covey's global estimator. `token_mean` is `dapo` (divided by
  the active tokens of the whole generation batch), `constant` is `dr_grpo` (N x the
  generation budget). `seq_mean_token_sum` has no TRL counterpart (`luspo` needs
  sequence-level ratios) and is refused.
- KL: covey's k3 in the loss with r = pi_ref / pi_theta is TRL's only in-loss KL; TRL's
  default `use_bias_correction_kl=True` multiplies it by the (differentiable) importance ratio,
  which changes the gradient even on-policy, so it is switched off to match covey.
- `algo.std_normalize` -> `scale_rewards` group / none; clip eps low/high -> `epsilon` /
  `epsilon_high`; lr, warm-up (linear, then constant), AdamW betas and weight decay,
  `max_grad_norm`, temperature / top-p / top-k, `max_new_tokens` -> `max_completion_length`,
  `train.seed`, gradient checkpointing (TRL's default is on: set from covey's), and the
  training precision: TRL's `bf16` autocast exactly where covey's `model.autocast` resolves to
  bfloat16 (TRL's default is bf16 on: set from covey's).

What does not map (stated, not patched): TRL divides by the group std with Bessel's correction
(n - 1) and adds 1e-4; covey divides by the population std (`algo.ddof=0`) plus `algo.adv_eps`
(1e-6). Overriding covey with `algo.ddof=1 algo.adv_eps=1e-4` makes the advantages identical.
covey samples with a bf16 copy of the policy where bf16 is native (`rollout.precision=auto`);
TRL samples with the training weights. The prompt order differs (each library shuffles with its
own generator from the same seed).
"""

from __future__ import annotations

LOSS_TYPES = {"seq_mean_token_mean": "grpo", "token_mean": "dapo", "constant": "dr_grpo"}

# covey settings that change the update and that TRL's GRPOTrainer has no switch for: (key, value it must have)
REQUIRED = (
    ("algo.learner", "advantage"), ("algo.estimator", "grpo"), ("algo.policy_loss", "ppo_clip"),
    ("algo.ratio_level", "token"), ("algo.ratio_against", "old"), ("algo.dual_clip", 0.0),
    ("algo.kl_target", 0.0), ("algo.entropy_coef", 0.0), ("algo.token_credit", "shared"),
    ("algo.epochs", 1), ("algo.minibatches", 1), ("algo.dynamic_sampling", False),
    ("algo.ref_refresh_every", 0), ("algo.ref_ema", 0.0), ("algo.tis_cap", 0.0),
    ("reward.format", 0.0), ("reward.overlong_buffer", 0), ("reward.functions", ""),
    ("reward.model_path", ""), ("reward.prm_path", ""), ("reward.remote_url", ""), ("reward.language", 0.0),
    ("model.lora_rank", 0),
)


def setting(cfg, key: str):
    section, name = key.split(".")
    return getattr(getattr(cfg, section), name)


def check_mappable(cfg) -> None:
    """Raise ValueError naming the first covey setting TRL's GRPOTrainer cannot reproduce."""
    for key, value in REQUIRED:
        if setting(cfg, key) != value:
            raise ValueError(f"{key}={setting(cfg, key)!r} has no TRL GRPOTrainer counterpart (needs {value!r})")
    a = cfg.algo
    if a.loss_agg not in LOSS_TYPES:
        raise ValueError(f"algo.loss_agg={a.loss_agg!r} has no TRL loss_type (mapped: {', '.join(LOSS_TYPES)})")
    if a.normalize not in ("auto", "group"):
        raise ValueError(f"algo.normalize={a.normalize!r}: TRL normalises rewards per group only")
    if a.beta and a.kl_in != "none" and (a.kl_in != "loss" or a.kl_estimator != "k3"):
        raise ValueError(f"algo.kl_in={a.kl_in} / algo.kl_estimator={a.kl_estimator}: TRL puts k3 in the loss only")
    if cfg.reward.correctness != 1.0:
        raise ValueError(f"reward.correctness={cfg.reward.correctness}: the TRL side scores correctness with weight 1")


def micro_batches(cfg, micro_batch: int = 0) -> tuple[int, int]:
    """(per_device_train_batch_size, gradient_accumulation_steps) whose product is one step's B*G samples;
    micro_batch 0 takes covey's algo.micro_batch_size."""
    n = cfg.rollout.prompts_per_step * cfg.rollout.group_size
    micro = micro_batch or min(cfg.algo.micro_batch_size, n)
    if n % micro:
        raise ValueError(f"TRL micro-batch {micro} does not divide the {n} samples of a step (B*G)")
    return micro, n // micro


def trl_grpo_kwargs(cfg, micro_batch: int = 0, autocast_bf16: bool = False) -> dict:
    """GRPOConfig keyword arguments for covey config `cfg` (run-only settings such as output_dir,
    max_steps and logging are the caller's). `autocast_bf16`: covey's resolved model.autocast."""
    check_mappable(cfg)
    a, r, o = cfg.algo, cfg.rollout, cfg.optim
    micro, accumulation = micro_batches(cfg, micro_batch)
    beta1, beta2 = (float(x) for x in o.betas.split(","))
    return {
        "num_generations": r.group_size, "per_device_train_batch_size": micro,
        "gradient_accumulation_steps": accumulation, "num_iterations": 1,
        "max_completion_length": r.max_new_tokens, "temperature": r.temperature, "top_p": r.top_p, "top_k": r.top_k,
        "loss_type": LOSS_TYPES[a.loss_agg], "beta": a.beta if a.kl_in == "loss" else 0.0,
        "use_bias_correction_kl": False, "epsilon": a.clip_eps_low, "epsilon_high": a.clip_eps_high,
        "scale_rewards": "group" if a.std_normalize else "none", "learning_rate": o.lr,
        "lr_scheduler_type": "constant_with_warmup" if o.warmup_steps else "constant", "warmup_steps": o.warmup_steps,
        "adam_beta1": beta1, "adam_beta2": beta2, "weight_decay": o.weight_decay, "max_grad_norm": o.max_grad_norm,
        "seed": cfg.train.seed, "gradient_checkpointing": cfg.model.gradient_checkpointing, "bf16": autocast_bf16,
        "model_init_kwargs": {"dtype": cfg.model.dtype},
    }


def trl_dataset(examples, system_prompt: str = ""):
    """covey examples as TRL conversational prompts (the messages covey's format_prompts templates)
    with the reference answers in the `answer` column that covey's correctness reward reads."""
    from datasets import Dataset

    from covey.tasks.base import build_messages
    return Dataset.from_list([{"prompt": build_messages(ex, system_prompt or None), "answer": ex.answer}
                              for ex in examples])
