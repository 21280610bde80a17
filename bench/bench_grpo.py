"""covey vs TRL's GRPOTrainer on one workload, in one run: step time, phases, tokens/s, memory, FLOP rate.

    nice -n 10 .venv/bin/python bench/bench_grpo.py --steps 6 --runs covey,trl,trl-gc

Installs nothing: TRL comes from the `bench` extra (pip install -e '.[bench]'). Every
run is a subprocess of its own (so its peak RSS is its own), one after the other, on
the same model, prompts distribution, G, lengths, beta, lr and precision (bench/common.py).
The machine's matmul peak is measured in the same run, before and after, for fp32 and
bf16; the training phase's FLOP rate is reported against the peak of its precision.
Results: a table on stdout, and JSON + Markdown next to --out.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from common import matmul_peak, summarize  # noqa: E402

from covey.runtime.cpu import MALLOC_ENV  # noqa: E402

RUNS = {  # name -> (child script, its flags, covey key=value overrides, glibc malloc reuse as `covey` sets it)
    "covey": ("run_covey.py", [], [], True),                       # covey's defaults: fast engine, fp32 weights,
                                                                   # bf16 sampling and autocast where bf16 is native
    "covey-fp32": ("run_covey.py", [], ["rollout.precision=float32", "model.autocast=none"], True),  # all fp32
    "covey-fp32-train": ("run_covey.py", [], ["model.autocast=none"], True),  # fp32 passes, bf16 sampling if native
    "covey-plain-malloc": ("run_covey.py", [], [], False),          # without covey/runtime/cpu.py's malloc variables
    "covey-hf": ("run_covey.py", [], ["rollout.engine=hf"], True),  # HF generate instead of the fast engine
    "covey-bf16": ("run_covey.py", [], ["model.autocast=bfloat16"], True),
    "covey-mb16": ("run_covey.py", [], ["algo.micro_batch_size=16"], True),  # fewer, larger passes:
    "covey-mb32": ("run_covey.py", [], ["algo.micro_batch_size=32"], True),  # speed against memory
    "trl": ("run_trl.py", [], [], False),                          # TRL as it ships: 32 samples per forward
    "trl-malloc": ("run_trl.py", [], [], True),                    # TRL given covey's malloc variables too
    "trl-mb8": ("run_trl.py", ["--micro-batch", "8"], [], False),   # covey's micro-batch (less memory)
    "trl-gc": ("run_trl.py", ["--gradient-checkpointing"], [], False),
    "trl-bf16": ("run_trl.py", ["--bf16"], [], False),
}


def run_child(name: str, steps: int, threads: int, log_dir: Path, tag: str = "") -> dict:
    result = log_dir / f"{name}{tag}.json"
    script, flags, overrides, malloc_keep = RUNS[name]
    # the `covey` command restarts itself with these variables (covey/runtime/cpu.py); a child script must get them here
    env = {k: v for k, v in os.environ.items() if k not in MALLOC_ENV}
    if malloc_keep:
        env = {**env, **MALLOC_ENV}
    cmd = [sys.executable, str(HERE / script), "--steps", str(steps), "--threads", str(threads),
           "--result", str(result), *flags, *overrides]
    print(f"bench: {name}: {' '.join(cmd[1:])}", flush=True)
    t0 = time.perf_counter()
    with open(log_dir / f"{name}{tag}.log", "w") as log:
        done = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=HERE.parent, env=env)
    if done.returncode != 0:
        tail = (log_dir / f"{name}{tag}.log").read_text()[-3000:]
        raise SystemExit(f"bench: {name} failed (exit {done.returncode}):\n{tail}")
    data = json.loads(result.read_text())
    data["wall_s"] = time.perf_counter() - t0
    data["name"] = name
    return data


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


def machine() -> str:
    """CPU model, core count and torch build: the numbers below only hold for this machine."""
    model = "unknown CPU"
    try:
        with open("/proc/cpuinfo") as info:
            model = next(line.split(":", 1)[1].strip() for line in info if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return f"machine: {model}, {os.cpu_count()} cores, torch {torch.__version__}"


def peaks(threads: int) -> dict:
    torch.set_num_threads(threads)
    return {"float32": matmul_peak(torch.float32), "bfloat16": matmul_peak(torch.bfloat16)}


def table(rows: list[dict], peak: dict) -> str:
    """One line per run; ratios against `trl` (TRL as it ships) and against TRL's best run."""
    trl = [r for r in rows if r["name"].startswith("trl")]
    base = next((r for r in trl if r["name"] == "trl"), trl[0] if trl else None)
    fastest = min(trl, key=lambda r: r["median_s"]) if trl else None
    leanest = min(trl, key=lambda r: r["peak_rss_mib"]) if trl else None

    def ratio(value: float, ref: dict | None, key: str) -> str:
        return f"{value / ref[key]:.2f}" if ref else "-"

    head = ("| run | precision | median s/step | min s | generate | score | ref logp | update | tokens/s (in generate) "
            "| train GFLOP/s (% of peak) | peak RSS GiB | step / trl | step / fastest TRL | RSS / trl "
            "| RSS / leanest TRL |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        prec = "bfloat16" if r["precision"].startswith("bfloat16") else "float32"
        share = 100 * r["train_gflops"] / peak[prec]
        lines.append(f"| {r['name']} | {r['precision']} | {r['median_s']:.1f} | {r['min_s']:.1f} | "
                     f"{r['generate_s']:.1f} | {r['score_s']:.2f} | {r['logprobs_s']:.1f} | {r['update_s']:.1f} | "
                     f"{r['tokens_per_s']:.0f} ({r['gen_tokens_per_s']:.0f}) | {r['train_gflops']:.0f} ({share:.0f}%) | "
                     f"{r['peak_rss_mib'] / 1024:.2f} | {ratio(r['median_s'], base, 'median_s')} | "
                     f"{ratio(r['median_s'], fastest, 'median_s')} | {ratio(r['peak_rss_mib'], base, 'peak_rss_mib')} | "
                     f"{ratio(r['peak_rss_mib'], leanest, 'peak_rss_mib')} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=6, help="optimizer steps per run; step 1 is not timed")
    parser.add_argument("--runs", default="covey,trl", help=f"comma-separated, from: {', '.join(RUNS)}")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="torch threads of every run")
    parser.add_argument("--out", default="", help="results prefix (default: a temporary folder)")
    parser.add_argument("--rounds", type=int, default=1,
                        help="run the list this many times, interleaved (covey, trl, covey, trl, ...), and pool "
                             "each run's timed steps: a machine whose speed drifts then slows every run alike")
    args = parser.parse_args()
    names = [n.strip() for n in args.runs.split(",") if n.strip()]
    unknown = [n for n in names if n not in RUNS]
    if unknown or args.steps < 2 or args.rounds < 1:
        raise SystemExit(f"bench: unknown runs {unknown}, --steps < 2 or --rounds < 1")
    out = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="bench-")) / "bench"
    out.parent.mkdir(parents=True, exist_ok=True)
    log_dir = out.parent / (out.name + "-logs")
    log_dir.mkdir(exist_ok=True)
    before = peaks(args.threads)
    by_name: dict[str, list[dict]] = {name: [] for name in names}
    for i in range(args.rounds):
        for name in names:
            by_name[name].append(run_child(name, args.steps, args.threads, log_dir,
                                           f"-round{i + 1}" if args.rounds > 1 else ""))
    after = peaks(args.threads)
    peak = {k: max(before[k], after[k]) for k in before}
    results = [pooled(rounds) for rounds in by_name.values()]
    rows = [summarize(r) for r in results]
    pooling = f"; {args.rounds} interleaved rounds pooled" if args.rounds > 1 else ""
    text = (f"{machine()}\nmatmul peak (n^3 with n <= 2048, best of 6, before/after): fp32 {before['float32']:.0f}/{after['float32']:.0f}, "
            f"bf16 {before['bfloat16']:.0f}/{after['bfloat16']:.0f} GFLOP/s; threads={args.threads}; "
            f"medians over steps 2..{args.steps}{pooling}\n\n" + table(rows, peak))
    if args.rounds > 1:
        text += "\n\n" + round_medians(by_name)
    print(text)
    out.with_suffix(".md").write_text(text + "\n")
    out.with_suffix(".json").write_text(json.dumps({"peak_before": before, "peak_after": after, "summary": rows,
                                                    "runs": results, "rounds": by_name, "argv": sys.argv}, indent=1))
    print(f"bench: wrote {out.with_suffix('.md')} and {out.with_suffix('.json')}")


if __name__ == "__main__":
    main()
