"""The TRL side of every benchmark: TRL's GRPOTrainer on the settings of covey's workload config, one role
per child process (TRL comes from the `bench` extra):

    python -m bench.trl_side steps|learn --result FILE [options] [key=value ...]

`trl_grpo_kwargs(cfg)` reads a covey `Config` (the `grpo` preset plus overrides) and returns the
`trl.GRPOConfig` keyword arguments that train with the same update: every covey setting that changes the
update is either mapped or refused with a one-line error naming its key (REQUIRED). Why the mapped ones
compute the same thing (TRL 1.16, trl/trainer/grpo_trainer.py):

- B prompts x G samples: `num_generations=G`; the B*G samples are split into micro-batches of
  `per_device_train_batch_size` whose gradients accumulate, and `steps_per_generation` defaults to the
  accumulation steps, so one generation batch makes one optimizer step (`num_iterations=1`) and TRL skips
  its old-log-prob pass, as covey does (the ratio is exp(logp - logp.detach()) on both sides).
- `algo.loss_agg` -> `loss_type`: covey's `seq_mean_token_mean` is TRL's `grpo` (each micro-batch's mean
  of sequence token means over the accumulation steps: equal micro-batches make it covey's global mean),
  `token_mean` is `dapo`, `constant` is `dr_grpo`; `seq_mean_token_sum` has no counterpart.
- KL: k3 in the loss with r = pi_ref / pi_theta is TRL's only in-loss KL; its default
  `use_bias_correction_kl=True` multiplies it by the importance ratio, which changes the gradient even
  on-policy, so it is switched off.
- std normalisation, clip eps low/high, lr and warm-up, AdamW betas and weight decay, max_grad_norm,
  sampling, max new tokens, seed, gradient checkpointing (TRL's default is on: set from covey's) and bf16
  autocast exactly where covey's `model.autocast` resolves to bfloat16.

What does not map (stated, not patched): TRL divides by the group std with Bessel's correction plus 1e-4,
covey by the population std plus 1e-6 (`algo.ddof=1 algo.adv_eps=1e-4` makes them identical); covey
samples from a bf16 copy where bf16 is native, TRL with the training weights; each library orders the
prompts with its own generator. Timing: generation, scoring and the no-grad log-prob passes wrap TRL's
own methods in a subclass; `update` is the rest of the step.
"""

from __future__ import annotations

import dataclasses
import functools
import tempfile
import time
from collections import defaultdict
from contextlib import contextmanager

import torch
from transformers import TrainerCallback

from bench.harness import LinearFlops, cap_memory, child_args, peak_rss_mib, say, write_json
from bench.workloads import SETUPS, STEP_CAP, WORKLOADS, Schedule, Tracker, varied_reward, workload_keys
from covey.config import load_config
from covey.runtime.dist import resolve_device
from covey.runtime.precision import resolve_autocast

LOSS_TYPES = {"seq_mean_token_mean": "grpo", "token_mean": "dapo", "constant": "dr_grpo"}
# covey settings that change the update and that TRL's GRPOTrainer has no switch for: (key, value it must have)
REQUIRED = (
    ("algo.learner", "advantage"), ("algo.estimator", "grpo"), ("algo.policy_loss", "ppo_clip"),
    ("algo.ratio_level", "token"), ("algo.ratio_against", "old"), ("algo.dual_clip", 0.0),
    ("algo.adaptive_kl.target", 0.0), ("algo.entropy_coef", 0.0), ("algo.token_credit", "shared"),
    ("algo.epochs", 1), ("algo.minibatches", 1), ("algo.dynamic_sampling.enabled", False),
    ("algo.ref_refresh_every", 0), ("algo.ref_ema", 0.0), ("algo.tis.cap", 0.0),
    ("reward.format", 0.0), ("reward.overlong_buffer", 0), ("reward.functions", ""),
    ("reward.model_path", ""), ("reward.prm_path", ""), ("reward.remote_url", ""), ("reward.language", 0.0),
    ("model.lora_rank", 0),
)
TRAINER_KEYS = ("peft_config", "quantization_config")  # GRPOTrainer's arguments in a setup, not GRPOConfig's
QUIET = dict(logging_steps=1, report_to="none", save_strategy="no", disable_tqdm=True, dataloader_num_workers=0)


def check_mappable(cfg) -> None:
    """Raise ValueError naming the first covey setting TRL's GRPOTrainer cannot reproduce."""
    for key, value in REQUIRED:
        if (have := functools.reduce(getattr, key.split("."), cfg)) != value:
            raise ValueError(f"{key}={have!r} has no TRL GRPOTrainer counterpart (needs {value!r})")
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


def trainer_objects(setup: dict) -> dict:
    """GRPOTrainer's keyword arguments of a setup: peft's LoraConfig and bitsandbytes' NF4 config, made."""
    kwargs = {}
    if "peft_config" in setup:
        from peft import LoraConfig
        kwargs["peft_config"] = LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules="all-linear",
                                           task_type="CAUSAL_LM")
    if "quantization_config" in setup:
        from transformers import BitsAndBytesConfig
        kwargs["quantization_config"] = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                                           bnb_4bit_use_double_quant=True,
                                                           bnb_4bit_compute_dtype=torch.bfloat16)
    return kwargs


# --------------------------------------------------------------------------- the timed trainer


class Meter:
    """The steps of a TRL run in the harness's format: the trainer's timed methods add their phases and
    tokens, a callback opens and closes each optimizer step; `update` is the rest of the step."""

    def __init__(self):
        self.records, self.phases, self.tokens, self.t0 = [], defaultdict(float), 0, 0.0
        self.flops: LinearFlops | None = None

    def count_flops(self, model) -> None:
        self.flops = LinearFlops(model)

    @contextmanager
    def phase(self, name: str):
        t0 = time.perf_counter()
        yield
        self.phases[name] += time.perf_counter() - t0

    def add_tokens(self, n: int) -> None:
        self.tokens += n

    def begin(self) -> None:
        self.phases, self.tokens, self.t0 = defaultdict(float), 0, time.perf_counter()
        if self.flops is not None:
            self.flops.take()

    def end(self, step: int) -> dict:
        seconds, p = time.perf_counter() - self.t0, self.phases
        record = {"step": step, "step_s": seconds, "generate_s": p["generate"], "score_s": p["score"],
                  "logprobs_s": p["logprobs"], "update_s": seconds - sum(p.values()), "tokens": self.tokens,
                  "flops": self.flops.take() if self.flops is not None else 0.0, "gpu_peak_mib": None}
        self.records.append(record)
        say(f"trl step {step}: {seconds:.2f} s {dict(p)}")
        return record


class StepCallback(TrainerCallback):
    """Opens and closes each step on the meter; with a tracker, saves its evaluation points and stops the run
    when its Schedule says (a changed TrainerControl returned, as transformers' callbacks do)."""

    def __init__(self, meter: Meter, tracker: Tracker | None = None):
        self.meter, self.tracker = meter, tracker

    def on_step_begin(self, args, state, control, **kwargs):
        if self.tracker is not None:
            self.tracker.begin()
        self.meter.begin()

    def on_step_end(self, args, state, control, model=None, processing_class=None, **kwargs):
        record = self.meter.end(state.global_step)
        if self.tracker is None:
            return None

        def save(folder):
            model.save_pretrained(folder, safe_serialization=True)
            processing_class.save_pretrained(folder)

        self.tracker.end(state.global_step, record["step_s"], save)
        return dataclasses.replace(control, should_training_stop=self.tracker.done)

    def on_log(self, args, state, control, logs=None, **kwargs):
        if self.tracker is not None and logs and "reward" in logs:
            self.tracker.note_reward(logs["reward"])


def timed_trainer(cfg, model: str, reward, config, callback: StepCallback, **trainer_kwargs):
    """TRL's GRPOTrainer on the config's train problems (covey's examples as conversational prompts, their
    answers in the `answer` column covey's correctness reward reads), its phases timed into the callback's meter."""
    from datasets import Dataset
    from trl import GRPOTrainer

    from covey.tasks.base import build_messages
    from covey.tasks.data import load_task_data
    meter = callback.meter

    class TimedGRPOTrainer(GRPOTrainer):
        def _generate(self, prompts):
            with meter.phase("generate"):
                out = super()._generate(prompts)
            meter.add_tokens(sum(len(ids) for ids in out[1]))
            return out

        def _calculate_rewards(self, *args, **kwargs):
            with meter.phase("score"):
                return super()._calculate_rewards(*args, **kwargs)

        def _get_per_token_logps_and_entropies(self, *args, **kwargs):
            if torch.is_grad_enabled():  # the training forward: part of `update`
                return super()._get_per_token_logps_and_entropies(*args, **kwargs)
            with meter.phase("logprobs"):
                return super()._get_per_token_logps_and_entropies(*args, **kwargs)

    system = cfg.task.system_prompt or None
    data = Dataset.from_list([{"prompt": build_messages(ex, system), "answer": ex.answer}
                              for ex in load_task_data(cfg.task, cfg.train.seed).train])
    return TimedGRPOTrainer(model=model, reward_funcs=reward, args=config, train_dataset=data, callbacks=[callback],
                            **trainer_kwargs)


# --------------------------------------------------------------------------- the roles


def role_steps(args) -> dict:
    """A workload's steps: covey's settings mapped, then the setup's (bench/workloads.py SETUPS); on a CPU
    workload TRL as it ships takes the step's samples in one forward; on a GPU, bf16 autocast where covey's
    resolves to bf16, HF `generate` (no vLLM), the benchmark's reward."""
    from trl import GRPOConfig, __version__

    from covey.models.load import resolve_model_path
    from covey.rewards.rules import correctness_reward
    w, gpu, setup = WORKLOADS[args.workload], torch.cuda.is_available(), SETUPS["trl"][args.setup or "mapped"]
    allowed = cap_memory(args.cap_gib)
    if args.threads:
        torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory(prefix="bench-trl-") as out_dir:
        # covey's config without its reward keys: the GPU benchmark's reward function is handed to both trainers
        cfg = load_config("grpo", [k for k in workload_keys(args.workload, args.steps, out_dir, args.model,
                                                            args.threads) if not k.startswith("reward.")])
        bf16 = w["gpu"] and resolve_autocast(cfg.model.autocast, "cuda" if gpu else "cpu") == "bfloat16"
        micro = w["prompts"] * w["group_size"] if w["trl_whole_step"] else 0
        settings = {**trl_grpo_kwargs(cfg, micro, bf16), **{k: v for k, v in setup.items() if k not in TRAINER_KEYS}}
        config = GRPOConfig(output_dir=out_dir, max_steps=args.steps, use_cpu=not gpu, use_vllm=False, **settings,
                            **QUIET)
        callback = StepCallback(Meter())
        trainer = timed_trainer(cfg, resolve_model_path(cfg.model.path), varied_reward if w["gpu"] else
                                correctness_reward, config, callback, **trainer_objects(setup))
        if args.flops:
            callback.meter.count_flops(trainer.model)
        described = {"trl": __version__, "model_dtype": str(next(trainer.model.parameters()).dtype),
                     **{k: str(getattr(config, k)) for k in ("bf16", "gradient_checkpointing", "loss_type", "optim",
                                                             "per_device_train_batch_size", "use_liger_kernel",
                                                             "gradient_accumulation_steps", "steps_per_generation")},
                     "trainer_kwargs": sorted(trainer_objects(setup))}
        say(f"TRL setup: {described}")
        if gpu:  # the peak of the steps (its models loaded, its optimizer state from step 1)
            torch.cuda.reset_peak_memory_stats()
        trainer.train()
    return {"name": args.name or "trl", "steps": callback.meter.records, "peak_rss_mib": peak_rss_mib(),
            "peak_gpu_mib": torch.cuda.max_memory_allocated() / 2**20 if gpu else None, "allowed_gib": allowed,
            "precision": "bfloat16 (autocast)" if config.bf16 else "float32", "setup": described}


def role_learn(args) -> dict:
    """A learning run on covey's config until the Schedule stops it, scored by covey's correctness reward,
    TRL on the device covey's train.device names."""
    from trl import GRPOConfig

    from covey.models.load import resolve_model_path
    from covey.rewards.rules import correctness_reward
    from covey.tasks.data import load_task_data
    from covey.tasks.verifiers import resolve_verifier
    cfg = load_config("grpo", args.overrides)
    if cfg.model.threads:
        torch.set_num_threads(cfg.model.threads)
    device = resolve_device(cfg.train.device)
    if resolve_verifier(cfg.eval.metric, [ex.answer for ex in load_task_data(cfg.task, cfg.train.seed).eval]) != "math":
        raise SystemExit("bench: eval.metric does not resolve to 'math', the verifier of TRL's correctness reward")
    settings = trl_grpo_kwargs(cfg, autocast_bf16=resolve_autocast(cfg.model.autocast, device) == "bfloat16")
    tracker = Tracker(Schedule(args.steps, args.minutes, args.eval_every, args.max_minutes),
                      cfg.rollout.prompts_per_step * cfg.rollout.group_size, args.save_dir)
    with tempfile.TemporaryDirectory(prefix="learn-trl-") as tmp:
        config = GRPOConfig(output_dir=tmp, max_steps=STEP_CAP, use_cpu=device == "cpu", use_vllm=False, **settings,
                            **QUIET)
        timed_trainer(cfg, resolve_model_path(cfg.model.path), correctness_reward, config,
                      StepCallback(Meter(), tracker)).train()
    return tracker.result(precision="bfloat16" if settings["bf16"] else "none", trl_settings=settings, device=device)


ROLES = {"steps": role_steps, "learn": role_learn}


def main(argv=None) -> None:
    args = child_args("the TRL side of bench/'s drivers", ROLES, argv)
    write_json(args.result, ROLES[args.role](args))


if __name__ == "__main__":
    main()
