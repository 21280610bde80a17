"""The harness: children (`python -m bench.<side>_side ROLE RESULT SPEC_JSON`) under a time budget, interleaved rounds,
medians over steps 2..N of {"step", "step_s", "<phase>_s", "tokens", "flops", "gpu_peak_mib"}, peaks, report files."""

from __future__ import annotations

import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
PHASES = ("generate", "score", "logprobs", "update")


def say(text: str) -> None:  # a child's progress line: the parent echoes the lines that start with `bench:`
    print(f"bench: {text}", flush=True)


def write_json(path, result) -> None:
    Path(path).write_text(json.dumps(result, indent=1, default=str))


def child_main(roles: dict) -> None:
    role, result, spec = sys.argv[1:4]
    write_json(result, roles[role](json.loads(spec)))


def out_prefix(out: str, name: str) -> Path:
    prefix = Path(out) if out else Path(tempfile.mkdtemp(prefix=f"{name}-")) / name
    (prefix.parent / f"{prefix.name}-logs").mkdir(parents=True, exist_ok=True)
    return prefix


def publish(prefix: Path, text: str, data: dict) -> None:
    print(text)
    prefix.with_suffix(".md").write_text(text + "\n")
    command = [os.path.relpath(sys.argv[0], ROOT) if os.path.isabs(sys.argv[0]) else sys.argv[0], *sys.argv[1:]]
    write_json(prefix.with_suffix(".json"), {**data, "argv": command})  # no absolute path of the machine
    say(f"wrote {prefix.with_suffix('.md')} and {prefix.with_suffix('.json')}")


def table(head: list[str], rows: list[list]) -> str:
    return "\n".join(["| " + " | ".join(head) + " |", "|" + "---|" * len(head),
                      *("| " + " | ".join(str(x) for x in row) + " |" for row in rows)])


class Children:
    """Children one after the other (each one's peak memory its own) under a time budget, logged, `bench:` echoed."""

    def __init__(self, log_dir: Path, budget_s: float = float("inf")):
        self.log_dir, self.start = Path(log_dir), time.monotonic()
        self.deadline, self.failed = self.start + budget_s, 0  # runs that failed, stopped early or were skipped

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def say(self, text: str) -> None:
        print(f"bench [{time.monotonic() - self.start:5.0f}s] {text}", flush=True)

    def skip(self, name: str, why: str) -> None:
        self.say(f"{name}: skipped, {why}")
        self.failed += 1

    def run(self, side: str, role: str, name: str, spec: dict, reserve_s: float = 0.0,
            malloc: bool | None = None) -> dict | None:
        """The child's result ("partial" if it failed after writing one) or None; `malloc`: covey's malloc variables."""
        from covey.runtime.cpu import MALLOC_ENV
        if (timeout := self.left() - reserve_s) < 20:
            return self.skip(name, f"{self.left():.0f} s of the budget left")
        result, log_path = self.log_dir / f"{name}.json", self.log_dir / f"{name}.log"
        result.unlink(missing_ok=True)
        cmd = [sys.executable, "-m", f"bench.{side}_side", role, str(result), json.dumps(spec)]
        env = {k: v for k, v in os.environ.items() if malloc is None or k not in MALLOC_ENV}
        self.say(f"{name}: {' '.join(cmd[1:])}")
        with open(log_path, "w") as log:
            child = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT,
                                     env={**env, **(MALLOC_ENV if malloc else {}), "PYTHONUNBUFFERED": "1"})
            timer = threading.Timer(min(timeout, 7 * 86400), child.kill)
            timer.start()
            for line in child.stdout:
                log.write(line)
                if line.startswith("bench:"):
                    self.say(f"  {name}: {line[7:].rstrip()}")
            code = child.wait()
            timer.cancel()
        if code == 0:
            return json.loads(result.read_text())
        self.failed += 1
        self.say(f"{name}: FAILED (exit {code}{', killed at its time limit' if code == -9 else ''}); log tail:\n"
                 f"{log_path.read_text()[-3000:]}")
        return {**json.loads(result.read_text()), "partial": True} if result.is_file() else None

    def must(self, side: str, role: str, name: str, spec: dict, malloc: bool | None = None) -> dict:
        result = self.run(side, role, name, spec, malloc=malloc)
        if result is None or result.get("partial"):
            raise SystemExit(f"bench: {name} failed, log {self.log_dir / (name + '.log')}")
        return result


def interleaved(names: list[str], rounds: int, run_one) -> dict[str, list]:
    """run_one(name, tag) for every name, `rounds` times in turn (a, b, a, b, ...): drifts slow all alike."""
    by_name: dict[str, list] = {name: [] for name in names}
    for i in range(rounds):
        for name in names:
            by_name[name].append(run_one(name, f"-round{i + 1}" if rounds > 1 else ""))
    return by_name


def medians(steps: list[dict], keys=("step_s", *(f"{p}_s" for p in PHASES))) -> dict:
    return {key: statistics.median(s[key] for s in steps[1:] or steps) for key in keys}


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def summarize(result: dict) -> dict:
    """A CPU run's row: medians over steps 2..N, the fastest step, sampled tokens/s, the update's FLOP rate."""
    steps = result["steps"][1:] or result["steps"]
    seconds = sum(s["step_s"] for s in steps)
    return {"name": result["name"], **medians(result["steps"]), "min_s": min(s["step_s"] for s in steps),
            "steps_timed": len(steps), "tokens_per_s": sum(s["tokens"] for s in steps) / seconds,
            "train_gflops": sum(s["flops"] for s in steps) / max(sum(s["update_s"] for s in steps), 1e-9) / 1e9,
            "peak_rss_mib": result["peak_rss_mib"], "precision": result["precision"]}


def pooled(rounds: list[dict]) -> dict:
    return {**rounds[0], "steps": [rounds[0]["steps"][0], *(step for r in rounds for step in r["steps"][1:])],
            "peak_rss_mib": max(r["peak_rss_mib"] for r in rounds)}


def machine() -> str:
    with open("/proc/cpuinfo") as info:
        model = next((line.split(":", 1)[1].strip() for line in info if line.startswith("model name")), "unknown CPU")
    return f"machine: {model}, {os.cpu_count()} cores, torch {torch.__version__}"


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def best_seconds(fn, repeats: int) -> float:
    fn()  # warm-up
    best = float("inf")
    for _ in range(repeats):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        best = min(best, time.perf_counter() - t0)
    return best


def matmul_peak(dtype: torch.dtype, n_max: int = 2048, repeats: int = 6, budget_s: float = 0.25) -> float:
    """Best GFLOP/s of an n^3 matmul on the CPU, n doubling while under `budget_s` (emulated bf16 shows small)."""
    n = 256
    while True:
        a = torch.randn(n, n, dtype=dtype)
        t0 = time.perf_counter()
        a @ a
        if n >= n_max or time.perf_counter() - t0 > budget_s:
            return 2 * n**3 / best_seconds(lambda: a @ a, repeats) / 1e9
        n *= 2


def measure_device() -> dict:
    """A 2 GiB device-to-device copy (bytes read + written per second), the best of three bf16 matmuls (CPU: small)."""
    gpu = torch.cuda.is_available()
    device, nbytes = ("cuda", 2 * 2**30) if gpu else ("cpu", 64 * 2**20)
    buffers = [torch.empty(nbytes, dtype=torch.uint8, device=device) for _ in range(2)]
    copy_s = best_seconds(lambda: buffers[1].copy_(buffers[0]), 10)
    buffers.clear()
    rates = {}
    for m, n, k in ((8192, 8192, 8192), (16384, 8192, 8192), (8192, 16384, 4096)) if gpu else ((256, 256, 256),):
        a, b = (torch.randn(*shape, dtype=torch.bfloat16, device=device) for shape in ((m, k), (k, n)))
        rates[(m, n, k)] = 2 * m * n * k / best_seconds(lambda: a @ b, 10) / 1e12
    shape = max(rates, key=rates.get)
    return {"name": torch.cuda.get_device_name() if gpu else "cpu", "copy_bytes_per_s": 2 * nbytes / copy_s,
            "matmul_tflops": rates[shape], "matmul_shape": f"(m, n, k) = {shape}", "torch": torch.__version__}


def cap_memory(cap_gib: float) -> float:
    if not torch.cuda.is_available() or cap_gib <= 0:
        return 0.0
    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.set_per_process_memory_fraction(fraction := min(1.0, cap_gib * 2**30 / total), 0)
    return fraction * total / 2**30


class LinearFlops:
    """FLOPs of every nn.Linear forward under autograd (the training passes) x 3 for the backward, by forward hooks."""

    def __init__(self, model: torch.nn.Module):
        self.forward = 0
        for module in model.modules():
            if isinstance(module, torch.nn.Linear):
                module.register_forward_hook(self.count)

    def count(self, module, inputs, output) -> None:
        if torch.is_grad_enabled():
            self.forward += 2 * inputs[0].numel() * module.out_features

    def take(self) -> float:  # training FLOPs since the last call
        flops, self.forward = 3 * self.forward, 0
        return float(flops)
