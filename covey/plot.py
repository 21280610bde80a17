"""`covey plot RUN_DIR`: PNG curves of the main metrics of a run."""

from __future__ import annotations

from pathlib import Path

from covey.metrics import read_metrics

PANELS = [
    ("reward/mean", "reward (mean)"), ("accuracy", "train accuracy"), ("eval/accuracy", "held-out accuracy"),
    ("kl/ref", "KL to reference"), ("policy/entropy", "entropy (nats/token)"),
    ("policy/clipfrac", "clip fraction"), ("response/len_mean", "response length (tokens)"),
    ("time/step", "seconds per step"),
]


def plot_run(run_dir: str | Path) -> list[Path]:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    run_dir = Path(run_dir)
    rows = read_metrics(run_dir)
    fig, axes = plt.subplots(2, 4, figsize=(16, 7))
    for ax, (key, label) in zip(axes.flat, PANELS):
        points = [(r["step"], r[key]) for r in rows if r.get(key) is not None]
        if points:
            xs, ys = zip(*points)
            ax.plot(xs, ys, marker="o" if len(xs) < 30 else None, color="tab:blue")
        ax.set_title(label)
        ax.set_xlabel("step")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    fig.suptitle(f"covey run: {run_dir.name}")
    fig.tight_layout()
    out = run_dir / "curves.png"
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return [out]
