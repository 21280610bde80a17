"""`covey plot RUN_DIR [RUN_DIR ...]`: PNG curves of the main metrics of one run, or of several
runs overlaid (for example an iterative-RM run against a fixed-RM run)."""

from __future__ import annotations

import math
from pathlib import Path

from covey.runtime.metrics import read_metrics

PANELS = [
    ("reward/mean", "reward (mean)"), ("accuracy", "train accuracy"), ("eval/accuracy", "held-out accuracy"),
    ("kl/ref", "KL to reference"), ("policy/entropy", "entropy (nats/token)"),
    ("policy/clipfrac", "clip fraction"), ("response/len_mean", "response length (tokens)"),
    ("time/step", "seconds per step"),
]
# Panels drawn only when some run logged them: learned rewards (covey/rm/), tool-calling episodes
# (docs/agents.md) and the sampler-trainer mismatch.
OPTIONAL_PANELS = [
    ("rm/agreement", "RM / verifier agreement"), ("prm/agreement", "PRM / verifier agreement"),
    ("prm/step_accuracy", "PRM step accuracy (exact labels)"), ("steps/score_mean", "mean step reward (PRM or exact)"),
    ("episode/tool_calls_mean", "tool calls per episode"), ("tools/errors", "tool errors per step"),
    ("episode/turns_mean", "model turns per episode"), ("episode/cut_off_frac", "episodes cut off by a budget"),
    ("sampler/log_ratio_max", "largest |log pi_old - log mu| (sampler mismatch)"),
]


def curve(rows: list[dict], key: str) -> list[tuple[int, float]]:
    """(step, value) of every row that logged `key` with a value."""
    return [(r["step"], r[key]) for r in rows if r.get(key) is not None]


def panels_for(runs: dict[str, list[dict]]) -> list[tuple[str, str]]:
    logged = {key for rows in runs.values() for r in rows for key, v in r.items() if v is not None}
    return PANELS + [(key, label) for key, label in OPTIONAL_PANELS if key in logged]


def default_output(run_dirs: list[Path]) -> Path:
    """One run: RUN/curves.png; several: curves_<a>_vs_<b>.png beside the first run folder."""
    if len(run_dirs) == 1:
        return run_dirs[0] / "curves.png"
    return run_dirs[0].parent / ("curves_" + "_vs_".join(d.name for d in run_dirs) + ".png")


def plot_runs(run_dirs: list[str | Path], out: str | Path | None = None) -> Path:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    run_dirs = [Path(d) for d in run_dirs]
    for d in run_dirs:
        if not (d / "metrics.jsonl").is_file():
            raise FileNotFoundError(f"{d}: no metrics.jsonl there (not a covey run folder)")
    if len({d.name for d in run_dirs}) < len(run_dirs):
        raise ValueError("runs are told apart by folder name, and these repeat one: " + ", ".join(map(str, run_dirs)))
    runs = {d.name: read_metrics(d) for d in run_dirs}
    panels = panels_for(runs)
    ncols = 4
    nrows = math.ceil(len(panels) / ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(16, 3.5 * nrows), squeeze=False)
    for ax, (key, label) in zip(axes.flat, panels):
        for colour, (name, rows) in enumerate(runs.items()):
            points = curve(rows, key)
            if points:
                xs, ys = zip(*points)
                ax.plot(xs, ys, marker="o" if len(xs) < 30 else None, color=f"C{colour}", label=name)
        ax.set_title(label)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(panels):]:
        ax.set_visible(False)
    if len(runs) > 1:
        axes.flat[0].legend(fontsize="small")
    fig.suptitle("covey run" + ("s: " if len(runs) > 1 else ": ") + ", ".join(runs))
    fig.tight_layout()
    out = Path(out) if out else default_output(run_dirs)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out
