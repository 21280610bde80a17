"""The drivers' results as tables and verdicts: the CPU speed table, the GPU rows against their targets,
the learning comparison's two views, its verdicts, table and figure.

Learning runs: {"trainer", "seed", "points": [{"step", "samples", "minutes", "tags", "accuracy", "n"}]}
whose first point is the untrained model (step 0, tags ["base"]). The per-sample view reads each run at
the point tagged "steps" (step == --steps); the wall-clock view at the point tagged "minutes" (the first
step boundary past --minutes of training time). With a handful of seeds per trainer, "within the seeds'
spread of each other" means that the ranges [min, max] over the seeds of the two trainers overlap;
otherwise one trainer is higher in every seed. Each seed draws its own train and held-out problems, which
both trainers of that seed share, so the per-seed differences are printed too, beside the binomial standard
error of one measurement, sqrt(p (1 - p) / n).
"""

from __future__ import annotations

import math
import statistics
from pathlib import Path

from bench.harness import medians
from bench.workloads import floor_bytes, update_flops

GPU_TARGETS = {  # what the GPU run is judged against (ratios; see docs/benchmark.md)
    "step_vs_trl": {"0.5b": 0.15, "1.5b": 0.25},
    "decode_vs_floor": {"0.5b": 3.0, "1.5b": 2.0},
    "update_share_of_peak": {"1.5b": 0.35},
    "memory_vs_trl": 0.7,
}
TRAINERS = ("covey", "trl")
VIEWS = {"steps": "per-sample view", "minutes": "wall-clock view"}


def table(head: list[str], rows: list[list]) -> str:
    return "\n".join(["| " + " | ".join(head) + " |", "|" + "---|" * len(head),
                      *("| " + " | ".join(str(x) for x in row) + " |" for row in rows)])


def cpu_table(rows: list[dict], peak: dict) -> str:
    """One line per CPU run (harness.summarize rows); ratios against `trl` (TRL as it ships) and TRL's best."""
    trl = [r for r in rows if r["name"].startswith("trl")]
    refs = (next((r for r in trl if r["name"] == "trl"), trl[0] if trl else None),
            min(trl, key=lambda r: r["step_s"], default=None), min(trl, key=lambda r: r["peak_rss_mib"], default=None))

    def ratio(r: dict, ref: dict | None, key: str) -> str:
        return f"{r[key] / ref[key]:.2f}" if ref else "-"

    head = ["run", "precision", "median s/step", "min s", "generate", "score", "ref logp", "update",
            "tokens/s (in generate)", "train GFLOP/s (% of peak)", "peak RSS GiB", "step / trl",
            "step / fastest TRL", "RSS / trl", "RSS / leanest TRL"]
    return table(head, [[r["name"], r["precision"], f"{r['step_s']:.1f}", f"{r['min_s']:.1f}", f"{r['generate_s']:.1f}",
                         f"{r['score_s']:.2f}", f"{r['logprobs_s']:.1f}", f"{r['update_s']:.1f}",
                         f"{r['tokens_per_s']:.0f} ({r['gen_tokens_per_s']:.0f})",
                         f"{r['train_gflops']:.0f} ({100 * r['train_gflops'] / peak[peak_key(r)]:.0f}%)",
                         f"{r['peak_rss_mib'] / 1024:.2f}", ratio(r, refs[0], "step_s"), ratio(r, refs[1], "step_s"),
                         ratio(r, refs[0], "peak_rss_mib"), ratio(r, refs[2], "peak_rss_mib")] for r in rows])


def peak_key(row: dict) -> str:
    return "bfloat16" if row["precision"].startswith("bfloat16") else "float32"


# --------------------------------------------------------------------------- the GPU benchmark


def gpu_summary(size: str, device: dict, shape: dict, results: dict, workload: dict) -> dict:
    """One model size's row: each trainer's medians and rates (`results`: name -> child result or None),
    covey against TRL, covey's decode step against its floor (floor_bytes over the copy bandwidth)."""
    flops = update_flops(shape, workload, shape["prompt_tokens_mean"])
    out = {"size": size, "update_model_flops": flops, "trainers": list(results)}
    for name, res in results.items():
        if not (res or {}).get("steps"):
            continue
        med = medians(res["steps"])
        med["peak_gpu_gib"] = res["peak_gpu_mib"] / 1024 if res.get("peak_gpu_mib") else None
        med["generate_ms_per_token"] = 1000 * med["generate_s"] / workload["new_tokens"]
        med["update_tflops"] = flops / med["update_s"] / 1e12
        med["update_share_of_peak"] = med["update_tflops"] / device["matmul_tflops"] if device else None
        out[name] = {**med, "detail": {k: v for k, v in res.items() if k != "steps"}}
    covey, trl = out.get("covey"), out.get("trl")
    if covey and trl:
        out["step_vs_trl"] = covey["step_s"] / trl["step_s"]
        if covey["peak_gpu_gib"] and trl["peak_gpu_gib"]:
            out["memory_vs_trl"] = covey["peak_gpu_gib"] / trl["peak_gpu_gib"]
    if covey and covey["detail"].get("decode") and device:
        out["decode_floor_ms"] = 1000 * floor_bytes(shape, workload, shape["prompt_tokens_mean"]) / \
            device["copy_bytes_per_s"]
        out["decode_vs_floor"] = covey["detail"]["decode"]["step_ms"] / out["decode_floor_ms"]
    return out


def verdicts(row: dict) -> list[str]:
    """One line per target that applies to this size: measured, target, met or not."""
    lines = []
    for key, goal in GPU_TARGETS.items():
        goal = goal.get(row["size"]) if isinstance(goal, dict) else goal
        higher = key == "update_share_of_peak"
        value = row.get("covey", {}).get(key) if higher else row.get(key)
        if goal is not None and value is not None:
            met = value >= goal if higher else value <= goal
            lines.append(f"{row['size']} {key}: {value:.3f} (target {'>=' if higher else '<='} {goal}) "
                         f"{'met' if met else 'NOT MET'}")
    return lines


def gpu_table(rows: list[dict]) -> str:
    head = ["shape", "trainer", "median s/step", "generate s", "reference s", "update s", "peak GPU GiB",
            "generate ms/token", "update TFLOP/s (% of bf16 peak)"]
    lines = []
    for row in rows:
        for name in row["trainers"]:
            r = row.get(name)
            if r is None:
                lines.append([row["size"], name, "failed or skipped", "", "", "", "", "", ""])
                continue
            share = f" ({100 * r['update_share_of_peak']:.0f}%)" if r["update_share_of_peak"] is not None else ""
            lines.append([row["size"], name, f"{r['step_s']:.2f}", f"{r['generate_s']:.2f}", f"{r['logprobs_s']:.2f}",
                          f"{r['update_s']:.2f}", "-" if r["peak_gpu_gib"] is None else f"{r['peak_gpu_gib']:.2f}",
                          f"{r['generate_ms_per_token']:.2f}", f"{r['update_tflops']:.1f}{share}"])
    return table(head, lines)


def decode_lines(rows: list[dict]) -> list[str]:
    lines = []
    for row in rows:
        if "decode_vs_floor" in row:
            dec = row["covey"]["detail"]["decode"]
            lines.append(f"{row['size']} covey decode at {dec['rows']} rows: {dec['step_ms']:.3f} ms/step (generate of "
                         f"L tokens less generate of L/2, over L/2), floor {row['decode_floor_ms']:.3f} ms -> "
                         f"{row['decode_vs_floor']:.2f} x")
        lines += [f"{row['size']} rollout.decode={mode} (bf16 weights alone): {res}"
                  for mode, res in row.get("decode_modes", {}).items()]
    return lines


# --------------------------------------------------------------------------- the learning comparison


def view(runs: list[dict], trainer: str, tag: str) -> dict | None:
    """One trainer's accuracy at `tag` over its seeds: per seed, mean, range, and where each seed was."""
    at = {r["seed"]: next((p for p in r["points"] if tag in p["tags"]), None) for r in runs if r["trainer"] == trainer}
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


def learn_summary(runs: list[dict]) -> dict:
    """Both views for both trainers, with their verdicts (a view only where both trainers have it)."""
    out = {}
    for tag in VIEWS:
        views = {t: view(runs, t, tag) for t in TRAINERS}
        if any(v is None for v in views.values()):
            continue
        p = (views["covey"]["mean"] + views["trl"]["mean"]) / 2
        se = math.sqrt(p * (1 - p) / views["covey"]["n"]) if views["covey"]["n"] > 0 else float("nan")
        out[tag] = {**views, "verdict": spread_verdict(views["covey"], views["trl"]), "binomial_se": se}
    return out


def pct(x: float) -> str:
    return f"{100 * x:.1f}%"


def view_sentence(tag: str, where: str, s: dict) -> str:
    """One line of the report from a learn_summary() entry."""
    c, t, v = s["covey"], s["trl"], s["verdict"]
    seeds = {k: ", ".join(pct(x) for x in s[k]["seeds"].values()) for k in TRAINERS}
    judged = "within the seeds' spread of each other" if v["within_spread"] else f"{v['higher']} is higher in every seed"
    lead = f"{v['higher']} higher by {100 * abs(v['difference']):.1f} points" if v["higher"] != "neither" else "equal"
    paired = ", ".join(f"{100 * d:+.1f}" for d in v["paired"].values())
    return (f"- {VIEWS[tag]} ({where}): covey {pct(c['mean'])} (seeds {seeds['covey']}) vs TRL {pct(t['mean'])} "
            f"(seeds {seeds['trl']}): {lead} on the mean, {judged}; covey - TRL per seed, on the same "
            f"problems: {paired} points (one measurement's binomial standard error is about "
            f"{100 * s['binomial_se']:.1f} points).")


def markdown(runs: list[dict], summary: dict, header: str, steps: int, minutes: float) -> str:
    """The header, one row per trainer (untrained, both views: mean and seeds, where the minutes mark fell,
    speed), each view's verdict, and one row per evaluation point."""
    def cell(tag: str, trainer: str) -> str:
        v = summary.get(tag, {}).get(trainer)
        return f"{pct(v['mean'])} ({', '.join(pct(x) for x in v['seeds'].values())})" if v else "-"

    def marks(tag: str, trainer: str) -> str:
        v = summary.get(tag, {}).get(trainer)
        return "/".join(str(x) for x in v["step"].values()) if v else "-"

    rows = [[t, ", ".join(pct(r["points"][0]["accuracy"]) for r in mine), cell("steps", t), cell("minutes", t),
             marks("minutes", t), f"{statistics.median([s['step_s'] for r in mine for s in r['steps']]):.1f}",
             "/".join(str(r["steps"][-1]["step"]) for r in mine)]
            for t in TRAINERS if (mine := [r for r in runs if r["trainer"] == t])]
    lines = [header, "", table(["trainer", "untrained", f"step {steps} (mean; seeds)", f"{minutes:g} training min "
                                "(mean; seeds)", f"step at {minutes:g} min", "median s/step", "steps run"], rows), ""]
    if "steps" in summary:
        lines.append(view_sentence("steps", f"step {steps}", summary["steps"]))
    if "minutes" in summary:
        where = (f"first step past {minutes:g} training minutes: covey at step {marks('minutes', 'covey')}, TRL at "
                 f"step {marks('minutes', 'trl')}")
        lines.append(view_sentence("minutes", where, summary["minutes"]))
    points = [[r["trainer"], r["seed"], p["step"], p["samples"], f"{p['minutes']:.2f}", pct(p["accuracy"]), p["n"],
               ", ".join(p["tags"])] for r in runs for p in r["points"]]
    return "\n".join([*lines, "", table(["trainer", "seed", "step", "samples seen", "training min",
                                         "held-out accuracy", "n", "evaluated because"], points)]) + "\n"


def mean_curve(runs: list[dict], x: str) -> list[tuple[float, float]]:
    """(mean x, mean accuracy) over the seeds at every point all of them have, in order of x: the same
    step; on the minutes axis also the same moment (the first step past --minutes, a different step per seed)."""
    def keys(p: dict) -> list:
        return [("step", p["step"])] + ([("minutes",)] if x == "minutes" and "minutes" in p["tags"] else [])

    by_key = [{k: p for p in r["points"] for k in keys(p)} for r in runs]
    common = set.intersection(*(set(k) for k in by_key)) if by_key else set()
    return sorted({(sum(k[key][x] for k in by_key) / len(by_key), sum(k[key]["accuracy"] for k in by_key) / len(by_key))
                   for key in common})


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
            for r, marker in zip(mine, "os^vD<>"):
                ax.scatter([p[x] for p in r["points"]], [100 * p["accuracy"] for p in r["points"]], color=color,
                           marker=marker, alpha=0.45, s=22, label=f"{trainer} seed {r['seed']}")
            if mine:
                curve = mean_curve(mine, x)
                ax.plot([c[0] for c in curve], [100 * c[1] for c in curve], color=color, lw=2, label=f"{trainer} mean")
        marks = ([p["samples"] for r in runs for p in r["points"] if "steps" in p["tags"]][:1] if x == "samples"
                 else [minutes] if minutes > 0 else [])
        for mark in marks:
            ax.axvline(mark, color="grey", ls="--", lw=1)
        ax.set_ylim(0, max(10.0, 1.15 * max((100 * p["accuracy"] for r in runs for p in r["points"]), default=0.0)))
        ax.set(xlabel=label, ylabel="held-out accuracy (%)")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
