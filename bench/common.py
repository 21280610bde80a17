"""Shared pieces of the benchmark: the workload, the matmul peak, a FLOP counter, step records.

The workload (the one the speed targets of docs/benchmark.md were set on):
SmolLM2-135M-Instruct, 4 prompts x 8 samples, 64 new tokens, beta 0.04, lr 1e-5,
temperature 1.0 (TRL's default), fp32, one optimizer step per rollout; covey's
micro-batches of 8 (its default).
"""

from __future__ import annotations

import json
import resource
import statistics
import time
from dataclasses import asdict, dataclass, field

import torch

WORKLOAD = {"prompts_per_step": 4, "group_size": 8, "max_new_tokens": 64, "beta": 0.04, "lr": 1e-5,
            "micro_batch": 8, "temperature": 1.0, "train_size": 600, "seed": 0}
PHASES = ("generate", "score", "logprobs", "update")


def matmul_peak(dtype: torch.dtype, n_max: int = 2048, repeats: int = 6, budget_s: float = 0.25) -> float:
    """Best GFLOP/s of an n x n x n matmul (the machine's practical peak for this precision).

    n doubles from 256 up to n_max while one product takes under `budget_s`: on a CPU that
    emulates a precision (bf16 on AVX2-only parts runs at ~1 GFLOP/s) a 2048^3 product would
    take a minute, and the small sizes already show that the precision is no use there.
    """
    n = 256
    while True:
        a = torch.randn(n, n, dtype=dtype)
        t0 = time.perf_counter()
        a @ a
        if n >= n_max or time.perf_counter() - t0 > budget_s:
            break
        n *= 2
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        a @ a
        best = min(best, time.perf_counter() - t0)
    return 2 * n**3 / best / 1e9


class LinearFlops:
    """FLOPs of every nn.Linear forward run with autograd on (the training passes), times 3 for backward.

    A matmul's backward costs twice its forward (input and weight gradients). Attention
    score FLOPs (~4% at these lengths) are not counted, so the rate is a lower bound.
    With gradient checkpointing the recomputed forward is counted too (it is executed).
    """

    def __init__(self, model: torch.nn.Module):
        self.forward = 0
        self.handles = [m.register_forward_hook(self._hook) for m in model.modules()
                        if isinstance(m, torch.nn.Linear)]

    def _hook(self, module, inputs, output):
        if torch.is_grad_enabled():
            rows = inputs[0].numel() // module.in_features
            self.forward += 2 * rows * module.in_features * module.out_features

    def take(self) -> float:
        """Training FLOPs since the last call."""
        flops, self.forward = 3 * self.forward, 0
        return float(flops)


@dataclass
class StepRecord:
    step: int
    seconds: float
    phases: dict = field(default_factory=dict)  # phase -> seconds
    completion_tokens: int = 0
    train_flops: float = 0.0


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def write_result(path: str, name: str, records: list[StepRecord], extra: dict) -> None:
    out = {"name": name, "peak_rss_mib": peak_rss_mib(), "steps": [asdict(r) for r in records], **extra}
    with open(path, "w") as f:
        json.dump(out, f, indent=1)


def summarize(result: dict, skip_first: int = 1) -> dict:
    """Median / min step time over steps 2..N, median phase times, tokens/s, training FLOP rate."""
    steps = result["steps"][skip_first:] or result["steps"]
    seconds = [s["seconds"] for s in steps]
    phases = {p: statistics.median(s["phases"].get(p, 0.0) for s in steps) for p in PHASES}
    tokens = sum(s["completion_tokens"] for s in steps)
    gen_time = sum(s["phases"].get("generate", 0.0) for s in steps)
    update_time = sum(s["phases"].get("update", 0.0) for s in steps)
    flops = sum(s["train_flops"] for s in steps)
    return {"name": result["name"], "median_s": statistics.median(seconds), "min_s": min(seconds),
            "steps_timed": len(steps), **{f"{p}_s": v for p, v in phases.items()},
            "tokens_per_s": tokens / sum(seconds), "gen_tokens_per_s": tokens / max(gen_time, 1e-9),
            "train_gflops": flops / max(update_time, 1e-9) / 1e9, "peak_rss_mib": result["peak_rss_mib"],
            "precision": result.get("precision", "float32")}
