"""The TRL side of every benchmark: TRL's GRPOTrainer on the settings of covey's workload config, one role
per child process (TRL comes from the `bench` extra):

    python -m bench.trl_side speed|gpu|learn --result FILE [options] [key=value ...]

`trl_grpo_kwargs(cfg)` reads a covey `Config` (the `grpo` preset plus overrides) and returns the
`trl.GRPOConfig` keyword arguments that train with the same update: every covey setting that changes
the update is either mapped or refused with a one-line error naming its key; nothing is silently dropped.
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
  generation budget). `seq_mean_token_sum` has no TRL counterpart and is refused.
- KL: covey's k3 in the loss with r = pi_ref / pi_theta is TRL's only in-loss KL; TRL's
  default `use_bias_correction_kl=True` multiplies it by the (differentiable) importance ratio,
  which changes the gradient even on-policy, so it is switched off to match covey.
- `algo.std_normalize` -> `scale_rewards` group / none; clip eps low/high -> `epsilon` /
  `epsilon_high`; lr, warm-up (linear, then constant), AdamW betas and weight decay,
  `max_grad_norm`, temperature / top-p / top-k, `max_new_tokens` -> `max_completion_length`,
  `train.seed`, gradient checkpointing (TRL's default is on: set from covey's), and the training
  precision: TRL's `bf16` autocast exactly where covey's `model.autocast` resolves to bfloat16.

What does not map (stated, not patched): TRL divides by the group std with Bessel's correction
(n - 1) and adds 1e-4; covey by the population std (`algo.ddof=0`) plus `algo.adv_eps` (1e-6):
`algo.ddof=1 algo.adv_eps=1e-4` makes the advantages identical. covey samples with a bf16 copy of
the policy where bf16 is native (`rollout.precision=auto`); TRL with the training weights. The prompt
order differs (each library shuffles with its own generator from the same seed).

Timing: generation, scoring and the no-grad log-prob passes wrap TRL's own methods; `update` is the
rest of the step. Models load TRL's way (fp32 weights, `model_init_kwargs`).
"""

from __future__ import annotations

import argparse
import tempfile
import time
from collections import defaultdict
from contextlib import contextmanager
from pathlib import Path

import torch

from bench.harness import LinearFlops, StepRecord, peak_gpu_bytes, say, step_result, write_json
from bench.workloads import STEP_CAP, WORKLOADS, Schedule, Tracker, cpu_keys, gpu_keys, varied_reward
from covey.config import load_config
from covey.runtime.precision import resolve_autocast

LOSS_TYPES = {"seq_mean_token_mean": "grpo", "token_mean": "dapo", "constant": "dr_grpo"}
# covey settings that change the update and that TRL's GRPOTrainer has no switch for: (key, value it must have)
REQUIRED = (
    ("algo.learner", "advantage"), ("algo.estimator", "grpo"), ("algo.policy_loss", "ppo_clip"),
    ("algo.ratio_level", "token"), ("algo.ratio_against", "old"), ("algo.dual_clip", 0.0),
    ("algo.adaptive_kl.target", 0.0), ("algo.entropy_coef", 0.0), ("algo.token_credit", "shared"),
    ("algo.epochs", 1), ("algo.minibatches", 1), ("algo.dynamic_sampling", False),
    ("algo.ref_refresh_every", 0), ("algo.ref_ema", 0.0), ("algo.tis.cap", 0.0),
    ("reward.format", 0.0), ("reward.overlong_buffer", 0), ("reward.functions", ""),
    ("reward.model_path", ""), ("reward.prm_path", ""), ("reward.remote_url", ""), ("reward.language", 0.0),
    ("model.lora_rank", 0),
)
QUIET = dict(logging_steps=1, report_to="none", save_strategy="no", disable_tqdm=True, dataloader_num_workers=0)


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


# --------------------------------------------------------------------------- the timed trainer


def make_trainer_class():
    from trl import GRPOTrainer

    class TimedGRPOTrainer(GRPOTrainer):
        """GRPOTrainer whose generation, scoring and no-grad log-prob passes add to `self.phase_times`."""

        phase_times: dict = defaultdict(float)
        completion_tokens: int = 0
        flop_counter: LinearFlops | None = None

        @contextmanager
        def _timed(self, phase: str):
            t0 = time.perf_counter()
            yield
            self.phase_times[phase] += time.perf_counter() - t0

        def _generate(self, prompts):
            with self._timed("generate"):
                out = super()._generate(prompts)
            self.completion_tokens += sum(len(ids) for ids in out[1])
            return out

        def _calculate_rewards(self, *args, **kwargs):
            with self._timed("score"):
                return super()._calculate_rewards(*args, **kwargs)

        def _get_per_token_logps_and_entropies(self, *args, **kwargs):
            if torch.is_grad_enabled():  # the training forward: part of `update`
                return super()._get_per_token_logps_and_entropies(*args, **kwargs)
            with self._timed("logprobs"):
                return super()._get_per_token_logps_and_entropies(*args, **kwargs)

    return TimedGRPOTrainer


def step_recorder(box: dict, records: list):
    from transformers import TrainerCallback

    class StepTimer(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            trainer = box["trainer"]
            trainer.phase_times.clear()
            trainer.completion_tokens = 0
            if trainer.flop_counter is not None:
                trainer.flop_counter.take()
            self.t0 = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            seconds, trainer = time.perf_counter() - self.t0, box["trainer"]
            phases = dict(trainer.phase_times)
            phases["update"] = seconds - sum(phases.values())
            flops = trainer.flop_counter.take() if trainer.flop_counter is not None else 0.0
            records.append(StepRecord(step=state.global_step, seconds=seconds, phases=phases,
                                      completion_tokens=trainer.completion_tokens, train_flops=flops))
            say(f"trl step {state.global_step}: {seconds:.2f} s {phases}")

    return StepTimer()


def timed_trainer(cfg, model: str, reward, config, records: list, **trainer_kwargs):
    """A TimedGRPOTrainer on the config's train problems, each step recorded in `records` (`trainer_kwargs`:
    GRPOTrainer's peft_config, quantization_config)."""
    from covey.tasks.data import load_task_data
    box = {}
    train = load_task_data(cfg.task, cfg.train.seed).train
    box["trainer"] = make_trainer_class()(model=model, reward_funcs=reward, args=config,
                                          train_dataset=trl_dataset(train, cfg.task.system_prompt),
                                          callbacks=[step_recorder(box, records)], **trainer_kwargs)
    return box["trainer"]


# --------------------------------------------------------------------------- the roles


def role_speed(args) -> dict:
    """The CPU workload: `--micro-batch 0` is TRL as it ships (the step's samples in one forward and
    backward); 8 is covey's micro-batch (gradient accumulation). One optimizer step per rollout either way."""
    from trl import GRPOConfig

    from covey.models.load import resolve_model_path
    from covey.rewards.rules import correctness_reward
    if args.threads:
        torch.set_num_threads(args.threads)
    records = []
    with tempfile.TemporaryDirectory(prefix="bench-trl-") as out_dir:
        cfg = load_config("grpo", cpu_keys(args.workload, args.steps, args.threads, out_dir, args.model))
        micro = args.micro_batch or cfg.rollout.prompts_per_step * cfg.rollout.group_size
        settings = {**trl_grpo_kwargs(cfg, micro_batch=micro, autocast_bf16=args.bf16),
                    "gradient_checkpointing": args.gradient_checkpointing}
        config = GRPOConfig(output_dir=out_dir, max_steps=args.steps, use_cpu=True, **settings, **QUIET)
        trainer = timed_trainer(cfg, resolve_model_path(cfg.model.path), correctness_reward, config, records)
        trainer.flop_counter = LinearFlops(trainer.model)
        trainer.train()
    return step_result("trl", records, precision="bfloat16 (autocast)" if args.bf16 else "float32", micro_batch=micro,
                       gradient_checkpointing=args.gradient_checkpointing)


def role_gpu(args, settings: dict | None = None, trainer_kwargs: dict | None = None) -> dict:
    """The GPU workload: TRL's default model load (fp32 weights), HF `generate` (no vLLM), bf16 autocast where
    covey's resolves to bf16; fixed-length responses (min_new_tokens); --trl-gc: gradient checkpointing on.
    `settings` replace GRPOConfig's, `trainer_kwargs` go to the trainer (bench/gpu_capacity.py)."""
    from trl import GRPOConfig, __version__
    w, gpu, records = WORKLOADS[args.workload], torch.cuda.is_available(), []
    with tempfile.TemporaryDirectory(prefix="bench-trl-") as out_dir:
        # covey's config without its reward keys: the benchmark's reward function is handed to both trainers
        cfg = load_config("grpo", [k for k in gpu_keys(args.workload, args.model, args.steps, out_dir)
                                   if not k.startswith("reward.")])
        bf16 = resolve_autocast(cfg.model.autocast, "cuda" if gpu else "cpu") == "bfloat16"
        settings = {**trl_grpo_kwargs(cfg, autocast_bf16=bf16), **({"gradient_checkpointing": True} if args.trl_gc
                                                                    else {}), **(settings or {})}
        config = GRPOConfig(output_dir=out_dir, max_steps=args.steps, use_cpu=not gpu, use_vllm=False, **settings,
                            generation_kwargs={"min_new_tokens": w["new_tokens"]}, **QUIET)
        trainer = timed_trainer(cfg, args.model, varied_reward, config, records, **(trainer_kwargs or {}))
        setup = {"trl": __version__, "model_dtype": str(next(trainer.model.parameters()).dtype), "bf16": config.bf16,
                 "gradient_checkpointing": config.gradient_checkpointing, "loss_type": config.loss_type,
                 "per_device_train_batch_size": config.per_device_train_batch_size,
                 "gradient_accumulation_steps": config.gradient_accumulation_steps,
                 "steps_per_generation": config.steps_per_generation, "optim": str(config.optim),
                 "use_liger_kernel": config.use_liger_kernel, "trainer_kwargs": sorted(trainer_kwargs or {}),
                 "reference_dtype": str(next(trainer.ref_model.parameters()).dtype) if trainer.ref_model else None}
        say(f"TRL setup: {setup}")
        if gpu:  # the peak of the steps, as covey's phase peaks (its models loaded, its optimizer state from step 1)
            torch.cuda.reset_peak_memory_stats()
        trainer.train()
    steps = [{"step_s": r.seconds, "generate_s": r.phases.get("generate", 0.0), "score_s": r.phases.get("score", 0.0),
              "reference_s": r.phases.get("logprobs", 0.0), "update_s": r.phases["update"],
              "response_tokens": r.completion_tokens} for r in records]
    return {"steps": steps, "peak_gpu_bytes": peak_gpu_bytes(), "setup": setup}


def learn_callback(tracker: Tracker, box: dict):
    from transformers import TrainerCallback

    class Track(TrainerCallback):
        """Times each optimizer step (generation included), saves at evaluation points, stops by the Schedule."""

        def on_step_begin(self, args, state, control, **kwargs):
            tracker.begin()
            self.t0 = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            trainer = box["trainer"]

            def save(folder):
                trainer.accelerator.unwrap_model(trainer.model).save_pretrained(folder, safe_serialization=True)
                trainer.processing_class.save_pretrained(folder)

            tracker.end(state.global_step, time.perf_counter() - self.t0, save)
            control.should_training_stop = tracker.done

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "reward" in logs and tracker.steps:
                tracker.steps[-1]["reward"] = logs["reward"]

    return Track()


def role_learn(args) -> dict:
    """A learning run on covey's config until the Schedule stops it, scored by covey's correctness reward."""
    from trl import GRPOConfig, GRPOTrainer

    from covey.models.load import resolve_model_path
    from covey.rewards.rules import correctness_reward
    from covey.tasks.data import load_task_data
    from covey.tasks.verifiers import resolve_verifier
    from covey.runtime.dist import resolve_device
    cfg = load_config("grpo", args.overrides)
    if cfg.model.threads:
        torch.set_num_threads(cfg.model.threads)
    device = resolve_device(cfg.train.device)  # TRL on the GPU where covey's train.device puts covey
    data = load_task_data(cfg.task, cfg.train.seed)
    if resolve_verifier(cfg.eval.metric, [ex.answer for ex in data.eval]) != "math":
        raise SystemExit("bench: eval.metric does not resolve to 'math', the verifier of TRL's correctness reward")
    bf16 = resolve_autocast(cfg.model.autocast, device) == "bfloat16"
    settings = trl_grpo_kwargs(cfg, micro_batch=args.micro_batch, autocast_bf16=bf16)
    tracker = Tracker(Schedule(args.steps, args.minutes, args.eval_every, args.max_minutes),
                      cfg.rollout.prompts_per_step * cfg.rollout.group_size, args.save_dir)
    box = {}
    with tempfile.TemporaryDirectory(prefix="learn-trl-") as tmp:
        config = GRPOConfig(output_dir=tmp, max_steps=STEP_CAP, use_cpu=device == "cpu", use_vllm=False, **settings,
                            **QUIET)
        box["trainer"] = GRPOTrainer(model=resolve_model_path(cfg.model.path), reward_funcs=correctness_reward,
                                     args=config, train_dataset=trl_dataset(data.train, cfg.task.system_prompt),
                                     callbacks=[learn_callback(tracker, box)])
        if device != "cpu":  # the peak of the run, its model and reference loaded
            torch.cuda.reset_peak_memory_stats()
        box["trainer"].train()
    return tracker.result(precision="bfloat16" if bf16 else "none", trl_settings=settings, device=device)


ROLES = {"speed": role_speed, "gpu": role_gpu, "learn": role_learn}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description="the TRL side of bench/'s drivers")
    p.add_argument("role", choices=tuple(ROLES))
    p.add_argument("--result", required=True)
    p.add_argument("--workload", default="cpu", choices=tuple(WORKLOADS))
    p.add_argument("--steps", type=int, default=0)
    p.add_argument("--threads", type=int, default=0, help="speed: torch threads")
    p.add_argument("--model", default="", help="model folder (speed: the default model if not given)")
    p.add_argument("--micro-batch", type=int, default=0, help="per_device_train_batch_size (speed: 0 is all the "
                   "step's samples, TRL as it ships; learn: 0 is covey's algo.micro_batch_size)")
    p.add_argument("--gradient-checkpointing", action="store_true", help="speed: TRL's gradient checkpointing")
    p.add_argument("--bf16", action="store_true", help="speed: TRL's bf16 autocast")
    p.add_argument("--trl-gc", action="store_true", help="gpu: gradient checkpointing on (TRL's own default)")
    p.add_argument("--minutes", type=float, default=12.0, help="learn: training minutes of the Schedule")
    p.add_argument("--eval-every", type=int, default=10, help="learn: evaluation points every K steps")
    p.add_argument("--max-minutes", type=float, default=0.0, help="learn: stop past this training time (0: no cap)")
    p.add_argument("--save-dir", type=Path, help="learn: where the evaluation points are saved")
    p.add_argument("overrides", nargs="*", help="learn: covey key=value settings")
    args = p.parse_intermixed_args(argv)
    if args.save_dir is not None:
        args.save_dir.mkdir(parents=True, exist_ok=True)
    write_json(args.result, ROLES[args.role](args))


if __name__ == "__main__":
    main()
