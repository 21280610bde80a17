"""bench/gpu_bench.py's TRL child: GRPOTrainer as it ships (TRL's default model load: fp32 weights, device_map
auto; bf16=True autocast; gradient checkpointing on; HF `generate`, use_vllm=False) on the benchmark's
workload, timed by phase with bench/run_trl.py's timers (`update` is the rest of the step).

One optimizer step per rollout of 8 prompts x 8 samples: per_device_train_batch_size=8 (TRL's
default) with gradient_accumulation_steps=8, so steps_per_generation=8 and the old-policy pass is
skipped as in covey. Fixed-length responses: generation_kwargs min_new_tokens = max_completion_length.
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


def dataset(seed: int):
    """covey's arithmetic prompts (the covey child's task) as TRL conversational prompts."""
    from datasets import Dataset

    from covey.config import load_config
    from covey.tasks.data import load_task_data
    data = load_task_data(load_config("grpo", []).task, seed)
    return Dataset.from_list([{"prompt": [{"role": "user", "content": ex.prompt}], "answer": ex.answer}
                              for ex in data.train])


def role_trl(args) -> dict:
    from trl import GRPOConfig, __version__

    from gpu_bench import varied_reward
    from run_trl import make_trainer_class, step_recorder
    w, gpu = WORKLOADS[args.workload], torch.cuda.is_available()
    n = w["prompts"] * w["group_size"]
    out_dir = tempfile.mkdtemp(prefix="bench-trl-")
    config = GRPOConfig(
        output_dir=out_dir, max_steps=args.steps, use_cpu=not gpu, bf16=gpu, use_vllm=False,
        per_device_train_batch_size=w["micro_batch"], gradient_accumulation_steps=n // w["micro_batch"],
        num_generations=w["group_size"], max_completion_length=w["new_tokens"], beta=w["beta"],
        learning_rate=w["lr"], lr_scheduler_type="constant", temperature=w["temperature"], top_k=0, top_p=1.0,
        generation_kwargs={"min_new_tokens": w["new_tokens"]}, seed=w["seed"], logging_steps=1,
        report_to="none", save_strategy="no", disable_tqdm=True, dataloader_num_workers=0)
    records, box = [], {}
    trainer = make_trainer_class()(model=args.model, reward_funcs=varied_reward, args=config,
                                   train_dataset=dataset(w["seed"]), callbacks=[step_recorder(box, records, {"counter": NoFlops()})])
    box["trainer"] = trainer
    model = trainer.model
    setup = {"trl": __version__, "model_dtype": str(next(model.parameters()).dtype), "bf16": config.bf16,
             "gradient_checkpointing": config.gradient_checkpointing, "model_init_kwargs": config.model_init_kwargs,
             "per_device_train_batch_size": config.per_device_train_batch_size,
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

