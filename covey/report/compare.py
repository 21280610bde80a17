"""`covey compare`: several algorithms x seeds on one budget, then the report (covey/report/report.py).

The algorithms are packaged presets named like `covey train` names them (grpo, ppo, ...); the
command line of `covey compare` is covey/cli/compare.py.

Layout of runs/compare-<name>/:
  compare.json         what was asked (algos, seeds, budget, overrides, command); a rerun must match it
  <algo>-s<seed>/      an ordinary covey run folder per (algorithm, seed)
  <algo>-s<seed>.log   that run's console output (appended across resumes)
  eval-before.json     the untrained model's held-out evaluation per seed: the first run of a seed
                       evaluates, the other algorithms' runs of that seed read it (train.eval_before_cache)
  report.md, *.png     the report, rebuilt from the run folders alone (--report-only)

Each run is its own `python -m covey.cli train` process, so a crash in one run does not end
the others and peak memory is measured per run. Rerunning the same command continues: a run
whose log has its final evaluation is skipped, one with a checkpoint resumes from it
(train.resume=auto), any other one starts again. A finished run's checkpoints are deleted
(they only serve a resume; the trained model stays in <run>/final/).

Defaults were chosen to finish within about an hour on a 2-core CPU (docs/compare.md).
"""

from __future__ import annotations

import json
import math
import resource
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

from covey.config import ConfigError, load_config, preset_names
from covey.report.data import read_jsonl
from covey.report.report import build_report
from covey.report.spec import Budget, CompareSpec
from covey.training.plan import make_plan

# Applied to every run before the user's key=value overrides: small batches so that
# 4 algorithms x 2 seeds fit in about an hour on 2 CPU cores (docs/compare.md).
COMPARE_DEFAULTS = {
    "rollout.prompts_per_step": 4, "rollout.group_size": 4, "rollout.max_new_tokens": 48,
    "rollout.eval_max_new_tokens": 48, "task.eval_size": 100, "train.eval_every": 4,
    "train.grad_var_every": 2, "train.grad_var_batches": 4, "train.samples_every": 4,
}
EVAL_BEFORE_FILE = "eval-before.json"  # the untrained model's evaluation, once per seed (not per algorithm)
# Set by compare itself for every run; a user override of these keys is refused.
MANAGED_KEYS = ("train.output_dir", "train.run_name", "train.seed", "train.steps", "train.max_minutes",
                "train.resume", "train.save_every", "train.keep_checkpoints", "train.progress",
                "train.eval_before_cache")


def known_preset(algo: str) -> str:
    """`algo` itself when it names a packaged preset (covey.config.preset_names); ConfigError otherwise."""
    if algo not in preset_names():
        raise ConfigError(f"--algos: no preset '{algo}' (known: {', '.join(preset_names())})")
    return algo


def check_overrides(overrides: list[str]) -> None:
    for item in overrides:
        key = item.split("=", 1)[0].strip()
        full = key if "." in key else next((k for k in MANAGED_KEYS if k.endswith("." + key)), key)
        if full in MANAGED_KEYS:
            raise ConfigError(f"compare sets {full} itself (use --budget, --seeds, --name)")


def budget_overrides(budget: Budget, algo: str, user: list[str]) -> list[str]:
    """train.steps / train.max_minutes for one algorithm; samples=N becomes N // (B*G) steps."""
    if budget.kind == "steps":  # no time limit: train.max_minutes' default would cut a slow run short
        return [f"train.steps={int(budget.value)}", "train.max_minutes=0"]
    if budget.kind == "minutes":  # the clock is checkpointed: the budget holds across resumes
        return ["train.steps=1000000", f"train.max_minutes={budget.value:g}"]
    cfg = load_config(known_preset(algo), [*defaults_as_overrides(), *user])
    per_step = make_plan(cfg).sizes.sequences_per_step
    return [f"train.steps={max(int(budget.value) // per_step, 1)}", "train.max_minutes=0"]


def defaults_as_overrides() -> list[str]:
    return [f"{k}={v}" for k, v in COMPARE_DEFAULTS.items()]


def run_dir(spec: CompareSpec, algo: str, seed: int) -> Path:
    return spec.root / f"{algo}-s{seed}"


def run_status(path: Path) -> str:
    """done (final evaluation logged) | resume (a complete checkpoint exists) | fresh."""
    metrics = path / "metrics.jsonl"
    if metrics.is_file() and any(r.get("final") == 1 for r in read_jsonl(metrics)):
        return "done"
    checkpoints = path / "checkpoints"
    if checkpoints.is_dir() and any(p.name.startswith("step-") for p in checkpoints.iterdir()):
        return "resume"
    return "fresh"


def save_every(spec: CompareSpec) -> int:
    """Checkpoint at mid-run (and at the end): a crash loses at most half a run, and each save of
    the policy, optimizer and critic costs seconds and gigabytes."""
    if spec.budget.kind == "minutes":
        return 4
    steps = int(spec.budget.value) if spec.budget.kind == "steps" else 8
    return max(math.ceil(steps / 2), 1)


def children_cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def train_argv(spec: CompareSpec, algo: str, seed: int) -> list[str]:
    """`covey train` arguments of one run: preset, compare defaults, user overrides, managed keys."""
    managed = [f"train.output_dir={spec.root}", f"train.run_name={algo}-s{seed}", f"train.seed={seed}",
               f"train.save_every={save_every(spec)}", "train.keep_checkpoints=1", "train.resume=auto",
               "train.progress=false", f"train.eval_before_cache={spec.root / EVAL_BEFORE_FILE}",
               *budget_overrides(spec.budget, algo, spec.overrides)]
    defaults = defaults_as_overrides()
    if load_config(known_preset(algo)).algo.learner == "dpo":  # no advantages to measure the gradient noise of
        defaults = [d for d in defaults if not d.startswith("train.grad_var_every=")]
    return ["train", algo, *defaults, *spec.overrides, *managed]


def subprocess_runner(argv: list[str], log_path: Path) -> int:
    """Run `covey <argv>` in a fresh Python process, appending its output to log_path."""
    with log_path.open("a") as log:
        log.write(f"\n=== {time.strftime('%Y-%m-%d %H:%M:%S')} covey {shlex.join(argv)}\n")
        log.flush()
        return subprocess.run([sys.executable, "-m", "covey.cli", *argv], stdout=log,
                              stderr=subprocess.STDOUT).returncode


def check_spec_matches(spec: CompareSpec) -> None:
    """A rerun of an existing comparison must ask for the same budget and overrides."""
    path = spec.root / "compare.json"
    if not path.is_file():
        return
    old = json.loads(path.read_text())
    for key in ("budget", "overrides"):
        if old.get(key) != spec.record()[key]:
            raise ConfigError(f"{spec.root} was started with {key}={old.get(key)!r}, not {spec.record()[key]!r}: "
                              f"rerun with the same settings, or choose another --name")


def write_spec(spec: CompareSpec) -> None:
    """compare.json; algorithms and seeds of earlier invocations are kept (the report shows them all)."""
    path = spec.root / "compare.json"
    record = spec.record()
    if path.is_file():
        old = json.loads(path.read_text())
        record["algos"] = list(dict.fromkeys(old.get("algos", []) + spec.algos))
        record["seeds"] = sorted(set(old.get("seeds", [])) | set(spec.seeds))
    path.write_text(json.dumps(record, indent=2) + "\n")


def validate_spec(spec: CompareSpec) -> None:
    """Every run's config loads before any run starts (a typo fails in a second, not after an hour)."""
    check_overrides(spec.overrides)
    for algo in spec.algos:
        make_plan(load_config(known_preset(algo), train_argv(spec, algo, spec.seeds[0])[2:]))


def run_compare(spec: CompareSpec, runner=subprocess_runner, report: bool = True) -> dict:
    """Run (or continue) every algorithm x seed, seed-major so a partial comparison is balanced.

    Returns {"report": path or None, "failed": [run names]}.
    """
    validate_spec(spec)
    spec.root.mkdir(parents=True, exist_ok=True)
    check_spec_matches(spec)
    write_spec(spec)
    jobs = [(algo, seed) for seed in spec.seeds for algo in spec.algos]
    failed = []
    for i, (algo, seed) in enumerate(jobs, 1):
        path = run_dir(spec, algo, seed)
        status = run_status(path)
        label = f"compare: [{i}/{len(jobs)}] {algo} seed {seed}"
        if status == "done":
            print(f"{label}: finished earlier, skipped")
            continue
        print(f"{label}: {'resuming' if status == 'resume' else 'starting'} ({spec.budget})", flush=True)
        if status == "fresh":  # logs of an attempt that left no checkpoint: start them again
            for stale in ("metrics.jsonl", "samples.jsonl"):
                (path / stale).unlink(missing_ok=True)
        t0, cpu0 = time.perf_counter(), children_cpu_seconds()
        code = runner(train_argv(spec, algo, seed), spec.root / f"{algo}-s{seed}.log")
        took = f"{time.perf_counter() - t0:.0f} s (CPU {children_cpu_seconds() - cpu0:.0f} s)"
        if code != 0:
            failed.append(path.name)
            print(f"{label}: FAILED (exit {code}) after {took}; see {spec.root / (path.name + '.log')}")
        else:  # checkpoints only serve a resume; the trained model stays in final/
            shutil.rmtree(path / "checkpoints", ignore_errors=True)
            print(f"{label}: done in {took}", flush=True)
    out = {"report": None, "failed": failed}
    if report:
        out["report"] = build_report(spec.root)
        print(f"compare: report {out['report']}")
    return out
