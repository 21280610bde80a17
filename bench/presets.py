"""Every algorithm preset on the default task and model, one after the other: the preset table of docs/results.md.

    .venv/bin/python bench/presets.py --steps 30 [--presets grpo,ppo,...] [--out runs/presets] [key=value ...]

Each preset runs as its own `covey train <preset> train.steps=N` process (so
its peak RSS is its own); a preset whose run folder already holds a final evaluation is
not run again (an interrupted table continues). Prints and writes `<out>/presets.md`:
held-out accuracy before / after, wall time, peak RSS, and model + optimizer state by role.
Not a test: it takes about an hour on a 2-core CPU.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

from covey.config import preset_names

ROOT = Path(__file__).resolve().parent.parent
PRESETS = ("grpo", "dr_grpo", "rloo", "remax", "reinforce_pp", "reinforce_pp_baseline", "ppo")
ROLES = ("actor", "reference", "critic", "optimizer")


def read_metrics(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def finished(run_dir: Path, steps: int) -> bool:
    metrics = run_dir / "metrics.jsonl"
    return metrics.exists() and any(m.get("step") == steps and "eval/accuracy" in m for m in read_metrics(metrics))


def train_args(preset: str, steps: int, overrides: list[str]) -> list[str]:
    """The `covey train` arguments of one row (what the table prints as its command)."""
    return ["train", preset, f"train.steps={steps}", "train.max_minutes=0", *overrides]


def run_preset(preset: str, steps: int, out: Path, overrides: list[str]) -> float:
    """Train one preset; returns wall seconds (model loading and both evaluations included)."""
    cmd = [sys.executable, "-m", "covey.cli", *train_args(preset, steps, overrides),
           f"train.output_dir={out}", f"train.run_name={preset}", "train.progress=false"]
    print(f"presets: {' '.join(cmd[2:])}", flush=True)
    start = time.perf_counter()
    with open(out / f"{preset}.log", "w") as log:
        done = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
    wall = time.perf_counter() - start
    if done.returncode != 0:
        raise SystemExit(f"presets: {preset} failed (exit {done.returncode}), see {out / (preset + '.log')}")
    (out / preset / "wall_s.txt").write_text(f"{wall:.1f}\n")
    return wall


def summarize(preset: str, run_dir: Path, steps: int, overrides: list[str]) -> dict:
    metrics = read_metrics(run_dir / "metrics.jsonl")
    evals = [m for m in metrics if "eval/accuracy" in m]
    last = [m for m in metrics if "memory/params_mb/actor" in m][-1]
    wall_file = run_dir / "wall_s.txt"
    return {
        "preset": preset,
        "before": evals[0]["eval/accuracy"], "after": evals[-1]["eval/accuracy"], "n": evals[-1]["eval/n"],
        "wall_min": float(wall_file.read_text()) / 60 if wall_file.exists() else float("nan"),
        "step_s": sorted(m["time/step"] for m in metrics if "time/step" in m)[steps // 2],
        "peak_rss_gb": max(m.get("memory/peak_rss_mb", 0) for m in metrics) / 1024,
        "roles_mb": {r: last.get(f"memory/params_mb/{r}", 0.0) for r in ROLES},
        "command": " ".join(["covey", *train_args(preset, steps, overrides)]),
    }


def table(rows: list[dict]) -> str:
    head = ("| preset | held-out before | after | change (points) | wall min | median s/step | peak RSS GB "
            "| actor MB | reference MB | critic MB | optimizer MB | command |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        mb = r["roles_mb"]
        lines.append(
            f"| {r['preset']} | {100 * r['before']:.1f}% | {100 * r['after']:.1f}% | "
            f"{100 * (r['after'] - r['before']):+.1f} | {r['wall_min']:.1f} | {r['step_s']:.1f} | {r['peak_rss_gb']:.2f} | "
            f"{mb['actor']:.0f} | {mb['reference']:.0f} | {mb['critic']:.0f} | {mb['optimizer']:.0f} | `{r['command']}` |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--presets", default=",".join(PRESETS))
    parser.add_argument("--out", default="runs/presets")
    parser.add_argument("overrides", nargs="*", help="key=value applied to every preset")
    args = parser.parse_args(argv)
    out = (ROOT / args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    presets = [p for p in args.presets.split(",") if p]
    unknown = [p for p in presets if p not in preset_names()]
    if unknown:
        parser.error(f"no preset {unknown[0]!r} (presets: {', '.join(preset_names())})")
    rows = []
    for preset in presets:
        if not finished(out / preset, args.steps):
            shutil.rmtree(out / preset, ignore_errors=True)  # an interrupted run starts again, clean
            run_preset(preset, args.steps, out, args.overrides)
        rows.append(summarize(preset, out / preset, args.steps, args.overrides))
        (out / "presets.md").write_text(table(rows) + "\n")
    print(table(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
