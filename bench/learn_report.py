"""Reading the learning comparison back (bench/learn_vs_trl.py): the two views, the verdicts, the table, the figure.

A run is a dict {"trainer", "seed", "points": [{"step", "samples", "minutes", "tags", "accuracy", "n"}]}
whose first point is the untrained model (step 0, tags ["base"]). The per-sample view reads each run
at the point tagged "steps" (step == --steps); the wall-clock view at the point tagged "minutes"
(the first step boundary past --minutes of training time).

Spread verdict: with a handful of seeds per trainer, "within the seeds' spread of each other" means
that the ranges [min, max] over the seeds of the two trainers overlap; otherwise one trainer is
higher in every seed. Each seed draws its own train and held-out problems (`load_task_data(task,
seed)`), which both trainers of that seed share, so the per-seed differences are printed too. The binomial standard error of one measurement, sqrt(p (1 - p) / n), is
printed beside it: two seeds on 200 problems cannot separate a few points.
"""

from __future__ import annotations

import math
from pathlib import Path

TRAINERS = ("covey", "trl")
VIEWS = {"steps": "per-sample view", "minutes": "wall-clock view"}


def point_at(run: dict, tag: str) -> dict | None:
    """The run's first evaluation point carrying `tag`."""
    return next((p for p in run["points"] if tag in p["tags"]), None)


def view(runs: list[dict], trainer: str, tag: str) -> dict | None:
    """One trainer's accuracy at `tag` over its seeds: per seed, mean, range, and where each seed was."""
    at = {r["seed"]: point_at(r, tag) for r in runs if r["trainer"] == trainer}
    at = {seed: p for seed, p in at.items() if p is not None}
    if not at:
        return None
    accs = [p["accuracy"] for p in at.values()]
    return {"seeds": {s: p["accuracy"] for s, p in at.items()}, "mean": sum(accs) / len(accs),
            "low": min(accs), "high": max(accs), "step": {s: p["step"] for s, p in at.items()},
            "minutes": {s: p["minutes"] for s, p in at.items()}, "n": min(p["n"] for p in at.values())}


def spread_verdict(a: dict, b: dict, names: tuple[str, str] = TRAINERS) -> dict:
    """Do the seed ranges of views `a` and `b` overlap, and whose mean is higher (by how much)?
    `paired`: a - b per seed (a seed's two runs are judged on the same held-out problems)."""
    difference = a["mean"] - b["mean"]
    higher = names[0] if difference > 0 else names[1] if difference < 0 else "neither"
    within = a["low"] <= b["high"] and b["low"] <= a["high"]
    paired = {seed: acc - b["seeds"][seed] for seed, acc in a.get("seeds", {}).items() if seed in b.get("seeds", {})}
    return {"within_spread": within, "higher": higher, "difference": difference, "paired": paired}


def binomial_se(p: float, n: int) -> float:
    return math.sqrt(p * (1 - p) / n) if n > 0 else float("nan")


def summarize(runs: list[dict]) -> dict:
    """Both views for both trainers, with their verdicts."""
    out = {}
    for tag in VIEWS:
        views = {t: view(runs, t, tag) for t in TRAINERS}
        if any(v is None for v in views.values()):
            continue
        verdict = spread_verdict(views["covey"], views["trl"])
        p = (views["covey"]["mean"] + views["trl"]["mean"]) / 2
        out[tag] = {**views, "verdict": verdict, "binomial_se": binomial_se(p, views["covey"]["n"])}
    return out


def pct(x: float) -> str:
    return f"{100 * x:.1f}%"


def view_sentence(tag: str, where: str, s: dict) -> str:
    """One line of the report from a summarize() entry."""
    c, t, v = s["covey"], s["trl"], s["verdict"]
    seeds = {k: ", ".join(pct(x) for x in s[k]["seeds"].values()) for k in TRAINERS}
    if v["within_spread"]:
        judged = "within the seeds' spread of each other"
    else:
        judged = f"{v['higher']} is higher in every seed"
    lead = f"{v['higher']} higher by {100 * abs(v['difference']):.1f} points" if v["higher"] != "neither" else "equal"
    paired = ", ".join(f"{100 * d:+.1f}" for d in v["paired"].values())
    return (f"- {VIEWS[tag]} ({where}): covey {pct(c['mean'])} (seeds {seeds['covey']}) vs TRL {pct(t['mean'])} "
            f"(seeds {seeds['trl']}): {lead} on the mean, {judged}; covey - TRL per seed, on the same "
            f"problems: {paired} points (one measurement's binomial standard error is about "
            f"{100 * s['binomial_se']:.1f} points).")


def median(xs: list[float]) -> float:
    xs = sorted(xs)
    return (xs[(len(xs) - 1) // 2] + xs[len(xs) // 2]) / 2 if xs else float("nan")


def trainer_table(runs: list[dict], summary: dict, steps: int, minutes: float) -> list[str]:
    """One row per trainer: untrained, both views (mean; seeds), where the minutes mark fell, speed."""
    def cell(tag: str, trainer: str) -> str:
        v = summary.get(tag, {}).get(trainer)
        return f"{pct(v['mean'])} ({', '.join(pct(x) for x in v['seeds'].values())})" if v else "-"

    lines = [f"| trainer | untrained | step {steps} (mean; seeds) | {minutes:g} training min (mean; seeds) "
             f"| step at {minutes:g} min | median s/step | steps run |", "|---|---|---|---|---|---|---|"]
    for t in TRAINERS:
        mine = [r for r in runs if r["trainer"] == t]
        if not mine:
            continue
        mark = summary.get("minutes", {}).get(t)
        lines.append(f"| {t} | {', '.join(pct(r['points'][0]['accuracy']) for r in mine)} | {cell('steps', t)} | "
                     f"{cell('minutes', t)} | {'/'.join(str(x) for x in mark['step'].values()) if mark else '-'} | "
                     f"{median([s['step_s'] for r in mine for s in r['steps']]):.1f} | "
                     f"{'/'.join(str(r['steps'][-1]['step']) for r in mine)} |")
    return lines


def markdown(runs: list[dict], summary: dict, header: str, steps: int, minutes: float) -> str:
    lines = [header, "", *trainer_table(runs, summary, steps, minutes), ""]
    if "steps" in summary:
        lines.append(view_sentence("steps", f"step {steps}", summary["steps"]))
    if "minutes" in summary:
        s = summary["minutes"]
        where = (f"first step past {minutes:g} training minutes: covey at step "
                 f"{'/'.join(str(x) for x in s['covey']['step'].values())}, TRL at step "
                 f"{'/'.join(str(x) for x in s['trl']['step'].values())}")
        lines.append(view_sentence("minutes", where, s))
    lines += ["", "| trainer | seed | step | samples seen | training min | held-out accuracy | n | evaluated because |",
              "|---|---|---|---|---|---|---|---|"]
    for r in runs:
        for p in r["points"]:
            lines.append(f"| {r['trainer']} | {r['seed']} | {p['step']} | {p['samples']} | {p['minutes']:.2f} | "
                         f"{pct(p['accuracy'])} | {p['n']} | {', '.join(p['tags'])} |")
    return "\n".join(lines) + "\n"


def point_keys(p: dict, x: str) -> list:
    """What a point can be averaged with across seeds: the same step; on the minutes axis also
    the same moment (the first step past --minutes, at a different step in each seed)."""
    return [("step", p["step"])] + ([("minutes",)] if x == "minutes" and "minutes" in p["tags"] else [])


def mean_curve(runs: list[dict], x: str) -> list[tuple[float, float]]:
    """(mean x, mean accuracy) over the seeds at every key all of them have, in order of x."""
    by_key = [{k: p for p in r["points"] for k in point_keys(p, x)} for r in runs]
    common = set.intersection(*(set(keys) for keys in by_key)) if by_key else set()
    curve = {(sum(k[key][x] for k in by_key) / len(by_key), sum(k[key]["accuracy"] for k in by_key) / len(by_key))
             for key in common}
    return sorted(curve)


def figure(runs: list[dict], path: Path, title: str, minutes: float) -> Path:
    """Two panels, accuracy vs samples seen and vs training minutes: each trainer's mean over seeds
    (line) and each seed's points (markers); dashed lines at --steps and --minutes."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for ax, x, label in ((axes[0], "samples", "samples seen (completions)"), (axes[1], "minutes", "training minutes")):
        for trainer, color in zip(TRAINERS, ("tab:blue", "tab:orange")):
            mine = [r for r in runs if r["trainer"] == trainer]
            if not mine:
                continue
            for r, marker in zip(mine, "os^vD<>"):
                ax.scatter([p[x] for p in r["points"]], [100 * p["accuracy"] for p in r["points"]], color=color,
                           marker=marker, alpha=0.45, s=22, label=f"{trainer} seed {r['seed']}")
            curve = mean_curve(mine, x)
            ax.plot([c[0] for c in curve], [100 * c[1] for c in curve], color=color, lw=2, label=f"{trainer} mean")
        marks = [p["samples"] for r in runs for p in r["points"] if "steps" in p["tags"]][:1] if x == "samples" \
            else [minutes] if minutes > 0 else []
        for mark in marks:
            ax.axvline(mark, color="grey", ls="--", lw=1)
        top = max((100 * p["accuracy"] for r in runs for p in r["points"]), default=0.0)
        ax.set_ylim(0, max(10.0, 1.15 * top))
        ax.set_xlabel(label)
        ax.set_ylabel("held-out accuracy (%)")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
