"""What covey and TRL's GRPOTrainer learn from the same model, task, reward and hyperparameters.

    python -m bench.learn --out bench/results/learn-vs-trl algo.ddof=1 algo.adv_eps=1e-4
    python -m bench.learn --smoke --trainers covey    # the pipeline on the tiny model, seconds

Per seed, each trainer in a child to step --steps AND --minutes of training time (bench/workloads.py, Schedule),
saving the policy at its evaluation points; then one `covey eval` (greedy, covey's verifier) of the untrained
model and every folder, for both trainers. The two keys above give covey TRL's group std. Output under --out:
learn-vs-trl.json, .md (both views, their verdicts, every point) and .png.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import math
import shutil
import statistics
import sys
import tempfile
from importlib import metadata
from pathlib import Path

from bench.harness import Children, machine, table, write_json
from bench.workloads import LEARN_SMOKE

TRAINERS = ("covey", "trl")
VIEWS = {"steps": "per-sample view", "minutes": "wall-clock view"}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=30, help="every run reaches this step (the per-sample view)")
    p.add_argument("--minutes", type=float, default=12.0, help="... and this much training time (the wall-clock view)")
    p.add_argument("--eval-every", type=int, default=10, help="held-out evaluation every K steps")
    p.add_argument("--max-minutes", type=float, default=0.0, help="end every run at the first step past this much "
                   "training time, even short of --steps (0: no cap)")
    p.add_argument("--seeds", default="0,1")
    p.add_argument("--trainers", default="covey,trl", help="covey, trl or both (the comparison needs both)")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"), help="where both trainers and the evaluation "
                                                                            "run")
    p.add_argument("--out", default="", help="output folder (default: a temporary folder)")
    p.add_argument("--smoke", action="store_true", help="tiny random model, 3 steps, 8 held-out problems")
    p.add_argument("overrides", nargs="*", help="covey key=value overrides, applied to both trainers")
    args = p.parse_args(argv)
    if args.smoke:  # again, with the smoke run's defaults
        p.set_defaults(steps=3, minutes=0.01, eval_every=2)
        args = p.parse_args(argv)
    trainers = [t for t in args.trainers.split(",") if t]
    if args.steps < 1 or min(args.minutes, args.eval_every, args.max_minutes) < 0 or set(trainers) - {"covey", "trl"}:
        p.error("--steps must be >= 1, --minutes, --max-minutes and --eval-every >= 0, --trainers from covey, trl")
    return args, trainers


def base_overrides(args, work: Path | None) -> list[str]:
    """The keys of every child but the seed: the device first; --smoke builds the tiny model into `work` unless
    model.path is given."""
    items = [f"train.device={args.device}"]
    if args.smoke and not any(o.startswith("model.path=") for o in args.overrides):
        from covey.models.tiny import build_tiny_model
        items.append(f"model.path={build_tiny_model(work / 'tiny-model')}")
    return items + (LEARN_SMOKE if args.smoke else []) + list(args.overrides)


def seed_runs(children: Children, seed: int, args, trainers: list[str], keys: list[str], ckpt: Path) -> list[dict]:
    """The trainers' runs on one seed, then `covey eval` of the untrained model and every saved folder in one
    process: each point's accuracy filled in, the untrained model first as step 0, the folders deleted."""
    from covey.config import load_config
    from covey.models.load import resolve_model_path
    keys, runs = [*keys, f"train.seed={seed}"], []
    for trainer in trainers:
        spec = {"keys": keys, "schedule": [args.steps, args.minutes, args.eval_every, args.max_minutes],
                "save_dir": str(ckpt / f"{trainer}-seed{seed}")}
        runs.append({"trainer": trainer, "seed": seed, **children.must(trainer, "learn", f"{trainer}-seed{seed}",
                                                                         spec, malloc=trainer == "covey")})
    folders = {"base": resolve_model_path(load_config("grpo", keys).model.path),
               **{f"{r['trainer']}-{p['step']}": p["folder"] for r in runs for p in r["points"]}}
    scores = children.must("covey", "eval", f"eval-seed{seed}", {"keys": keys, "folders": folders}, malloc=True)
    for r in runs:
        shutil.rmtree(ckpt / f"{r['trainer']}-seed{seed}", ignore_errors=True)
        for p in r["points"]:
            p.update(**scores[f"{r['trainer']}-{p['step']}"], folder=None)
        r["points"].insert(0, {"step": 0, "samples": 0, "minutes": 0.0, "tags": ["base"], **scores["base"]})
    print(f"learn-vs-trl: seed {seed}: " + "; ".join(
        f"{r['trainer']} {100 * r['points'][0]['accuracy']:.1f}% -> {100 * r['points'][-1]['accuracy']:.1f}% "
        f"at step {r['points'][-1]['step']}" for r in runs), flush=True)
    return runs


def header(runs: list[dict], argv: list[str]) -> str:
    import transformers
    trl = metadata.version("trl") if importlib.util.find_spec("trl") else None
    where = machine() + ("; GPU" if any(str(r.get("device", "cpu")).startswith("cuda") for r in runs) else "")
    return (f"Learning side by side, covey vs TRL {trl or '(not installed)'} GRPOTrainer (transformers "
            f"{transformers.__version__}), {datetime.datetime.now():%Y-%m-%d %H:%M}; {where}; torch threads per run: "
            f"{'/'.join(sorted({str(r.get('threads')) for r in runs}))}.\n"
            f"Command: `python -m bench.learn {' '.join(argv)}`")


def spread_verdict(a: dict, b: dict) -> dict:
    """Do the seed ranges of views `a` (covey) and `b` (TRL) overlap, whose mean is higher, and a - b per seed
    (a seed's two runs are judged on the same held-out problems)."""
    difference = a["mean"] - b["mean"]
    return {"within_spread": a["low"] <= b["high"] and b["low"] <= a["high"], "difference": difference,
            "higher": TRAINERS[0] if difference > 0 else TRAINERS[1] if difference < 0 else "neither",
            "paired": {seed: acc - b["seeds"][seed] for seed, acc in a["seeds"].items() if seed in b["seeds"]}}


def learn_summary(runs: list[dict]) -> dict:
    """Per view both trainers have: each one's accuracy per seed at the view's point (and that point's step), mean,
    range and n; the verdict; one measurement's binomial standard error, sqrt(p (1 - p) / n), at the two means."""
    out = {}
    for tag in VIEWS:
        at = {t: {r["seed"]: p for r in runs if r["trainer"] == t for p in r["points"] if tag in p["tags"]}
              for t in TRAINERS}
        if not all(at.values()):
            continue
        views = {t: {"seeds": {s: p["accuracy"] for s, p in points.items()}, "n": min(p["n"] for p in points.values()),
                     "step": {s: p["step"] for s, p in points.items()}} for t, points in at.items()}
        for v in views.values():
            v.update(mean=statistics.fmean(v["seeds"].values()), low=min(v["seeds"].values()),
                     high=max(v["seeds"].values()))
        p = (views["covey"]["mean"] + views["trl"]["mean"]) / 2
        out[tag] = {**views, "verdict": spread_verdict(views["covey"], views["trl"]),
                    "binomial_se": math.sqrt(p * (1 - p) / views["covey"]["n"])}
    return out


def pct(x: float) -> str:
    return f"{100 * x:.1f}%"


def markdown(runs: list[dict], summary: dict, header: str, steps: int, minutes: float) -> str:
    """The header; one row per trainer (untrained, both views with their seeds, the step at the minutes mark,
    speed); each view's verdict; one row per evaluation point."""
    def at(tag: str, trainer: str, what: str = "seeds") -> str:
        v = summary.get(tag, {}).get(trainer)
        if not v:
            return "-"
        return "/".join(map(str, v["step"].values())) if what == "step" else \
            f"{pct(v['mean'])} ({', '.join(pct(x) for x in v['seeds'].values())})"

    def verdict(tag: str, where: str) -> str:
        s, v = summary[tag], summary[tag]["verdict"]
        lead = f"{v['higher']} higher by {100 * abs(v['difference']):.1f} points" if v["higher"] != "neither" else "equal"
        return (f"- {VIEWS[tag]} ({where}): covey {at(tag, 'covey')} vs TRL {at(tag, 'trl')}: {lead} on the mean, "
                + ("within the seeds' spread of each other" if v["within_spread"] else
                   f"{v['higher']} is higher in every seed") + "; covey - TRL per seed, on the same problems: "
                + ", ".join(f"{100 * d:+.1f}" for d in v["paired"].values()) + " points (one measurement's binomial "
                f"standard error is about {100 * s['binomial_se']:.1f} points).")

    rows = [[t, ", ".join(pct(r["points"][0]["accuracy"]) for r in mine), at("steps", t), at("minutes", t),
             at("minutes", t, "step"), f"{statistics.median(s['step_s'] for r in mine for s in r['steps']):.1f}",
             "/".join(str(r["steps"][-1]["step"]) for r in mine)]
            for t in TRAINERS if (mine := [r for r in runs if r["trainer"] == t])]
    lines = [header, "", table(["trainer", "untrained", f"step {steps} (mean; seeds)", f"{minutes:g} training min "
                                "(mean; seeds)", f"step at {minutes:g} min", "median s/step", "steps run"], rows), ""]
    lines += [verdict("steps", f"step {steps}")] if "steps" in summary else []
    lines += [verdict("minutes", f"first step past {minutes:g} training minutes: covey at step "
                                 f"{at('minutes', 'covey', 'step')}, TRL at step {at('minutes', 'trl', 'step')}")
              ] if "minutes" in summary else []
    points = [[r["trainer"], r["seed"], p["step"], p["samples"], f"{p['minutes']:.2f}", pct(p["accuracy"]), p["n"],
               ", ".join(p["tags"])] for r in runs for p in r["points"]]
    return "\n".join([*lines, "", table(["trainer", "seed", "step", "samples seen", "training min",
                                         "held-out accuracy", "n", "evaluated because"], points)]) + "\n"


def figure(runs: list[dict], path: Path, title: str) -> None:
    """Accuracy against samples seen and against training minutes: each seed's points, each trainer's mean over
    the seeds at the steps all its seeds reached."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for ax, x in zip(axes, ("samples", "minutes")):
        for trainer, color in zip(TRAINERS, ("tab:blue", "tab:orange")):
            mine = [{p["step"]: p for p in r["points"]} for r in runs if r["trainer"] == trainer]
            for points, marker in zip(mine, "os^vD<>"):
                ax.scatter([p[x] for p in points.values()], [100 * p["accuracy"] for p in points.values()], s=22,
                           color=color, marker=marker, alpha=0.45)
            steps = sorted(set.intersection(*map(set, mine))) if mine else []
            ax.plot([statistics.fmean(m[s][x] for m in mine) for s in steps], [100 * statistics.fmean(
                m[s]["accuracy"] for m in mine) for s in steps], color=color, lw=2, label=f"{trainer}, mean of seeds")
        ax.set(xlabel="samples seen" if x == "samples" else "training minutes", ylabel="held-out accuracy (%)")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.suptitle(title, fontsize=9)
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args, trainers = parse_args(argv)
    out = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="learn-vs-trl-"))
    (out / "logs").mkdir(parents=True, exist_ok=True)
    keys = base_overrides(args, out)
    from bench.trl_side import trl_grpo_kwargs
    from covey.config import as_dict, load_config
    cfg = load_config("grpo", keys)
    trl_grpo_kwargs(cfg)  # fails before any run if TRL cannot reproduce the config
    settings = {"steps": args.steps, "minutes": args.minutes, "eval_every": args.eval_every,
                "max_minutes": args.max_minutes, "device": args.device, "overrides": keys, "trainers": trainers}
    children = Children(out / "logs")
    with tempfile.TemporaryDirectory(prefix="learn-vs-trl-models-") as ckpt:  # saved policies, ~0.5 GB each
        runs = [r for seed in args.seeds.split(",") if seed.strip()
                for r in seed_runs(children, int(seed), args, trainers, keys, Path(ckpt))]
    summary, head = learn_summary(runs), header(runs, argv)
    trl_settings = next((r["trl_settings"] for r in runs if "trl_settings" in r), None)
    write_json(out / "learn-vs-trl.json", {"settings": settings, "covey_config": as_dict(cfg), "summary": summary,
                                           "trl_settings": trl_settings, "runs": runs})
    (out / "learn-vs-trl.md").write_text(markdown(runs, summary, head, args.steps, args.minutes))
    drawn = importlib.util.find_spec("matplotlib") is not None  # a GPU machine may lack it: the figure alone
    if drawn:
        figure(runs, out / "learn-vs-trl.png", head.splitlines()[0])
    print((out / "learn-vs-trl.md").read_text() + f"learn-vs-trl: wrote {out}/learn-vs-trl.md, .json"
          + (", .png" if drawn else " (no .png: matplotlib is not installed)"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
