"""What the benchmarks run: the CPU workload, the Qwen-shaped GPU workloads, the learning workload (its
stop rule and evaluation points), and the reward both trainers score with where correctness would not vary.

Every workload is a covey `grpo` config (the preset plus key=value settings, built here); the TRL side
reads its settings from that config (bench/trl_side.py), so both trainers run from one source.

- `cpu`: the workload the speed targets of docs/benchmark.md were set on: SmolLM2-135M-Instruct,
  4 prompts x 8 samples, 64 new tokens, beta 0.04, lr 1e-5, temperature 1.0 (TRL's default), fp32
  weights, one optimizer step per rollout, covey's micro-batches of 8 (its default).
- `gpu`: randomly initialised Qwen2 models with the dimensions of Qwen2.5-0.5B and -1.5B (SHAPES;
  grouped-query attention; SmolLM2's tokenizer, 49152 entries instead of Qwen's 151936, so the sampled
  ids decode), saved once in bf16; 8 prompts x 8 samples, 256 new tokens at fixed length, beta 0.04,
  lr 1e-6, temperature 1, micro-batches of 8, the deterministic `varied_reward` (every step updates).
- learning: covey's default run (`covey train`) to `--steps` AND `--minutes` of training time, or to
  `--max-minutes` whichever those say (Schedule).
- `*-smoke`: tiny shapes and few tokens, the whole pipeline in seconds on a CPU (tests/bench/).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from pathlib import Path

CPU = dict(prompts=4, group_size=8, new_tokens=64, beta=0.04, lr=1e-5, temperature=1.0, micro_batch=8,
           train_size=600, seed=0)
GPU = dict(prompts=8, group_size=8, new_tokens=256, beta=0.04, lr=1e-6, temperature=1.0, micro_batch=8, seed=0,
           steps=4)
WORKLOADS = {
    "cpu": CPU, "cpu-smoke": {**CPU, "prompts": 2, "group_size": 4, "new_tokens": 8, "micro_batch": 4,
                              "train_size": 16},
    "gpu": GPU, "gpu-smoke": {**GPU, "prompts": 2, "group_size": 4, "new_tokens": 12, "micro_batch": 4, "steps": 3},
    # bench/gpu_capacity.py: 8 prompts x 8 samples x 512 tokens; step 1 is the first step's time, 2..3 steady
    "capacity": {**GPU, "new_tokens": 512, "steps": 3},
    "capacity-smoke": {**GPU, "prompts": 2, "group_size": 4, "new_tokens": 8, "micro_batch": 4, "steps": 2},
}
# Qwen2.5-0.5B, -1.5B, -3B, -7B and -14B (their config.json), and a tiny shape for the smoke workloads on a CPU
SHAPES = {
    "0.5b": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                 num_key_value_heads=2),
    "1.5b": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                 num_key_value_heads=2),
    "3b": dict(hidden_size=2048, intermediate_size=11008, num_hidden_layers=36, num_attention_heads=16,
               num_key_value_heads=2),
    "7b": dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
               num_key_value_heads=4),
    "14b": dict(hidden_size=5120, intermediate_size=13824, num_hidden_layers=48, num_attention_heads=40,
                num_key_value_heads=8),
    "smoke": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2),
}
LEARN_SMOKE = ["task.train_size=32", "task.eval_size=8", "rollout.prompts_per_step=2", "rollout.group_size=4",
               "rollout.max_new_tokens=8", "rollout.eval_max_new_tokens=8", "algo.micro_batch_size=4"]
STEP_CAP = 1_000_000  # train.steps / max_steps of a learning run: its Schedule stops it


def varied_reward(prompts, completions, **_):
    """The GPU benchmark's reward (both trainers): a deterministic score that differs between samples.
    TRL hands conversational completions as [{"role": "assistant", "content": text}]."""
    texts = [c if isinstance(c, str) else c[-1]["content"] for c in completions]
    return [(sum(map(ord, t)) % 7) / 6 for t in texts]


def run_keys(w: dict, steps: int, out_dir: str) -> list[str]:
    """The covey settings of a speed workload `w` (one optimizer step per rollout, no held-out evaluation
    during the run, a throw-away run folder)."""
    return [f"train.steps={steps}", "train.max_minutes=0", f"rollout.prompts_per_step={w['prompts']}",
            f"rollout.group_size={w['group_size']}", f"rollout.max_new_tokens={w['new_tokens']}",
            f"algo.beta={w['beta']}", f"optim.lr={w['lr']}", f"algo.micro_batch_size={w['micro_batch']}",
            f"rollout.temperature={w['temperature']}", f"train.seed={w['seed']}", "task.eval_size=8",
            "rollout.eval_max_new_tokens=8", f"train.output_dir={out_dir}", "train.run_name=bench",
            "train.progress=false", "train.samples_every=0"]


def cpu_keys(workload: str, steps: int, threads: int, out_dir: str, model: str = "") -> list[str]:
    w = WORKLOADS[workload]
    return [*run_keys(w, steps, out_dir), f"task.train_size={w['train_size']}", f"model.threads={threads}",
            *([f"model.path={model}"] if model else [])]


def gpu_keys(workload: str, model: str, steps: int, out_dir: str, extra: str = "") -> list[str]:
    """The GPU workload on a model folder; covey scores with `varied_reward` only (reward.correctness=0;
    the function is handed to open_run)."""
    import torch
    device = "cuda" if torch.cuda.is_available() else "cpu"
    return [*run_keys(WORKLOADS[workload], steps, out_dir), f"model.path={model}", f"train.device={device}",
            "reward.correctness=0", *extra.split()]


def build_model(size: str, model_dir: str, tokenizer_dir: str, workload: str) -> dict:
    """A random Qwen2 of the size's dimensions with SmolLM2's tokenizer (or `tokenizer_dir`'s), saved in bf16;
    returns its shape and the mean prompt length of the task."""
    import torch
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    from covey.config import load_config
    from covey.models.default import prepare_default_model
    from covey.tasks.data import format_prompts, load_task_data
    tok = AutoTokenizer.from_pretrained(tokenizer_dir or prepare_default_model())
    config = Qwen2Config(**SHAPES[size], vocab_size=len(tok), tie_word_embeddings=True, rope_theta=1e6,
                         rms_norm_eps=1e-6, max_position_embeddings=32768, bos_token_id=tok.bos_token_id,
                         eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    torch.manual_seed(0)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = Qwen2ForCausalLM(config)
    model.to(torch.bfloat16).save_pretrained(model_dir)
    tok.save_pretrained(model_dir)
    shape = model_shape(config, len(tok))
    data = load_task_data(load_config("grpo", []).task, WORKLOADS[workload]["seed"])
    lengths = [len(tok(p, add_special_tokens=False)["input_ids"]) for p in format_prompts(tok, data.train[:200])]
    return {**shape, "prompt_tokens_mean": statistics.mean(lengths)}


def model_shape(config, vocab: int) -> dict:
    d, h, kv = config.hidden_size, config.num_attention_heads, config.num_key_value_heads
    head_dim = d // h
    per_layer = d * h * head_dim + 2 * d * kv * head_dim + h * head_dim * d + 3 * d * config.intermediate_size
    matmul_params = config.num_hidden_layers * per_layer + vocab * d  # the output projection included
    params = matmul_params + config.num_hidden_layers * (2 * d + (h + 2 * kv) * head_dim) + d  # norms, biases
    describe = (f"Qwen2 hidden {d}, {config.num_hidden_layers} layers, {h} query / {kv} key-value heads of {head_dim}, "
                f"MLP {config.intermediate_size}, vocabulary {vocab} (tied): {params / 1e6:.0f}M parameters, "
                f"{matmul_params / 1e6:.0f}M in matrix products")
    return {"hidden": d, "layers": config.num_hidden_layers, "heads": h, "kv_heads": kv, "head_dim": head_dim,
            "intermediate": config.intermediate_size, "vocab": vocab, "params": params,
            "matmul_params": matmul_params, "describe": describe}


def update_flops(shape: dict, w: dict, prompt_tokens: float) -> float:
    """Model FLOPs of one update: 6 x matmul parameters x tokens, plus attention (QK^T and PV, forward and
    backward: 3 x 4 x heads x head_dim per query-key pair), counting each distinct prompt once (the
    work the update needs; recomputation gets no credit)."""
    n, length, p = w["prompts"] * w["group_size"], w["new_tokens"], prompt_tokens
    tokens = n * length + w["prompts"] * p
    pairs = n * (length * p + length * (length + 1) / 2) + w["prompts"] * p * (p + 1) / 2
    per_pair = 3 * 4 * shape["heads"] * shape["head_dim"] * shape["layers"]
    return 6 * shape["matmul_params"] * tokens + per_pair * pairs


# --------------------------------------------------------------------------- the learning workload


@dataclass(frozen=True)
class Schedule:
    """When a learning run stops and which of its steps are evaluated; `seconds` is training time after
    the step. A run ends at the first step that is at least `steps` AND at least `minutes` of training
    time. Evaluation points: every `eval_every` steps, step `steps`, the first step boundary past
    `minutes`, and the last step (step 0, the untrained model, is evaluated by the driver).
    `max_minutes` (0: none) ends a run at the first step past it whatever the other two say: a budget
    for a run that must end within a fixed time."""
    steps: int
    minutes: float
    eval_every: int
    max_minutes: float = 0.0

    def done(self, step: int, seconds: float) -> bool:
        capped = self.max_minutes > 0 and seconds >= 60 * self.max_minutes
        return capped or (step >= self.steps and seconds >= 60 * self.minutes)

    def tags(self, step: int, seconds: float, before: float) -> list[str]:
        """Why step `step` is evaluated (empty: it is not); `before` is the training time after the previous step."""
        limit = 60 * self.minutes
        tags = []
        if self.eval_every and step % self.eval_every == 0:
            tags.append("every")
        if step == self.steps:
            tags.append("steps")
        if limit > 0 and before < limit <= seconds:
            tags.append("minutes")
        if self.done(step, seconds):
            tags.append("final")
        return tags


class Tracker:
    """Training time, per-step records and saved evaluation points of one learning run (either trainer).
    Training time is the wall clock from the first step's start to the end of the current one, minus the
    time spent saving evaluation folders (loading and set-up are not counted, on either side)."""

    def __init__(self, schedule: Schedule, samples_per_step: int, save_dir: Path):
        self.schedule, self.samples_per_step, self.save_dir = schedule, samples_per_step, Path(save_dir)
        self.steps: list[dict] = []
        self.points: list[dict] = []
        self.start: float | None = None
        self.saving = 0.0
        self.done = False

    def begin(self) -> None:
        if self.start is None:
            self.start = time.perf_counter()

    def end(self, step: int, step_s: float, save, reward: float | None = None,
            gpu_peak_mib: float | None = None) -> None:
        """After optimizer step `step` (its own duration `step_s`): record, and save via save(folder) when due.
        `gpu_peak_mib`: the step's peak GPU memory where the trainer measures it per step."""
        seconds = time.perf_counter() - self.start - self.saving
        before = self.steps[-1]["seconds"] if self.steps else 0.0
        self.steps.append({"step": step, "seconds": seconds, "step_s": step_s, "reward": reward,
                           **({"gpu_peak_mib": gpu_peak_mib} if gpu_peak_mib is not None else {})})
        tags = self.schedule.tags(step, seconds, before)
        if tags:
            t0 = time.perf_counter()
            folder = self.save_dir / f"step-{step:06d}"
            save(folder)
            self.saving += time.perf_counter() - t0
            self.points.append({"step": step, "samples": step * self.samples_per_step,
                                "minutes": seconds / 60, "tags": tags, "folder": str(folder)})
        self.done = self.schedule.done(step, seconds)
        print(f"bench: step {step}: {seconds:.1f} s of training", flush=True)

    def result(self, **extra) -> dict:
        """The run's record; on a GPU its peak memory (MiB): the largest per-step peak the trainer reported,
        else the process's peak since the CUDA statistics were last reset."""
        import torch
        out = {"steps": self.steps, "points": self.points, "threads": torch.get_num_threads(), **extra}
        peaks = [s["gpu_peak_mib"] for s in self.steps if "gpu_peak_mib" in s]
        if peaks:
            out["gpu_peak_mib"] = max(peaks)
        elif torch.cuda.is_available() and torch.cuda.is_initialized():
            out["gpu_peak_mib"] = torch.cuda.max_memory_allocated() / 2**20
        return out
