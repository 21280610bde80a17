"""What the benchmarks run (docs/benchmark.md, docs/scale.md): the workloads, each a covey `grpo` config that the
TRL side maps; the memory setups; the random Qwen2 models; the learning runs' stop rule and evaluation points."""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from bench.harness import say

CPU = dict(prompts=4, group_size=8, new_tokens=64, beta=0.04, lr=1e-5, temperature=1.0, micro_batch=8, seed=0,
           train_size=600, gpu=False, trl_whole_step=True)
GPU = dict(CPU, new_tokens=256, lr=1e-6, prompts=8, gpu=True, trl_whole_step=False, steps=4)
SMOKE = dict(prompts=2, group_size=4, micro_batch=4, train_size=16)
WORKLOADS = {"cpu": CPU, "cpu-smoke": {**CPU, **SMOKE, "new_tokens": 8},
             "gpu": GPU, "gpu-smoke": {**GPU, **SMOKE, "new_tokens": 12, "steps": 3},
             "capacity": {**GPU, "new_tokens": 512, "steps": 3}}
# Qwen2.5-0.5B ... -14B (their config.json: hidden, MLP, layers, query heads, key-value heads), a tiny smoke shape
SHAPES = {size: dict(zip(("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                          "num_key_value_heads"), dims))
          for size, dims in {"0.5b": (896, 4864, 24, 14, 2), "1.5b": (1536, 8960, 28, 12, 2),
                             "3b": (2048, 11008, 36, 16, 2), "7b": (3584, 18944, 28, 28, 4),
                             "14b": (5120, 13824, 48, 40, 8), "smoke": (64, 128, 2, 4, 2)}.items()}
LORA = ["model.lora_rank=16", "model.lora_alpha=32", "model.gradient_checkpointing=true", "model.fused_kernels=auto"]
TRL_MEMORY = {"model_init_kwargs": {"dtype": "bfloat16"}, "gradient_checkpointing": True, "optim": "adamw_8bit",
              "use_liger_kernel": True}
TRL_LORA = "LoraConfig(r=16, lora_alpha=32, target_modules='all-linear')"
SETUPS = {  # trainer -> setup -> covey key=value settings / TRL settings on top of the workload's
    "covey": {"defaults": [],
              "full": ["model.dtype=bfloat16", "optim.name=adamw_8bit", "model.gradient_checkpointing=true",
                       "model.fused_kernels=auto"],
              "lora": ["model.dtype=bfloat16", *LORA], "qlora": ["model.load_in_4bit=true", *LORA]},
    "trl": {"mapped": {}, "gc": {"gradient_checkpointing": True}, "bf16": {"bf16": True},
            "defaults": {"gradient_checkpointing": True}, "full": TRL_MEMORY,
            "lora": {**TRL_MEMORY, "peft_config": TRL_LORA},
            "qlora": {**TRL_MEMORY, "peft_config": TRL_LORA,
                      "quantization_config": "BitsAndBytesConfig(nf4, double quantization, bf16 compute)"}},
}
LEARN_SMOKE = ["task.train_size=32", "task.eval_size=8", "rollout.prompts_per_step=2", "rollout.group_size=4",
               "rollout.max_new_tokens=8", "rollout.eval_max_new_tokens=8", "algo.micro_batch_size=4"]
STEP_CAP = 1_000_000  # train.steps / max_steps of a learning run: its Schedule stops it


def varied_reward(prompts, completions, **_):
    """The GPU benchmark's reward: deterministic, different between samples (TRL's completions are chat messages)."""
    texts = [c if isinstance(c, str) else c[-1]["content"] for c in completions]
    return [(sum(map(ord, t)) % 7) / 6 for t in texts]


def workload_keys(workload: str, steps: int, out_dir: str, model: str = "", threads: int = 0) -> list[str]:
    """A workload's covey settings: one optimizer step per rollout, no evaluation, a throw-away run folder."""
    w = WORKLOADS[workload]
    keys = [f"train.steps={steps}", "train.max_minutes=0", f"rollout.prompts_per_step={w['prompts']}",
            f"rollout.group_size={w['group_size']}", f"rollout.max_new_tokens={w['new_tokens']}",
            f"algo.beta={w['beta']}", f"optim.lr={w['lr']}", f"algo.micro_batch_size={w['micro_batch']}",
            f"rollout.temperature={w['temperature']}", f"train.seed={w['seed']}", "task.eval_size=8",
            "rollout.eval_max_new_tokens=8", f"train.output_dir={out_dir}", "train.run_name=bench",
            "train.progress=false", "train.samples_every=0", *([f"model.path={model}"] if model else [])]
    if w["gpu"]:
        return [*keys, f"train.device={'cuda' if torch.cuda.is_available() else 'cpu'}", "reward.correctness=0"]
    return [*keys, "train.device=cpu", f"task.train_size={w['train_size']}", f"model.threads={threads}"]


def build_model(size: str, model_dir: str, tokenizer_dir: str, workload: str) -> dict:
    """A random Qwen2 of the size's shape in bf16 with SmolLM2's tokenizer (or `tokenizer_dir`'s), saved; its
    shape and the task's mean prompt length. Every response runs to its full length on both trainers: the
    folder's end-of-sequence token is one added past the model's vocabulary, which the model cannot sample."""
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    from covey.config import load_config
    from covey.models.default import prepare_default_model
    from covey.tasks.data import format_prompts, load_task_data
    tok = AutoTokenizer.from_pretrained(tokenizer_dir or prepare_default_model())
    config = Qwen2Config(**SHAPES[size], vocab_size=len(tok), tie_word_embeddings=True, rope_theta=1e6,
                         rms_norm_eps=1e-6, max_position_embeddings=32768, bos_token_id=tok.bos_token_id,
                         eos_token_id=len(tok), pad_token_id=tok.pad_token_id)
    torch.manual_seed(0)
    before, _ = torch.get_default_dtype(), torch.set_default_dtype(torch.bfloat16)  # made in bf16: 7B fits
    try:
        with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
            Qwen2ForCausalLM(config).save_pretrained(model_dir)
    finally:
        torch.set_default_dtype(before)
    tok.add_special_tokens({"eos_token": "<|bench_end_of_response|>"})  # id len(tok) before it
    tok.save_pretrained(model_dir)
    data = load_task_data(load_config("grpo", []).task, WORKLOADS[workload]["seed"])
    lengths = [len(tok(p, add_special_tokens=False)["input_ids"]) for p in format_prompts(tok, data.train[:200])]
    return {**model_shape(config, config.vocab_size), "prompt_tokens_mean": statistics.mean(lengths)}


def model_shape(config, vocab: int) -> dict:
    d, h, kv, layers = config.hidden_size, config.num_attention_heads, config.num_key_value_heads, \
        config.num_hidden_layers
    head_dim = d // h
    matmul = layers * (2 * d * h * head_dim + 2 * d * kv * head_dim + 3 * d * config.intermediate_size) + vocab * d
    params = matmul + layers * (2 * d + (h + 2 * kv) * head_dim) + d  # and the norms and biases
    return {"layers": layers, "heads": h, "kv_heads": kv, "head_dim": head_dim, "params": params,
            "matmul_params": matmul, "describe": f"Qwen2 hidden {d}, {layers} layers, {h}/{kv} heads of {head_dim}, "
            f"MLP {config.intermediate_size}, vocabulary {vocab}: {params / 1e6:.0f}M parameters ({matmul / 1e6:.0f}M)"}


def update_flops(shape: dict, w: dict, prompt_tokens: float) -> float:
    """Model FLOPs of an update: 6 x matmul parameters x tokens plus attention, each prompt once."""
    n, length, p = w["prompts"] * w["group_size"], w["new_tokens"], prompt_tokens
    pairs = n * (length * p + length * (length + 1) / 2) + w["prompts"] * p * (p + 1) / 2
    return (6 * shape["matmul_params"] * (n * length + w["prompts"] * p)
            + 3 * 4 * shape["heads"] * shape["head_dim"] * shape["layers"] * pairs)


def floor_bytes(shape: dict, w: dict, prompt_tokens: float) -> float:
    """Bytes a decode step of the bf16 sampling copy reads on average: every weight once, the keys and values in use."""
    per_position = 2 * shape["layers"] * shape["kv_heads"] * shape["head_dim"] * 2
    return 2 * shape["params"] + w["prompts"] * w["group_size"] * (prompt_tokens + (w["new_tokens"] + 1) / 2) * \
        per_position


@dataclass(frozen=True)
class Schedule:
    """A learning run ends at step >= `steps` AND `minutes` of training time (or past `max_minutes`, 0: no cap)."""
    steps: int
    minutes: float
    eval_every: int
    max_minutes: float = 0.0

    def done(self, step: int, seconds: float) -> bool:
        capped = self.max_minutes > 0 and seconds >= 60 * self.max_minutes
        return capped or (step >= self.steps and seconds >= 60 * self.minutes)

    def tags(self, step: int, seconds: float, before: float) -> list[str]:
        limit = 60 * self.minutes
        marks = {"every": bool(self.eval_every) and step % self.eval_every == 0, "steps": step == self.steps,
                 "minutes": 0 < limit and before < limit <= seconds, "final": self.done(step, seconds)}
        return [tag for tag, on in marks.items() if on]


class Tracker:
    """A learning run's steps and saved evaluation points; training time runs from the first step, less the saving."""

    def __init__(self, schedule: Schedule, samples_per_step: int, save_dir: Path):
        self.schedule, self.samples_per_step, self.save_dir = schedule, samples_per_step, Path(save_dir)
        self.steps, self.points, self.start, self.saving, self.done = [], [], None, 0.0, False
        self.save_dir.mkdir(parents=True, exist_ok=True)

    def begin(self) -> None:
        if self.start is None:
            self.start = time.perf_counter()

    def end(self, step: int, step_s: float, save, gpu_peak_mib: float | None = None) -> None:
        seconds = time.perf_counter() - self.start - self.saving
        tags = self.schedule.tags(step, seconds, self.steps[-1]["seconds"] if self.steps else 0.0)
        self.steps.append({"step": step, "seconds": seconds, "step_s": step_s, "gpu_peak_mib": gpu_peak_mib})
        if tags:
            t0, folder = time.perf_counter(), self.save_dir / f"step-{step:06d}"
            save(folder)
            self.saving += time.perf_counter() - t0
            self.points.append({"step": step, "samples": step * self.samples_per_step, "minutes": seconds / 60,
                                "tags": tags, "folder": str(folder)})
        self.done = self.schedule.done(step, seconds)
        say(f"step {step}: {seconds:.1f} s of training")

    def result(self, **extra) -> dict:
        peaks = [s["gpu_peak_mib"] for s in self.steps if s["gpu_peak_mib"] is not None]
        return {"steps": self.steps, "points": self.points, "threads": torch.get_num_threads(),
                "gpu_peak_mib": max(peaks, default=None), **extra}
