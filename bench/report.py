"""The drivers' results as tables and verdicts: the CPU speed table, the GPU rows against their targets,
the learning comparison's two views, verdicts, table and figure.

Learning runs: {"trainer", "seed", "points": [{"step", "samples", "minutes", "tags", "accuracy", "n"}]}
whose first point is the untrained model (step 0, tags ["base"]). The per-sample view reads each run
at the point tagged "steps" (step == --steps); the wall-clock view at the point tagged "minutes" (the
first step boundary past --minutes of training time). Spread verdict: with a handful of seeds per
trainer, "within the seeds' spread of each other" means that the ranges [min, max] over the seeds of
the two trainers overlap; otherwise one trainer is higher in every seed. Each seed draws its own train
and held-out problems, which both trainers of that seed share, so the per-seed differences are printed
too, beside the binomial standard error of one measurement, sqrt(p (1 - p) / n).
"""

from __future__ import annotations

import math
import statistics
from pathlib import Path

from bench.workloads import update_flops

GPU_TARGETS = {  # what the GPU run is judged against (ratios; see docs/benchmark.md)
    "step_vs_trl": {"0.5b": 0.15, "1.5b": 0.25},
    "decode_vs_floor": {"0.5b": 3.0, "1.5b": 2.0},
    "update_share_of_peak": {"1.5b": 0.35},
    "memory_vs_trl": 0.7,
}
TRAINERS = ("covey", "trl")
VIEWS = {"steps": "per-sample view", "minutes": "wall-clock view"}


def cpu_table(rows: list[dict], peak: dict) -> str:
    """One line per CPU run (harness.summarize rows); ratios against `trl` (TRL as it ships) and TRL's best."""
    trl = [r for r in rows if r["name"].startswith("trl")]
    base = next((r for r in trl if r["name"] == "trl"), trl[0] if trl else None)
    fastest = min(trl, key=lambda r: r["median_s"]) if trl else None
    leanest = min(trl, key=lambda r: r["peak_rss_mib"]) if trl else None

    def ratio(value: float, ref: dict | None, key: str) -> str:
        return f"{value / ref[key]:.2f}" if ref else "-"

    head = ("| run | precision | median s/step | min s | generate | score | ref logp | update | tokens/s (in generate) "
            "| train GFLOP/s (% of peak) | peak RSS GiB | step / trl | step / fastest TRL | RSS / trl "
            "| RSS / leanest TRL |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        share = 100 * r["train_gflops"] / peak["bfloat16" if r["precision"].startswith("bfloat16") else "float32"]
        lines.append(f"| {r['name']} | {r['precision']} | {r['median_s']:.1f} | {r['min_s']:.1f} | "
                     f"{r['generate_s']:.1f} | {r['score_s']:.2f} | {r['logprobs_s']:.1f} | {r['update_s']:.1f} | "
                     f"{r['tokens_per_s']:.0f} ({r['gen_tokens_per_s']:.0f}) | "
                     f"{r['train_gflops']:.0f} ({share:.0f}%) | {r['peak_rss_mib'] / 1024:.2f} | "
                     f"{ratio(r['median_s'], base, 'median_s')} | {ratio(r['median_s'], fastest, 'median_s')} | "
                     f"{ratio(r['peak_rss_mib'], base, 'peak_rss_mib')} | "
                     f"{ratio(r['peak_rss_mib'], leanest, 'peak_rss_mib')} |")
    return "\n".join(lines)


# --------------------------------------------------------------------------- the GPU benchmark


def step_medians(steps: list[dict]) -> dict:
    """Medians over steps 2..N of a GPU child's step and its phases."""
    timed = steps[1:] or steps
    return {key: statistics.median(s[key] for s in timed)
            for key in ("step_s", "generate_s", "reference_s", "update_s", "score_s")}


def gpu_summary(size: str, device: dict, shape: dict, results: dict, workload: dict) -> dict:
    """One model size's row: each trainer's medians and rates (`results`: name -> child result or None),
    covey against TRL, covey's decode step against its floor."""
    flops = update_flops(shape, workload, shape["prompt_tokens_mean"])
    out = {"size": size, "update_model_flops": flops, "trainers": list(results)}
    covey, trl = results.get("covey"), results.get("trl")
    for name, res in results.items():
        if res is None:
            continue
        med = step_medians(res["steps"])
        med["peak_gpu_gib"] = res["peak_gpu_bytes"] / 2**30 if res.get("peak_gpu_bytes") else None
        med["generate_ms_per_token"] = 1000 * med["generate_s"] / workload["new_tokens"]
        med["update_tflops"] = flops / med["update_s"] / 1e12
        med["update_share_of_peak"] = med["update_tflops"] / device["matmul_tflops"] if device else None
        out[name] = {**med, "detail": {k: v for k, v in res.items() if k != "steps"}}
    if covey and trl:
        out["step_vs_trl"] = out["covey"]["step_s"] / out["trl"]["step_s"]
        if out["covey"]["peak_gpu_gib"] and out["trl"]["peak_gpu_gib"]:
            out["memory_vs_trl"] = out["covey"]["peak_gpu_gib"] / out["trl"]["peak_gpu_gib"]
    if covey and covey.get("decode"):
        floor_ms = 1000 * covey["decode"]["floor_bytes_per_step"] / device["copy_bytes_per_s"]
        out["decode_floor_ms"] = floor_ms
        out["decode_loop_ms"] = covey["decode"]["loop_ms_median"]
        out["decode_vs_floor"] = out["decode_loop_ms"] / floor_ms
    return out


def verdicts(row: dict) -> list[str]:
    """One line per target that applies to this size: measured, target, met or not."""
    size, lines = row["size"], []
    for key, goal in GPU_TARGETS.items():
        goal = goal.get(size) if isinstance(goal, dict) else goal
        if goal is None or key not in row and key != "update_share_of_peak":
            continue
        value = row.get("covey", {}).get(key) if key == "update_share_of_peak" else row.get(key)
        if value is None:
            continue
        met = value >= goal if key == "update_share_of_peak" else value <= goal
        lines.append(f"{size} {key}: {value:.3f} (target {'>=' if key == 'update_share_of_peak' else '<='} "
                     f"{goal}) {'met' if met else 'NOT MET'}")
    return lines


def gpu_table(rows: list[dict]) -> str:
    head = ("| shape | trainer | median s/step | generate s | reference s | update s | peak GPU GiB "
            "| generate ms/token | update TFLOP/s (% of bf16 peak) |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for row in rows:
        for name in row["trainers"]:
            r = row.get(name)
            if r is None:
                lines.append(f"| {row['size']} | {name} | failed or skipped | | | | | | |")
                continue
            peak = f"{r['peak_gpu_gib']:.2f}" if r["peak_gpu_gib"] is not None else "-"
            share = f" ({100 * r['update_share_of_peak']:.0f}%)" if r["update_share_of_peak"] is not None else ""
            lines.append(f"| {row['size']} | {name} | {r['step_s']:.2f} | {r['generate_s']:.2f} | "
                         f"{r['reference_s']:.2f} | {r['update_s']:.2f} | {peak} | {r['generate_ms_per_token']:.2f} | "
                         f"{r['update_tflops']:.1f}{share} |")
    return "\n".join(lines)


def decode_lines(rows: list[dict]) -> list[str]:
    lines = []
    for row in rows:
        dec = row.get("covey", {}).get("detail", {}).get("decode")
        if not dec:
            continue
        lines.append(f"{row['size']} covey decode at {dec['rows']} rows: {row['decode_loop_ms']:.3f} ms/step in the "
                     f"loop (graph replay with sampling, host checks), floor {row['decode_floor_ms']:.3f} ms "
                     f"({dec['floor_bytes_per_step'] / 1e9:.3f} GB read per step) -> {row['decode_vs_floor']:.2f} x")
        for length, ms in sorted(dec.get("replay_ms", {}).items(), key=lambda kv: int(kv[0])):
            lines.append(f"  replays back to back, {length} columns attended: {ms:.3f} ms")
    for row in rows:
        for mode, res in row.get("decode_modes", {}).items():
            lines.append(f"{row['size']} rollout.decode={mode} (bf16 weights alone): {res}")
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
    judged = ("within the seeds' spread of each other" if v["within_spread"]
              else f"{v['higher']} is higher in every seed")
    lead = f"{v['higher']} higher by {100 * abs(v['difference']):.1f} points" if v["higher"] != "neither" else "equal"
    paired = ", ".join(f"{100 * d:+.1f}" for d in v["paired"].values())
    return (f"- {VIEWS[tag]} ({where}): covey {pct(c['mean'])} (seeds {seeds['covey']}) vs TRL {pct(t['mean'])} "
            f"(seeds {seeds['trl']}): {lead} on the mean, {judged}; covey - TRL per seed, on the same "
            f"problems: {paired} points (one measurement's binomial standard error is about "
            f"{100 * s['binomial_se']:.1f} points).")


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
                     f"{statistics.median([s['step_s'] for r in mine for s in r['steps']]):.1f} | "
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
        marks = [p["samples"] for r in runs for p in r["points"] if "steps" in p["tags"]][:1] if x == "samples" \
            else [minutes] if minutes > 0 else []
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
