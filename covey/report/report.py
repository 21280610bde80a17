"""The compare report: PNG figures, a summary table and the claims table, from run folders alone.

`build_report(root)` reads `root/<algo>-s<seed>/` (and `root/compare.json` when present)
and writes `root/report.md` with its figures beside it. One algorithm keeps one colour in
every figure; curves are the mean over seeds with a min-max band.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from covey.report.claims import evaluate_claims
from covey.report.data import PHASES, ROLES, AlgoData, RunData, aligned_series, group_by_algo, load_runs

COLOURS = {"grpo": "tab:blue", "ppo": "tab:orange", "reinforce_pp": "tab:green", "rloo": "tab:red",
           "dpo_iterative": "tab:purple", "dr_grpo": "tab:brown", "reinforce_pp_baseline": "tab:olive",
           "remax": "tab:cyan"}
SPARE_COLOURS = ("tab:pink", "tab:gray", "black", "gold")
CURVES = [("reward/mean", "mean reward of the step's samples", "reward"),
          ("kl/ref", "KL to the reference", "nats / token"),
          ("policy/entropy", "policy entropy", "nats / token"),
          ("response/len_mean", "response length", "tokens"),
          ("policy/clipfrac", "clipped fraction of tokens", "fraction"),
          ("advantages/std", "advantage std across the batch", "per token")]
FIGURES = ("accuracy_steps.png", "accuracy_time.png", "training_curves.png", "memory.png",
           "time_per_phase.png", "variance.png")


def colour_of(algo: str, algos: list[str]) -> str:
    if algo in COLOURS:
        return COLOURS[algo]
    unknown = [a for a in algos if a not in COLOURS]
    return SPARE_COLOURS[unknown.index(algo) % len(SPARE_COLOURS)]


def pyplot():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    pyplot().close(fig)
    return path


# --------------------------------------------------------------------------- figures


def eval_curve(runs: list[RunData], x_index: int) -> tuple[list[float], list[float], list[float], list[float]]:
    """Mean x, mean/min/max accuracy (%) over seeds at the eval steps every run has."""
    per_run = [{p[0]: p for p in r.eval_points()} for r in runs]
    steps = sorted(set.intersection(*(set(p) for p in per_run))) if per_run else []
    xs, mean, low, high = [], [], [], []
    for s in steps:
        accs = [100 * p[s][2] for p in per_run]
        xs.append(sum(p[s][x_index] for p in per_run) / len(per_run))
        mean.append(sum(accs) / len(accs))
        low.append(min(accs))
        high.append(max(accs))
    return xs, mean, low, high


def plot_accuracy(data: dict[str, AlgoData], out: Path, by_time: bool) -> Path:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    algos = list(data)
    for algo, d in data.items():
        c = colour_of(algo, algos)
        for r in d.runs:  # each seed, thin
            pts = r.eval_points()
            ax.plot([p[1 if by_time else 0] for p in pts], [100 * p[2] for p in pts], color=c, alpha=0.25, lw=1)
        xs, mean, low, high = eval_curve(d.runs, 1 if by_time else 0)
        ax.plot(xs, mean, color=c, marker="o", lw=2, label=f"{algo} (mean of {len(d.runs)} seeds)")
        ax.fill_between(xs, low, high, color=c, alpha=0.15)
    ax.set_xlabel("training wall time (minutes, evaluation excluded)" if by_time else "training step")
    ax.set_ylabel("held-out accuracy (%, greedy)")
    ax.set_title("Held-out accuracy vs " + ("wall time" if by_time else "training steps")
                 + " (band: min-max over seeds)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return save(fig, out)


def plot_curves(data: dict[str, AlgoData], out: Path) -> Path:
    plt = pyplot()
    fig, axes = plt.subplots(2, 3, figsize=(15, 8))
    algos = list(data)
    for ax, (key, title, unit) in zip(axes.flat, CURVES):
        for algo, d in data.items():
            steps, mean, low, high = aligned_series(d.runs, key)
            if steps:
                ax.plot(steps, mean, color=colour_of(algo, algos), lw=2, label=algo)
                ax.fill_between(steps, low, high, color=colour_of(algo, algos), alpha=0.15)
        ax.set_title(title)
        ax.set_xlabel("training step")
        ax.set_ylabel(unit)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle("Training curves (mean over seeds, band: min-max); a missing line = not defined for that algorithm")
    return save(fig, out)


def bar_panel(ax, data: dict[str, AlgoData], key: str, title: str, ylabel: str, log: bool = False) -> None:
    """Mean over seeds as a bar, sd as an error bar, each seed as a dot."""
    algos = list(data)
    for i, (algo, d) in enumerate(data.items()):
        stat = d.per_seed(key)
        if not stat.n:
            ax.text(i, 0.02, "n/a", ha="center", va="bottom", fontsize=8, transform=ax.get_xaxis_transform())
            continue
        ax.bar(i, stat.mean, color=colour_of(algo, algos), yerr=stat.sd if stat.n > 1 else None, capsize=4,
               alpha=0.8, label=algo)
        ax.scatter([i] * stat.n, stat.finite, color="black", s=12, zorder=3)
    ax.set_xticks(range(len(algos)), algos, rotation=20, fontsize=8)
    ax.set_title(title)
    ax.set_ylabel(ylabel)
    if log and all(v > 0 for algo in algos for v in data[algo].per_seed(key).finite):
        ax.set_yscale("log")
    ax.grid(alpha=0.3, axis="y")


def plot_memory(data: dict[str, AlgoData], out: Path) -> Path:
    plt = pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 4.8))
    algos = list(data)
    hatches = {"actor": "", "reference": "//", "critic": "xx", "reward_model": "..", "optimizer": "oo"}
    for i, (algo, d) in enumerate(data.items()):
        bottom = 0.0
        for role in ROLES:
            mb = d.per_seed(f"mb/{role}").mean
            if math.isfinite(mb) and mb > 0:
                left.bar(i, mb, bottom=bottom, color=colour_of(algo, algos), hatch=hatches[role],
                         edgecolor="black", alpha=0.8, label=role if i == 0 or role == "critic" else None)
                left.text(i, bottom + mb / 2, f"{role} {mb:.0f}", ha="center", va="center", fontsize=7,
                          bbox={"facecolor": "white", "alpha": 0.8, "pad": 1, "linewidth": 0})
                bottom += mb
    left.set_xticks(range(len(algos)), algos, rotation=20, fontsize=8)
    left.set_ylabel("memory (MB)")
    left.set_title("Model state by role: parameters and optimizer states")
    left.grid(alpha=0.3, axis="y")
    bar_panel(right, data, "peak_rss_mb", "Peak resident memory of the training process", "peak RSS (MB)")
    return save(fig, out)


def plot_phases(data: dict[str, AlgoData], out: Path) -> Path:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(8, 4.8))
    algos = list(data)
    shades = {"generate": 1.0, "score": 0.35, "logprobs": 0.6, "update": 0.8}
    tallest = max((d.per_seed("sec_per_step").mean for d in data.values()), default=0.0)
    for i, (algo, d) in enumerate(data.items()):
        bottom = 0.0
        for phase in PHASES:
            name = phase.split("/")[1]
            sec = d.per_seed(f"phase/{name}").mean
            if math.isfinite(sec) and sec > 0:
                ax.bar(i, sec, bottom=bottom, color=colour_of(algo, algos), alpha=shades[name], edgecolor="black")
                if sec > 0.04 * tallest:  # no label on slivers
                    ax.text(i, bottom + sec / 2, f"{name} {sec:.1f}", ha="center", va="center", fontsize=7)
                bottom += sec
        total = d.per_seed("sec_per_step").mean
        ax.scatter([i], [total], marker="_", s=400, color="black", label="whole step" if i == 0 else None)
    ax.set_xticks(range(len(algos)), algos, rotation=20, fontsize=8)
    ax.set_ylabel("seconds per training step (mean over steps and seeds)")
    ax.set_title("Time per phase of a training step")
    ax.grid(alpha=0.3, axis="y")
    ax.legend(fontsize=8)
    return save(fig, out)


def plot_variance(data: dict[str, AlgoData], out: Path) -> Path:
    plt = pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.6))
    bar_panel(axes[0], data, "adv_var_mean", "Per-token advantage variance across the batch",
              "variance (advantage units squared)")
    bar_panel(axes[1], data, "grad_noise_frac", "Policy-gradient noise fraction tr(Cov) / E|g|^2",
              "fraction of the mini-batch gradient (0-1)")
    bar_panel(axes[2], data, "grad_var", "Policy-gradient variance tr(Cov)",
              "sum over parameters (loss units squared)", log=True)
    fig.suptitle("Variance of the update (bars: mean over seeds, error bar: sd, dots: seeds; n/a = not measured)")
    return save(fig, out)


def write_figures(data: dict[str, AlgoData], root: Path) -> list[Path]:
    return [plot_accuracy(data, root / FIGURES[0], by_time=False),
            plot_accuracy(data, root / FIGURES[1], by_time=True),
            plot_curves(data, root / FIGURES[2]), plot_memory(data, root / FIGURES[3]),
            plot_phases(data, root / FIGURES[4]), plot_variance(data, root / FIGURES[5])]


# --------------------------------------------------------------------------- markdown

SUMMARY_COLUMNS = [
    ("acc_before", "held-out acc. before", "%"), ("acc_after", "held-out acc. after", "%"),
    ("acc_gain", "acc. gain", "%"), ("reward_mean", "train reward", ""), ("kl_final", "KL to ref (last)", ""),
    ("entropy_mean", "entropy", ""), ("len_mean", "resp. length", ""), ("clipfrac_mean", "clip frac.", ""),
    ("sec_per_step", "s / step", ""), ("train_minutes", "train min", ""), ("peak_rss_mb", "peak RSS MB", ""),
    ("model_state_mb", "model state MB", ""), ("adv_var_mean", "adv. variance", ""),
    ("grad_noise_frac", "grad. noise frac.", ""),
]


def number(x: float, digits: int = 3) -> str:
    """Whole numbers from 100 up (memory in MB), `digits` significant digits below."""
    return f"{x:.0f}" if abs(x) >= 100 else f"{x:.{digits}g}"


def cell(d: AlgoData, key: str, unit: str) -> str:
    stat = d.per_seed(key)
    if not stat.n:
        return "n/a"
    scale = 100 if unit == "%" else 1
    return number(stat.mean * scale) + (f" ± {number(stat.sd * scale, 2)}" if stat.n > 1 else "")


def summary_table(data: dict[str, AlgoData]) -> list[str]:
    head = ["algorithm", "seeds", "steps"] + [f"{label}{' (%)' if u == '%' else ''}" for _, label, u in SUMMARY_COLUMNS]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for algo, d in data.items():
        finished = sum(r.finished for r in d.runs)
        row = [algo, f"{finished}/{len(d.runs)}", cell(d, "steps", "")] + [cell(d, k, u) for k, _, u in SUMMARY_COLUMNS]
        lines.append("| " + " | ".join(row) + " |")
    return lines


def claims_table(data: dict[str, AlgoData]) -> list[str]:
    """The claims whose algorithms all ran; the others are only counted."""
    lines = ["| # | source | claim | verdict | what this comparison measured |", "|---|---|---|---|---|"]
    shown = [(claim, verdict) for claim, verdict in evaluate_claims(data) if all(a in data for a in claim.algos)]
    for i, (claim, verdict) in enumerate(shown, 1):
        measured = verdict.measured.replace("|", "\\|")  # a pipe would end the table cell
        lines.append(f"| {i} | {claim.source} | {claim.text} | **{verdict.verdict}** | {measured} |")
    left = len(evaluate_claims(data)) - len(shown)
    if not shown:
        lines = ["None of the claims is about algorithms that all ran in this comparison."]
    if left:
        lines += ["", f"Claims about an algorithm this comparison did not run: {left} (covey/report/claims.py "
                      "lists them all)."]
    return lines


# The keys that set a built-in task's difficulty (docs/tasks.md), shown in the report's header.
TASK_DIFFICULTY = {"arithmetic": ("kind", "digits_a", "digits_b"), "multistep": ("min_ops", "max_ops"),
                   "wordproblems": ("word_steps",)}


def header(root: Path, spec: dict, runs: list[RunData]) -> list[str]:
    cfg = runs[0].config if runs else {}

    def get(section: str, key: str):
        return cfg.get(section, {}).get(key, "?")
    unfinished = [r.path.name for r in runs if not r.finished]
    lines = [f"# covey compare: {spec.get('name', root.name)}", ""]
    if spec.get("command"):
        lines += [f"Command: `{spec['command']}`", ""]
    task = cfg.get("task", {})
    difficulty = ", ".join(f"{key}={task[key]}" for key in TASK_DIFFICULTY.get(task.get("name"), ()) if key in task)
    lines += [f"Model `{get('model', 'path')}`, task `{get('task', 'name')}` ({difficulty + ', ' if difficulty else ''}"
              f"{get('task', 'eval_size')} held-out problems, greedy), {get('rollout', 'prompts_per_step')} prompts x "
              f"{get('rollout', 'group_size')} samples per step, up to {get('rollout', 'max_new_tokens')} new tokens; "
              f"budget per run: {spec.get('budget', '?')}; seeds: {sorted({r.seed for r in runs})}.", ""]
    if unfinished:
        lines += [f"Unfinished runs (shown with the steps they have): {', '.join(unfinished)}.", ""]
    return lines


METHOD_NOTES = """## How the numbers are measured

- Held-out accuracy: greedy answers on the held-out problems, before training (step 0), at
  `train.eval_every` and after the last step. Wall time counts training steps only (`time/step`).
- Train reward: mean over steps of `reward/mean`. Stability: mean absolute change of
  `reward/mean` between consecutive steps (smaller = steadier).
- Model state: `memory/params_mb/<role>` (parameters of actor, reference, critic, reward model)
  plus optimizer states; peak RSS: `memory/peak_rss_mb` of the training process (each run is its
  own process, so runs do not share a peak).
- Advantage variance: `advantages/std` squared, per token across the batch. Every preset
  normalises its advantages, so this is near 1 by construction and says little about the update.
- Policy-gradient variance: every `train.grad_var_every` steps the step's rollout is split into
  `train.grad_var_batches` disjoint mini-batches before the update; the gradient of the
  algorithm's own loss is taken on each (covey/training/gradvar.py). tr(Cov) of these gradients is the
  variance (claim 3); tr(Cov)/E|g|^2 is the noise fraction (near 1: almost all noise). Not
  defined for iterative DPO.
- Verdicts: covey/report/claims.py. Claims with a stated size use the stated range with a tolerance;
  directional claims use a two-sided Welch t-test at 5% on the units named in the table.
"""


def build_report(root: str | Path) -> Path:
    """Write root/report.md and its figures from the run folders; returns the report path."""
    root = Path(root)
    spec_path = root / "compare.json"
    spec = json.loads(spec_path.read_text()) if spec_path.is_file() else {}
    runs = load_runs(root, spec.get("algos"))
    if not runs:
        raise FileNotFoundError(f"{root}: no run folders (<algo>-s<seed>/metrics.jsonl) to report on")
    data = group_by_algo(runs)
    write_figures(data, root)
    lines = header(root, spec, runs)
    lines += ["## Summary (mean ± sd over seeds)", ""] + summary_table(data) + [""]
    lines += ["## Claims commonly made about these algorithms", ""] + claims_table(data) + [""]
    lines += ["## Figures", ""] + [f"![{name[:-4].replace('_', ' ')}]({name})" for name in FIGURES] + [""]
    lines += [METHOD_NOTES]
    out = root / "report.md"
    out.write_text("\n".join(lines))
    return out
