"""The benchmark harness: trainer runs as subprocesses, interleaved rounds, step summaries, the machine's
peaks, a FLOP counter and result files. Every driver of bench/ runs its trainers through `Children`.

A child is `python -m bench.<module> <role> --result FILE ...` started from the repository root, one at
a time (its peak memory is its own), its output in `<name>.log` and its figures in `<name>.json`.
"""

from __future__ import annotations

import json
import os
import resource
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
PHASES = ("generate", "score", "logprobs", "update")


def say(text: str) -> None:
    """A child's progress line; the parent echoes the lines that start with `bench:`."""
    print(f"bench: {text}", flush=True)


def write_json(path, result: dict) -> None:
    Path(path).write_text(json.dumps(result, indent=1, default=str))


def child_env(malloc: bool | None = None) -> dict:
    """A child's environment, output unbuffered: covey's glibc malloc variables added (True), removed
    (False) or as they are (None). The `covey` command restarts itself with them (covey/runtime/cpu.py);
    a child started here gets them from its parent or not at all."""
    from covey.runtime.cpu import MALLOC_ENV
    env = {k: v for k, v in os.environ.items() if malloc is None or k not in MALLOC_ENV}
    if malloc:
        env.update(MALLOC_ENV)
    return {**env, "PYTHONUNBUFFERED": "1"}


class Children:
    """Runs children one after the other under one time budget, echoing their `bench:` lines."""

    def __init__(self, log_dir: Path, budget_s: float = float("inf")):
        self.log_dir, self.start = Path(log_dir), time.monotonic()
        self.deadline = self.start + budget_s
        self.failed = 0  # runs that failed, stopped early or were skipped

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def say(self, text: str) -> None:
        print(f"bench [{time.monotonic() - self.start:5.0f}s] {text}", flush=True)

    def run(self, module: str, role: str, name: str, args: list[str], reserve_s: float = 0.0,
            malloc: bool | None = None) -> dict | None:
        """The child's JSON result ("partial": True if it failed after writing one), or None (failed, or no
        time left: `reserve_s` of the budget is kept for later runs)."""
        timeout = self.left() - reserve_s
        if timeout < 20:
            self.say(f"{name}: skipped, {self.left():.0f} s of the budget left")
            return None
        result, log = self.log_dir / f"{name}.json", self.log_dir / f"{name}.log"
        result.unlink(missing_ok=True)
        cmd = [sys.executable, "-m", f"bench.{module}", role, "--result", str(result), *args]
        self.say(f"{name}: {' '.join(cmd[1:])}")
        t0 = time.perf_counter()
        code = self.stream(cmd, log, name, None if timeout == float("inf") else timeout, child_env(malloc))
        if code != 0:
            killed = ", killed at its time limit" if code == -9 else ""
            self.say(f"{name}: FAILED (exit {code}{killed}); log tail:\n{log.read_text()[-3000:]}")
            return {**json.loads(result.read_text()), "partial": True} if result.is_file() else None
        return {**json.loads(result.read_text()), "wall_s": time.perf_counter() - t0}

    def stream(self, cmd: list[str], log_path: Path, name: str, timeout: float | None, env: dict) -> int:
        with open(log_path, "w") as log:
            child = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT,
                                     env=env)
            timer = threading.Timer(timeout, child.kill) if timeout is not None else None
            if timer is not None:
                timer.start()
            for line in child.stdout:
                log.write(line)
                if line.startswith("bench:"):
                    self.say(f"  {name}: {line[7:].rstrip()}")
            code = child.wait()
            if timer is not None:
                timer.cancel()
        return code

    def must(self, module: str, role: str, name: str, args: list[str], malloc: bool | None = None) -> dict:
        """run(), stopping the driver when the child fails."""
        result = self.run(module, role, name, args, malloc=malloc)
        if result is None or result.get("partial"):
            raise SystemExit(f"bench: {name} failed, log {self.log_dir / (name + '.log')}")
        return result


def interleaved(names: list[str], rounds: int, run_one) -> dict[str, list[dict]]:
    """run_one(name, tag) for every name, `rounds` times in turn (a, b, a, b, ...): a machine whose speed
    drifts slows every run alike. name -> its rounds' results."""
    by_name: dict[str, list[dict]] = {name: [] for name in names}
    for i in range(rounds):
        for name in names:
            by_name[name].append(run_one(name, f"-round{i + 1}" if rounds > 1 else ""))
    return by_name


# --------------------------------------------------------------------------- step records and summaries


@dataclass
class StepRecord:
    step: int
    seconds: float
    phases: dict = field(default_factory=dict)  # phase -> seconds
    completion_tokens: int = 0
    train_flops: float = 0.0


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def step_result(name: str, records: list[StepRecord], **extra) -> dict:
    """A speed child's result: its steps and this process's peak RSS."""
    return {"name": name, "peak_rss_mib": peak_rss_mib(), "steps": [asdict(r) for r in records], **extra}


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


def pooled(rounds: list[dict]) -> dict:
    """One run's rounds as one result: the timed steps (2..N) of every round, the highest peak RSS."""
    steps = [step for r in rounds for step in r["steps"][1:]]
    return {**rounds[0], "steps": [rounds[0]["steps"][0], *steps],
            "peak_rss_mib": max(r["peak_rss_mib"] for r in rounds)}


def round_medians(results: dict[str, list[dict]]) -> str:
    """Each round's own median s/step per run, to show how far the machine drifted between rounds."""
    parts = [f"{name} " + " / ".join(f"{summarize(r)['median_s']:.1f}" for r in rounds)
             for name, rounds in results.items()]
    return "median s/step of each round: " + "; ".join(parts)


# --------------------------------------------------------------------------- the machine


def machine() -> str:
    """CPU model, core count and torch build: the numbers of a run only hold for this machine."""
    model = "unknown CPU"
    try:
        with open("/proc/cpuinfo") as info:
            model = next(line.split(":", 1)[1].strip() for line in info if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return f"machine: {model}, {os.cpu_count()} cores, torch {torch.__version__}"


def matmul_peak(dtype: torch.dtype, n_max: int = 2048, repeats: int = 6, budget_s: float = 0.25) -> float:
    """Best GFLOP/s of an n x n x n matmul on the CPU (the machine's practical peak for this precision).

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


def peaks(threads: int, n_max: int = 2048) -> dict:
    torch.set_num_threads(threads)
    return {"float32": matmul_peak(torch.float32, n_max), "bfloat16": matmul_peak(torch.bfloat16, n_max)}


def device_name() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def best_seconds(fn, repeats: int) -> float:
    """Best wall time of fn() (CUDA events on a GPU)."""
    fn()
    best = float("inf")
    for _ in range(repeats):
        if torch.cuda.is_available():
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            best = min(best, start.elapsed_time(end) / 1000)
        else:
            t0 = time.perf_counter()
            fn()
            best = min(best, time.perf_counter() - t0)
    return best


def measure_device() -> dict:
    """A device-to-device copy of >= 1 GiB (bytes read + written per second) and the best of a few large
    bf16 matmuls (2 m n k FLOPs each); small sizes on a CPU."""
    gpu, device = torch.cuda.is_available(), device_name()
    nbytes = 2 * 2**30 if gpu else 64 * 2**20
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    copy_s = best_seconds(lambda: dst.copy_(src), 10)
    src = dst = None  # freed before the matmuls
    shapes = ((8192, 8192, 8192), (16384, 8192, 8192), (8192, 16384, 4096)) if gpu else ((256, 256, 256),)
    best, best_shape = 0.0, None
    for m, n, k in shapes:
        a = torch.randn(m, k, dtype=torch.bfloat16, device=device)
        b = torch.randn(k, n, dtype=torch.bfloat16, device=device)
        rate = 2 * m * n * k / best_seconds(lambda: a @ b, 10) / 1e12
        if rate > best:
            best, best_shape = rate, (m, n, k)
        a = b = None
    return {"name": torch.cuda.get_device_name() if gpu else "cpu", "copy_bytes_per_s": 2 * nbytes / copy_s,
            "copy_bytes": nbytes, "matmul_tflops": best, "matmul_shape": f"(m, n, k) = {best_shape}",
            "torch": torch.__version__}


def peak_gpu_bytes() -> int | None:
    return torch.cuda.max_memory_allocated() if torch.cuda.is_available() else None


class LinearFlops:
    """FLOPs of every nn.Linear forward run with autograd on (the training passes), times 3 for backward:
    forward hooks on the model's linear layers (a covey run's `session.run.policy`, TRL's model).

    A matmul's backward costs twice its forward (input and weight gradients). Attention
    score FLOPs (~4% at these lengths) are not counted, so the rate is a lower bound.
    With gradient checkpointing the recomputed forward is counted too (it is executed).
    """

    def __init__(self, model: torch.nn.Module):
        self.forward = 0
        self.handles = [m.register_forward_hook(self.count) for m in model.modules()
                        if isinstance(m, torch.nn.Linear)]

    def count(self, module, inputs, output) -> None:
        if torch.is_grad_enabled():
            rows = inputs[0].numel() // module.in_features
            self.forward += 2 * rows * module.in_features * module.out_features

    def take(self) -> float:
        """Training FLOPs since the last call."""
        flops, self.forward = 3 * self.forward, 0
        return float(flops)

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
