"""Reading a compare folder back: per-run summaries, per-algorithm statistics, step series.

Everything the report shows is computed here from the run folders alone
(`<algo>-s<seed>/metrics.jsonl` and `config.yaml`), so `covey compare --report-only`
rebuilds the same report from disk.
"""

from __future__ import annotations

import json
import math
import re
import statistics
from dataclasses import dataclass, field
from pathlib import Path

import yaml

RUN_FOLDER = re.compile(r"^(?P<algo>[a-z_0-9]+)-s(?P<seed>\d+)$")
PHASES = ("time/generate", "time/score", "time/logprobs", "time/update")
ROLES = ("actor", "reference", "critic", "reward_model", "optimizer")


@dataclass
class RunData:
    """One run folder: its metric rows split into the step-0 eval, training steps and the final eval."""
    algo: str
    seed: int
    path: Path
    rows: list[dict]
    config: dict = field(default_factory=dict)

    @property
    def steps(self) -> list[dict]:
        return [r for r in self.rows if "reward/mean" in r]

    @property
    def finished(self) -> bool:
        return any(r.get("final") == 1 for r in self.rows)

    def series(self, key: str) -> list[tuple[int, float]]:
        """(step, value) of every training-step row that has `key` (nulls skipped)."""
        return [(r["step"], float(r[key])) for r in self.steps if r.get(key) is not None]

    def eval_points(self) -> list[tuple[int, float, float]]:
        """(step, training minutes so far, held-out accuracy) of every evaluation, step 0 included."""
        minutes, elapsed, out = {}, 0.0, []
        for r in self.steps:
            elapsed += float(r.get("time/step") or 0.0)
            minutes[r["step"]] = elapsed / 60
        for r in self.rows:
            if r.get("eval/accuracy") is not None:
                point = (r["step"], minutes.get(r["step"], 0.0), float(r["eval/accuracy"]))
                if not out or out[-1][0] != point[0]:
                    out.append(point)
        return out


def read_jsonl(path: Path) -> list[dict]:
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue  # a line cut by a crash; the run is then unfinished and will be resumed
    return rows


def load_runs(root: Path, algos: list[str] | None = None) -> list[RunData]:
    """Every `<algo>-s<seed>` folder with a metrics file, in the order of `algos` then seed."""
    runs = []
    if not Path(root).is_dir():
        return runs
    for path in sorted(Path(root).iterdir()):
        match = RUN_FOLDER.match(path.name)
        if not (path.is_dir() and match and (path / "metrics.jsonl").is_file()):
            continue
        config_path = path / "config.yaml"
        config = yaml.safe_load(config_path.read_text()) if config_path.is_file() else {}
        runs.append(RunData(match["algo"], int(match["seed"]), path, read_jsonl(path / "metrics.jsonl"), config))
    order = {a: i for i, a in enumerate(algos or [])}
    return sorted(runs, key=lambda r: (order.get(r.algo, len(order)), r.algo, r.seed))


def mean_of(values: list[float]) -> float:
    values = [v for v in values if v is not None and math.isfinite(v)]
    return statistics.fmean(values) if values else float("nan")


def last_value(run: RunData, key: str) -> float:
    points = run.series(key)
    return points[-1][1] if points else float("nan")


def abs_changes(run: RunData, key: str) -> list[float]:
    """|x_t - x_{t-1}| between consecutive training steps: the step-to-step fluctuation."""
    values = [v for _, v in run.series(key)]
    return [abs(b - a) for a, b in zip(values, values[1:])]


def run_summary(run: RunData) -> dict:
    """The per-run numbers of the summary table and the claims (NaN where not measured)."""
    evals = run.eval_points()
    before = evals[0][2] if evals and evals[0][0] == 0 else float("nan")
    final = [r for r in run.rows if r.get("final") == 1 and r.get("eval/accuracy") is not None]
    after = float(final[-1]["eval/accuracy"]) if final else float("nan")
    roles = {role: last_value(run, f"memory/params_mb/{role}") for role in ROLES}
    out = {
        "steps": float(max((r["step"] for r in run.steps), default=0)),
        "acc_before": before, "acc_after": after, "acc_gain": after - before,
        "train_minutes": sum(float(r.get("time/step") or 0.0) for r in run.steps) / 60,
        "sec_per_step": mean_of([v for _, v in run.series("time/step")]),
        "reward_mean": mean_of([v for _, v in run.series("reward/mean")]),
        "reward_abs_change": mean_of(abs_changes(run, "reward/mean")),
        "kl_final": last_value(run, "kl/ref"),
        "entropy_mean": mean_of([v for _, v in run.series("policy/entropy")]),
        "len_mean": mean_of([v for _, v in run.series("response/len_mean")]),
        "clipfrac_mean": mean_of([v for _, v in run.series("policy/clipfrac")]),
        "adv_var_mean": mean_of([v * v for _, v in run.series("advantages/std")]),
        "grad_noise_frac": mean_of([v for _, v in run.series("policy/grad_noise_frac")]),
        "grad_var": mean_of([v for _, v in run.series("policy/grad_var")]),
        "peak_rss_mb": max((v for _, v in run.series("memory/peak_rss_mb")), default=float("nan")),
        "model_state_mb": sum(v for v in roles.values() if math.isfinite(v)),
        "params_mb": sum(v for k, v in roles.items() if k != "optimizer" and math.isfinite(v)),
    }
    out.update({f"mb/{role}": v for role, v in roles.items()})
    out.update({f"phase/{p.split('/')[1]}": mean_of([v for _, v in run.series(p)]) for p in PHASES})
    return out


@dataclass
class Stat:
    """Mean, sample standard deviation and count of the finite values of one quantity."""
    values: list[float]

    @property
    def finite(self) -> list[float]:
        return [v for v in self.values if v is not None and math.isfinite(v)]

    @property
    def n(self) -> int:
        return len(self.finite)

    @property
    def mean(self) -> float:
        return statistics.fmean(self.finite) if self.finite else float("nan")

    @property
    def sd(self) -> float:
        return statistics.stdev(self.finite) if self.n >= 2 else float("nan")


@dataclass
class AlgoData:
    """All runs of one algorithm and the units each claim is tested on."""
    algo: str
    runs: list[RunData]

    @property
    def summaries(self) -> list[dict]:
        return [run_summary(r) for r in self.runs]

    def per_seed(self, key: str) -> Stat:
        return Stat([s[key] for s in self.summaries])

    def pooled(self, key: str) -> Stat:
        """Every step's value of metric `key` over all seeds (units for per-step quantities)."""
        return Stat([v for r in self.runs for _, v in r.series(key)])

    def pooled_changes(self, key: str) -> Stat:
        return Stat([v for r in self.runs for v in abs_changes(r, key)])


def group_by_algo(runs: list[RunData]) -> dict[str, AlgoData]:
    out: dict[str, AlgoData] = {}
    for run in runs:
        out.setdefault(run.algo, AlgoData(run.algo, [])).runs.append(run)
    return out


def aligned_series(runs: list[RunData], key: str) -> tuple[list[int], list[float], list[float], list[float]]:
    """Steps present in every run, and the mean, min and max of `key` over the runs at each."""
    per_run = [dict(r.series(key)) for r in runs]
    per_run = [p for p in per_run if p]
    if not per_run:
        return [], [], [], []
    steps = sorted(set.intersection(*(set(p) for p in per_run)))
    values = [[p[s] for p in per_run] for s in steps]
    return steps, [statistics.fmean(v) for v in values], [min(v) for v in values], [max(v) for v in values]
