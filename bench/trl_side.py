"""The TRL side (the `bench` extra), a role per child: `steps` and `learn`, as covey_side's. `trl_grpo_kwargs` maps
covey's Config to GRPOConfig arguments with the same update (TRL 1.16) and refuses by name what has no counterpart
(REQUIRED): G generations, micro-batches accumulated to one optimizer step per generation batch (`num_iterations=1`:
no old-log-prob pass on either side); `seq_mean_token_mean` is TRL's `grpo` loss (equal micro-batches make its mean
covey's global one), `token_mean` is `dapo`, `constant` is `dr_grpo`; k3 in the loss, r = pi_ref / pi_theta, without
TRL's `use_bias_correction_kl` (it changes the gradient on-policy). Not mapped, stated: TRL's group std has Bessel's
correction and +1e-4 (`algo.ddof=1 algo.adv_eps=1e-4` gives covey the same); covey samples from a bf16 copy where
bf16 is native; each orders prompts its own way. Timing: generation, scoring and no-grad log-prob passes wrap TRL's
methods; `update` is the rest of a step."""

from __future__ import annotations

import dataclasses
import functools
import tempfile
import time
from collections import defaultdict

import torch
from transformers import TrainerCallback

from bench.harness import PHASES, LinearFlops, cap_memory, child_main, peak_rss_mib, say
from bench.workloads import SETUPS, STEP_CAP, WORKLOADS, Schedule, Tracker, varied_reward, workload_keys
from covey.config import load_config
from covey.runtime.dist import resolve_device
from covey.runtime.precision import resolve_autocast

LOSS_TYPES = {"seq_mean_token_mean": "grpo", "token_mean": "dapo", "constant": "dr_grpo"}
REQUIRED = {  # covey settings that change the update: the values TRL's GRPOTrainer has a counterpart for
    "algo.learner": ("advantage",), "algo.estimator": ("grpo",), "algo.policy_loss": ("ppo_clip",),
    "algo.ratio_level": ("token",), "algo.ratio_against": ("old",), "algo.dual_clip": (0.0,),
    "algo.adaptive_kl.target": (0.0,), "algo.entropy_coef": (0.0,), "algo.token_credit": ("shared",),
    "algo.epochs": (1,), "algo.minibatches": (1,), "algo.dynamic_sampling.enabled": (False,),
    "algo.ref_refresh_every": (0,), "algo.ref_ema": (0.0,), "algo.tis.cap": (0.0,), "algo.loss_agg": tuple(LOSS_TYPES),
    "algo.normalize": ("auto", "group"), "reward.format": (0.0,), "reward.overlong_buffer": (0,),
    "reward.functions": ("",), "reward.model_path": ("",), "reward.prm_path": ("",), "reward.remote_url": ("",),
    "reward.language": (0.0,), "reward.correctness": (1.0,), "model.lora_rank": (0,)}
TRAINER_KEYS = ("peft_config", "quantization_config")  # GRPOTrainer's arguments in a setup, not GRPOConfig's
QUIET = dict(logging_steps=1, report_to="none", save_strategy="no", disable_tqdm=True, dataloader_num_workers=0)


def check_mappable(cfg) -> None:
    """Raise ValueError naming the first covey setting TRL's GRPOTrainer cannot reproduce."""
    for key, allowed in REQUIRED.items():
        if (have := functools.reduce(getattr, key.split("."), cfg)) not in allowed:
            raise ValueError(f"{key}={have!r} has no TRL GRPOTrainer counterpart (mapped: {allowed})")
    a = cfg.algo
    if a.beta and a.kl_in != "none" and (a.kl_in != "loss" or a.kl_estimator != "k3"):
        raise ValueError(f"algo.kl_in={a.kl_in} / algo.kl_estimator={a.kl_estimator}: TRL puts k3 in the loss only")


def trl_grpo_kwargs(cfg, micro_batch: int = 0, autocast_bf16: bool = False) -> dict:
    """GRPOConfig arguments for covey's `cfg`, micro-batches of `micro_batch` (0: covey's) to one B*G step."""
    check_mappable(cfg)
    a, r, o = cfg.algo, cfg.rollout, cfg.optim
    n = r.prompts_per_step * r.group_size
    if n % (micro := micro_batch or min(a.micro_batch_size, n)):
        raise ValueError(f"TRL micro-batch {micro} does not divide the {n} samples of a step (B*G)")
    beta1, beta2 = (float(x) for x in o.betas.split(","))
    return {
        "num_generations": r.group_size, "per_device_train_batch_size": micro,
        "gradient_accumulation_steps": n // micro, "num_iterations": 1,
        "max_completion_length": r.max_new_tokens, "temperature": r.temperature, "top_p": r.top_p, "top_k": r.top_k,
        "loss_type": LOSS_TYPES[a.loss_agg], "beta": a.beta if a.kl_in == "loss" else 0.0,
        "use_bias_correction_kl": False, "epsilon": a.clip_eps_low, "epsilon_high": a.clip_eps_high,
        "scale_rewards": "group" if a.std_normalize else "none", "learning_rate": o.lr,
        "lr_scheduler_type": "constant_with_warmup" if o.warmup_steps else "constant", "warmup_steps": o.warmup_steps,
        "adam_beta1": beta1, "adam_beta2": beta2, "weight_decay": o.weight_decay, "max_grad_norm": o.max_grad_norm,
        "seed": cfg.train.seed, "gradient_checkpointing": cfg.model.gradient_checkpointing, "bf16": autocast_bf16,
        "model_init_kwargs": {"dtype": cfg.model.dtype},
    }


def trainer_objects(setup: dict) -> dict:  # a setup's peft LoRA and bitsandbytes NF4 configs, made
    out = {}
    if "peft_config" in setup:
        from peft import LoraConfig
        out["peft_config"] = LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules="all-linear",
                                        task_type="CAUSAL_LM")
    if "quantization_config" in setup:
        from transformers import BitsAndBytesConfig
        out["quantization_config"] = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                                        bnb_4bit_use_double_quant=True,
                                                        bnb_4bit_compute_dtype=torch.bfloat16)
    return out


class StepMeter(TrainerCallback):
    """A TRL run's steps (timed phases, tokens); with a tracker, its evaluation points saved and its stop."""

    def __init__(self, tracker: Tracker | None = None, count_flops: bool = False):
        self.tracker, self.records, self.count_flops, self.flops = tracker, [], count_flops, None
        self.phases, self.tokens, self.t0 = defaultdict(float), 0, 0.0

    def watch(self, model) -> None:  # the FLOP counter on the trainer's model, if asked for
        self.flops = LinearFlops(model) if self.count_flops else None

    def timed(self, name: str, fn, *args, **kwargs):
        t0 = time.perf_counter()
        out = fn(*args, **kwargs)
        self.phases[name] += time.perf_counter() - t0
        return out

    def add_tokens(self, n: int) -> None:
        self.tokens += n

    def on_step_begin(self, args, state, control, **kwargs):
        if self.tracker is not None:
            self.tracker.begin()
        self.phases, self.tokens, self.t0 = defaultdict(float), 0, time.perf_counter()
        if self.flops is not None:
            self.flops.take()

    def on_step_end(self, args, state, control, model=None, processing_class=None, **kwargs):
        seconds, p = time.perf_counter() - self.t0, self.phases
        self.records.append({"step": state.global_step, "step_s": seconds, **{f"{k}_s": p[k] for k in PHASES[:3]},
                             "update_s": seconds - sum(p.values()), "tokens": self.tokens, "gpu_peak_mib":
                             torch.cuda.max_memory_allocated() / 2**20 if torch.cuda.is_available() else None,
                             "flops": self.flops.take() if self.flops is not None else 0.0})
        say(f"trl step {state.global_step}: {seconds:.2f} s {dict(p)}")
        if self.tracker is None:
            return None

        def save(folder):
            model.save_pretrained(folder, safe_serialization=True)
            processing_class.save_pretrained(folder)

        self.tracker.end(state.global_step, seconds, save, self.records[-1]["gpu_peak_mib"])
        return dataclasses.replace(control, should_training_stop=self.tracker.done)


def train(cfg, reward, meter: StepMeter, max_steps: int, settings: dict, setup: dict | None = None) -> dict:
    """GRPOTrainer with `settings` (and the setup's objects) on the config's problems, on covey's train.device."""
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer, __version__

    from covey.models.load import resolve_model_path
    from covey.tasks.base import build_messages
    from covey.tasks.data import load_task_data

    class TimedGRPOTrainer(GRPOTrainer):
        def _generate(self, prompts):
            out = meter.timed("generate", super()._generate, prompts)
            meter.add_tokens(sum(len(ids) for ids in out[1]))
            return out

        def _calculate_rewards(self, *args, **kwargs):
            return meter.timed("score", super()._calculate_rewards, *args, **kwargs)

        def _get_per_token_logps_and_entropies(self, *args, **kwargs):  # with grad: the update's training forward
            passes = super()._get_per_token_logps_and_entropies
            return passes(*args, **kwargs) if torch.is_grad_enabled() else meter.timed("logprobs", passes, *args,
                                                                                       **kwargs)

    device, system = resolve_device(cfg.train.device), cfg.task.system_prompt or None
    data = Dataset.from_list([{"prompt": build_messages(ex, system), "answer": ex.answer}
                              for ex in load_task_data(cfg.task, cfg.train.seed).train])
    with tempfile.TemporaryDirectory(prefix="bench-trl-") as out_dir:
        config = GRPOConfig(output_dir=out_dir, max_steps=max_steps, use_cpu=device == "cpu", use_vllm=False,
                            **settings, **QUIET)
        trainer = TimedGRPOTrainer(model=resolve_model_path(cfg.model.path), reward_funcs=reward, args=config,
                                   train_dataset=data, callbacks=[meter], **trainer_objects(setup or {}))
        meter.watch(trainer.model)
        ran = {"trl": __version__, "device": device, "model_dtype": str(next(trainer.model.parameters()).dtype),
               **settings}
        if device != "cpu":  # the peak of the steps (its models loaded, its optimizer state from step 1)
            torch.cuda.reset_peak_memory_stats()
        trainer.train()
    return ran


def role_steps(spec: dict) -> dict:
    """A workload's steps: on a CPU TRL as it ships (a step's samples in one forward); on a GPU, bf16 autocast."""
    from covey.rewards.rules import correctness_reward
    w, allowed, meter = WORKLOADS[spec["workload"]], cap_memory(spec.get("cap_gib", 0)), StepMeter(None, spec.get(
        "flops", False))
    if spec.get("threads"):
        torch.set_num_threads(spec["threads"])
    with tempfile.TemporaryDirectory(prefix="bench-trl-") as out_dir:  # the GPU reward goes to both trainers
        cfg = load_config("grpo", [k for k in workload_keys(spec["workload"], spec["steps"], out_dir, spec.get(
            "model", ""), spec.get("threads", 0)) if not k.startswith("reward.")])
    bf16 = w["gpu"] and resolve_autocast(cfg.model.autocast, resolve_device(cfg.train.device)) == "bfloat16"
    setup = SETUPS["trl"][spec.get("setup", "mapped")]
    settings = {**trl_grpo_kwargs(cfg, w["prompts"] * w["group_size"] if w["trl_whole_step"] else 0, bf16),
                **{k: v for k, v in setup.items() if k not in TRAINER_KEYS}}
    ran = train(cfg, varied_reward if w["gpu"] else correctness_reward, meter, spec["steps"], settings, setup)
    return {"name": spec.get("name", "trl"), "steps": meter.records, "peak_rss_mib": peak_rss_mib(), "settings": ran,
            "peak_gpu_mib": torch.cuda.max_memory_allocated() / 2**20 if ran["device"] != "cpu" else None,
            "allowed_gib": allowed, "precision": "bfloat16 (autocast)" if ran["bf16"] else "float32"}


def role_learn(spec: dict) -> dict:
    from covey.rewards.rules import correctness_reward
    from covey.tasks.data import load_task_data
    from covey.tasks.verifiers import resolve_verifier
    cfg = load_config("grpo", spec["keys"])
    if cfg.model.threads:
        torch.set_num_threads(cfg.model.threads)
    if resolve_verifier(cfg.eval.metric, [ex.answer for ex in load_task_data(cfg.task, cfg.train.seed).eval]) != "math":
        raise SystemExit("bench: eval.metric does not resolve to 'math', the verifier of TRL's correctness reward")
    device = resolve_device(cfg.train.device)
    tracker = Tracker(Schedule(*spec["schedule"]), cfg.rollout.prompts_per_step * cfg.rollout.group_size,
                      spec["save_dir"])
    ran = train(cfg, correctness_reward, StepMeter(tracker), STEP_CAP,
                trl_grpo_kwargs(cfg, autocast_bf16=resolve_autocast(cfg.model.autocast, device) == "bfloat16"))
    return tracker.result(precision="bfloat16" if ran["bf16"] else "none", trl_settings=ran, device=device)


if __name__ == "__main__":
    child_main({"steps": role_steps, "learn": role_learn})
