"""bench/gpu_bench.py's TRL child: GRPOTrainer on the benchmark's workload, timed by phase with
bench/run_trl.py's timers (`update` is the rest of the step).

TRL's default model load (fp32 weights, device_map auto), HF `generate` (use_vllm=False), and the
settings of the covey child's config mapped by bench/trl_map.py (the mapping the CPU benchmark
uses: the same loss aggregation, KL, clipping, lr, micro-batches; bf16 autocast where covey's
model.autocast resolves to bf16, so on a GPU bf16=True). Gradient checkpointing follows covey's
(off) unless --trl-gc (TRL's own default, on). One optimizer step per rollout of 8 prompts x 8
samples: per_device_train_batch_size=8 with gradient_accumulation_steps=8, so the old-policy pass
is skipped as in covey. Fixed-length responses: generation_kwargs min_new_tokens = max_completion_length.
"""

from __future__ import annotations

import shutil
import tempfile

import torch

from gpu_roles import WORKLOADS, peak_gpu_bytes, say


class NoFlops:
    """run_trl's step timer reads a FLOP counter; FLOPs here are computed from the shapes (gpu_roles.update_flops)."""

    def take(self) -> float:
        return 0.0


def covey_config(args):
    """The covey child's config without its reward keys: the source of TRL's settings (bench/trl_map.py
    maps the scoring of correctness only; the benchmark's reward function is handed to both trainers)."""
    from covey.config import load_config
    from gpu_covey import overrides
    keys = [k for k in overrides(args, tempfile.gettempdir()) if not k.startswith("reward.")]
    return load_config("grpo", keys)


def role_trl(args) -> dict:
    from trl import GRPOConfig, __version__

    from covey.runtime.precision import resolve_autocast
    from covey.tasks.data import load_task_data
    from gpu_bench import varied_reward
    from run_trl import make_trainer_class, step_recorder
    from trl_map import trl_dataset, trl_grpo_kwargs
    w, gpu = WORKLOADS[args.workload], torch.cuda.is_available()
    cfg = covey_config(args)
    bf16 = resolve_autocast(cfg.model.autocast, "cuda" if gpu else "cpu") == "bfloat16"
    settings = trl_grpo_kwargs(cfg, autocast_bf16=bf16)
    if args.trl_gc:
        settings["gradient_checkpointing"] = True  # TRL's own default
    out_dir = tempfile.mkdtemp(prefix="bench-trl-")
    config = GRPOConfig(output_dir=out_dir, max_steps=args.steps, use_cpu=not gpu, use_vllm=False, **settings,
                        generation_kwargs={"min_new_tokens": w["new_tokens"]}, logging_steps=1, report_to="none",
                        save_strategy="no", disable_tqdm=True, dataloader_num_workers=0)
    records, box = [], {}
    train = load_task_data(cfg.task, w["seed"]).train
    trainer = make_trainer_class()(model=args.model, reward_funcs=varied_reward, args=config,
                                   train_dataset=trl_dataset(train, cfg.task.system_prompt),
                                   callbacks=[step_recorder(box, records, {"counter": NoFlops()})])
    box["trainer"] = trainer
    model = trainer.model
    setup = {"trl": __version__, "model_dtype": str(next(model.parameters()).dtype), "bf16": config.bf16,
             "gradient_checkpointing": config.gradient_checkpointing, "model_init_kwargs": config.model_init_kwargs,
             "loss_type": config.loss_type, "per_device_train_batch_size": config.per_device_train_batch_size,
             "gradient_accumulation_steps": config.gradient_accumulation_steps,
             "steps_per_generation": config.steps_per_generation,
             "reference_dtype": str(next(trainer.ref_model.parameters()).dtype) if trainer.ref_model else None}
    say(f"TRL setup: {setup}")
    if gpu:  # the peak of the steps, as covey's phase peaks (its models loaded, its optimizer state from step 1)
        torch.cuda.reset_peak_memory_stats()
    trainer.train()
    shutil.rmtree(out_dir, ignore_errors=True)
    steps = [{"step_s": r.seconds, "generate_s": r.phases.get("generate", 0.0), "score_s": r.phases.get("score", 0.0),
              "reference_s": r.phases.get("logprobs", 0.0), "update_s": r.phases["update"],
              "response_tokens": r.completion_tokens} for r in records]
    for i, s in enumerate(steps):
        say(f"trl step {i + 1}: {s['step_s']:.2f} s (generate {s['generate_s']:.2f}, reference "
            f"{s['reference_s']:.2f}, update {s['update_s']:.2f})")
    return {"steps": steps, "peak_gpu_bytes": peak_gpu_bytes(), "setup": setup}
