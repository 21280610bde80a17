"""covey vs TRL's GRPOTrainer on one GPU: step time by phase, peak GPU memory, decode step against its
memory-bandwidth floor, update FLOP rate against the GPU's bf16 matmul peak.

    python bench/gpu_bench.py --out LOGS/bench --decode-modes graphs,compile   # a GPU: ~6 min on an H100
    python bench/gpu_bench.py --smoke --out /tmp/bench    # on a CPU: tiny shapes, the whole pipeline, TRL included

The workload (bench/gpu_roles.py, WORKLOADS): randomly initialised Qwen2 models with the dimensions of
Qwen2.5-0.5B and Qwen2.5-1.5B (grouped-query attention; the vocabulary is SmolLM2's tokenizer's, 49152
entries instead of Qwen's 151936, so the sampled ids decode), saved once in bf16 and loaded by each
trainer its own way; covey's arithmetic prompts in SmolLM2's chat format; 8 prompts x 8 samples; 256
new tokens at fixed length (covey: no end-of-sequence token; TRL: min_new_tokens = 256); beta 0.04;
lr 1e-6; temperature 1; one optimizer step per rollout, micro-batches of 8 (covey's update: at least 8, grown to
fill algo.update_memory_share of the free memory, its default; each step's size is in covey's result); the same
deterministic reward function (it varies between samples, so every step updates).

covey runs as `covey train grpo` would on a GPU (its defaults: fp32 weights and AdamW, bf16 autocast,
bf16 sampling copy, rollout.decode=auto = CUDA graphs); TRL 1.16's GRPOTrainer with its default model
load (fp32 weights), bf16 autocast, HF `generate` (no vLLM), and covey's settings mapped by
bench/trl_map.py as in the CPU benchmark (gradient checkpointing off like covey's; --trl-gc: on,
TRL's own default).
Every run is a subprocess of its own (its peak GPU memory is its own), covey and TRL alternating per
model size; medians over steps 2..N. The copy bandwidth and the matmul peak are measured in the same
run. Then, while the budget lasts, `--decode-modes` times rollout.decode modes on each model's bf16
weights alone (graphs against compile: which is faster). Results: a table on stdout, `<out>.md` and
`<out>.json`; each child's log and result in `<out>-logs/`; the model folders in `--work`.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
from gpu_roles import SHAPES, WORKLOADS, ROLES, update_flops  # noqa: E402

TARGETS = {  # what the GPU run is judged against (ratios; see docs/benchmark.md)
    "step_vs_trl": {"0.5b": 0.15, "1.5b": 0.25},
    "decode_vs_floor": {"0.5b": 3.0, "1.5b": 2.0},
    "update_share_of_peak": {"1.5b": 0.35},
    "memory_vs_trl": 0.7,
}


def varied_reward(prompts, completions, **_):
    """The benchmark's reward (both trainers): a deterministic score that differs between samples.
    TRL hands conversational completions as [{"role": "assistant", "content": text}]."""
    texts = [c if isinstance(c, str) else c[-1]["content"] for c in completions]
    return [(sum(map(ord, t)) % 7) / 6 for t in texts]


class Children:
    """Runs `gpu_roles.py` subprocesses under one time budget, echoing their `bench:` lines."""

    def __init__(self, log_dir: Path, budget_s: float):
        self.log_dir, self.deadline, self.start = log_dir, time.monotonic() + budget_s, time.monotonic()
        self.failed = 0  # trainer runs that failed, stopped early or were skipped

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def say(self, text: str) -> None:
        print(f"bench [{time.monotonic() - self.start:5.0f}s] {text}", flush=True)

    def run(self, role: str, name: str, args: list[str], reserve_s: float = 0.0) -> dict | None:
        """The child's JSON result, or None (failed, or no time left: `reserve_s` is kept for later runs)."""
        timeout = self.left() - reserve_s
        if timeout < 20:
            self.say(f"{name}: skipped, {self.left():.0f} s of the budget left")
            return None
        result = self.log_dir / f"{name}.json"
        cmd = [sys.executable, str(HERE / "gpu_roles.py"), role, "--result", str(result), *args]
        self.say(f"{name}: {' '.join(cmd[2:])}")
        with open(self.log_dir / f"{name}.log", "w") as log:
            child = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT,
                                     env=child_env())
            timer = threading.Timer(timeout, child.kill)
            timer.start()
            for line in child.stdout:
                log.write(line)
                if line.startswith("bench:"):
                    self.say(f"  {name}: {line[7:].rstrip()}")
            code = child.wait()
            timer.cancel()
        if code != 0:
            tail = (self.log_dir / f"{name}.log").read_text()[-1500:]
            self.say(f"{name}: FAILED (exit {code}{', killed at its time limit' if code == -9 else ''}); "
                     f"log tail:\n{tail}")
            if not result.is_file():
                return None
            return {**json.loads(result.read_text()), "partial": True}  # what a child saved before it stopped
        return json.loads(result.read_text())


def child_env() -> dict:
    """The checkout's covey first on the path (not another installed copy), output unbuffered."""
    path = os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])
    return {**os.environ, "PYTHONPATH": path, "PYTHONUNBUFFERED": "1"}


def step_summary(steps: list[dict]) -> dict:
    """Medians over steps 2..N of the step and its phases."""
    timed = steps[1:] or steps
    return {key: statistics.median(s[key] for s in timed) for key in ("step_s", "generate_s", "reference_s",
                                                                      "update_s", "score_s")}


def summarize(size: str, device: dict, shape: dict, results: dict, workload: dict) -> dict:
    """One model size's row: each trainer's medians and rates (`results`: name -> child result or None),
    covey against TRL, covey's decode step against its floor."""
    flops = update_flops(shape, workload, shape["prompt_tokens_mean"])
    out = {"size": size, "update_model_flops": flops, "trainers": list(results)}
    covey, trl = results.get("covey"), results.get("trl")
    for name, res in results.items():
        if res is None:
            continue
        med = step_summary(res["steps"])
        med["peak_gpu_gib"] = res["peak_gpu_bytes"] / 2**30 if res.get("peak_gpu_bytes") else None
        med["generate_ms_per_token"] = 1000 * med["generate_s"] / workload["new_tokens"]
        med["update_tflops"] = flops / med["update_s"] / 1e12
        med["update_share_of_peak"] = med["update_tflops"] / device["matmul_tflops"] if device else None
        out[name] = {**med, "detail": {k: v for k, v in res.items() if k != "steps"}}
    if covey and trl:
        out["step_vs_trl"] = out["covey"]["step_s"] / out["trl"]["step_s"]
        if out["covey"]["peak_gpu_gib"] and out["trl"]["peak_gpu_gib"]:
            out["memory_vs_trl"] = out["covey"]["peak_gpu_gib"] / out["trl"]["peak_gpu_gib"]
    if covey and covey.get("decode"):
        floor_ms = 1000 * covey["decode"]["floor_bytes_per_step"] / device["copy_bytes_per_s"]
        out["decode_floor_ms"] = floor_ms
        out["decode_loop_ms"] = covey["decode"]["loop_ms_median"]
        out["decode_vs_floor"] = out["decode_loop_ms"] / floor_ms
    return out


def verdicts(row: dict) -> list[str]:
    """One line per target that applies to this size: measured, target, met or not."""
    size, lines = row["size"], []
    for key, goal in TARGETS.items():
        goal = goal.get(size) if isinstance(goal, dict) else goal
        if goal is None or key not in row and key != "update_share_of_peak":
            continue
        value = row.get("covey", {}).get(key) if key == "update_share_of_peak" else row.get(key)
        if value is None:
            continue
        met = value >= goal if key == "update_share_of_peak" else value <= goal
        lines.append(f"{size} {key}: {value:.3f} (target {'>=' if key == 'update_share_of_peak' else '<='} "
                     f"{goal}) {'met' if met else 'NOT MET'}")
    return lines


def table(rows: list[dict], device: dict) -> str:
    head = ("| shape | trainer | median s/step | generate s | reference s | update s | peak GPU GiB "
            "| generate ms/token | update TFLOP/s (% of bf16 peak) |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for row in rows:
        for name in row["trainers"]:
            r = row.get(name)
            if r is None:
                lines.append(f"| {row['size']} | {name} | failed or skipped | | | | | | |")
                continue
            peak = f"{r['peak_gpu_gib']:.2f}" if r["peak_gpu_gib"] is not None else "-"
            share = f" ({100 * r['update_share_of_peak']:.0f}%)" if r["update_share_of_peak"] is not None else ""
            lines.append(f"| {row['size']} | {name} | {r['step_s']:.2f} | {r['generate_s']:.2f} | "
                         f"{r['reference_s']:.2f} | {r['update_s']:.2f} | {peak} | {r['generate_ms_per_token']:.2f} | "
                         f"{r['update_tflops']:.1f}{share} |")
    return "\n".join(lines)


def decode_lines(rows: list[dict]) -> list[str]:
    lines = []
    for row in rows:
        dec = row.get("covey", {}).get("detail", {}).get("decode")
        if not dec:
            continue
        lines.append(f"{row['size']} covey decode at {dec['rows']} rows: {row['decode_loop_ms']:.3f} ms/step in the "
                     f"loop (graph replay with sampling, host checks), floor {row['decode_floor_ms']:.3f} ms "
                     f"({dec['floor_bytes_per_step'] / 1e9:.3f} GB read per step) -> {row['decode_vs_floor']:.2f} x")
        for length, ms in sorted(dec.get("replay_ms", {}).items(), key=lambda kv: int(kv[0])):
            lines.append(f"  replays back to back, {length} columns attended: {ms:.3f} ms")
    for row in rows:
        for mode, res in row.get("decode_modes", {}).items():
            lines.append(f"{row['size']} rollout.decode={mode} (bf16 weights alone): {res}")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--smoke", action="store_true", help="tiny shapes and few tokens: runs on a CPU")
    parser.add_argument("--sizes", default="", help="comma-separated from " + ", ".join(SHAPES))
    parser.add_argument("--steps", type=int, default=0, help="optimizer steps per run (medians of 2..N)")
    parser.add_argument("--runs", default="covey,trl", help="covey, trl or both")
    parser.add_argument("--decode-modes", default="", help="rollout.decode modes timed on each model's bf16 weights "
                                                          "after the GRPO runs, while the budget lasts (e.g. graphs,compile)")
    parser.add_argument("--covey-keys", default="", help="extra covey key=value settings of the covey runs, "
                                                        "space-separated (e.g. 'algo.micro_batch_size=16')")
    parser.add_argument("--covey-variant", default="", help="one more covey run per size with these key=value "
                                                           "settings, reported as covey-variant (e.g. "
                                                           "'algo.micro_batch_size=32')")
    parser.add_argument("--profile", action="store_true", help="covey: one more step with its update phase "
                                                              "under torch.profiler, the top ops in covey-<size>.log")
    parser.add_argument("--trl-gc", action="store_true", help="TRL with gradient checkpointing, its own default "
                                                              "(default: covey's setting, off, as bench_grpo.py's trl)")
    parser.add_argument("--work", default="", help="folder for the model folders (default: a temporary one)")
    parser.add_argument("--tokenizer", default="", help="folder with SmolLM2's tokenizer files "
                                                        "(default: covey's model cache)")
    parser.add_argument("--budget-s", type=float, default=440.0, help="stop starting runs after this long")
    parser.add_argument("--out", default="", help="results prefix (default: a temporary folder)")
    args = parser.parse_args()
    workload = WORKLOADS["smoke" if args.smoke else "gpu"]
    sizes = [s for s in (args.sizes or ("smoke" if args.smoke else "0.5b,1.5b")).split(",") if s]
    steps = args.steps or workload["steps"]
    out = Path(args.out) if args.out else Path(os.environ.get("TMPDIR", "/tmp")) / f"gpu-bench-{os.getpid()}" / "bench"
    log_dir = out.parent / (out.name + "-logs")
    log_dir.mkdir(parents=True, exist_ok=True)
    children = Children(log_dir, args.budget_s)
    work = Path(args.work or tempfile.mkdtemp(prefix="gpu-bench-models-"))
    common = ["--workload", "smoke" if args.smoke else "gpu"] + (["--tokenizer", args.tokenizer] if args.tokenizer else [])
    device = children.run("device", "device", common) or {}
    if device:
        children.say(f"device: {device['name']}; copy {device['copy_bytes_per_s'] / 1e12:.2f} TB/s (read + written), "
                     f"bf16 matmul peak {device['matmul_tflops']:.1f} TFLOP/s {device['matmul_shape']}")
    rows, runs = [], [r for r in args.runs.split(",") if r]
    for i, size in enumerate(sizes):
        model_dir = work / f"model-{size}"
        shape = children.run("build", f"build-{size}", [*common, "--size", size, "--model", str(model_dir)])
        if shape is None:
            continue
        children.say(f"{size}: {shape['describe']}")
        results = {}
        for name in runs + (["covey-variant"] if args.covey_variant else []):
            later = ((len(sizes) - i - 1) * (150 + 45 * bool(args.covey_variant))
                     + (60 if name == "covey" and "trl" in runs else 0))
            keys = ["--keys", args.covey_keys] if name == "covey" and args.covey_keys else []
            keys += ["--keys", args.covey_variant] if name == "covey-variant" else []
            keys += ["--trl-gc"] if name == "trl" and args.trl_gc else []
            keys += ["--profile"] if name == "covey" and args.profile else []
            results[name] = children.run(name.split("-")[0], f"{name}-{size}", [*common, "--model", str(model_dir),
                                                                                "--steps", str(steps), *keys],
                                         reserve_s=later)
            children.failed += results[name] is None or bool(results[name].get("partial"))
        rows.append(summarize(size, device, shape, results, workload))
        rows[-1].update(shape=shape, model_dir=str(model_dir))
    for row in rows if args.decode_modes else []:  # after every GRPO run: what the budget has left
        modes = children.run("decode", f"decode-{row['size']}", [*common, "--model", row["model_dir"],
                                                                  "--decode-modes", args.decode_modes])
        row["decode_modes"] = (modes or {}).get("modes", {})
    text = "\n".join([f"device: {device.get('name', 'unknown')}; copy bandwidth "
                      f"{device.get('copy_bytes_per_s', 0) / 1e12:.2f} TB/s; bf16 matmul peak "
                      f"{device.get('matmul_tflops', 0):.1f} TFLOP/s; medians of steps 2..{steps}",
                      "workload: " + json.dumps({k: v for k, v in workload.items() if k != "steps"}),
                      *[f"{r['size']}: {r['shape']['describe']}" for r in rows], "",
                      table(rows, device), "", *decode_lines(rows), "",
                      *[line for r in rows for line in verdicts(r)]])
    print(text)
    out.with_suffix(".md").write_text(text + "\n")
    out.with_suffix(".json").write_text(json.dumps({"device": device, "workload": workload, "rows": rows,
                                                    "argv": sys.argv, "roles": ROLES}, indent=1, default=str))
    children.say(f"wrote {out.with_suffix('.md')} and {out.with_suffix('.json')}")
    if children.failed:
        children.say(f"{children.failed} trainer run(s) failed, stopped early or were skipped")
        sys.exit(1)


if __name__ == "__main__":
    main()
