"""What covey and TRL's GRPOTrainer learn from the same model, task, reward and hyperparameters (docs/results.md):
per seed each trainer in a child until step --steps AND --minutes of training time (workloads.Schedule), saving its
policy at the evaluation points; then one `covey eval` of the untrained model and every saved folder, both trainers'.

    python -m bench.learn --out bench/results/learn-vs-trl algo.ddof=1 algo.adv_eps=1e-4   # TRL's group std"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import math
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

from bench.harness import Children, machine, table, write_json
from bench.workloads import LEARN_SMOKE

TRAINERS = ("covey", "trl")
VIEWS = {"steps": "per-sample view", "minutes": "wall-clock view"}


def parse_args(argv: list[str]):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=30, help="every run reaches this step (the per-sample view)")
    p.add_argument("--minutes", type=float, default=12.0, help="and this much training time (the wall-clock view)")
    p.add_argument("--eval-every", type=int, default=10, help="held-out evaluation every K steps")
    p.add_argument("--max-minutes", type=float, default=0.0, help="end a run past this training time (0: no cap)")
    p.add_argument("--seeds", default="0,1")
    p.add_argument("--trainers", default="covey,trl", help="covey, trl or both (the comparison needs both)")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"), help="where both trainers run")
    p.add_argument("--out", default="", help="output folder (default: a temporary folder)")
    p.add_argument("--smoke", action="store_true", help="3 steps, 8 held-out problems, a few tokens")
    p.add_argument("overrides", nargs="*", help="covey key=value overrides, applied to both trainers")
    p.set_defaults(**({"steps": 3, "minutes": 0.01, "eval_every": 2} if "--smoke" in argv else {}))
    args = p.parse_args(argv)
    trainers = [t for t in args.trainers.split(",") if t]
    if args.steps < 1 or min(args.minutes, args.eval_every, args.max_minutes) < 0 or set(trainers) - set(TRAINERS):
        p.error("--steps must be >= 1, --minutes, --max-minutes and --eval-every >= 0, --trainers from covey, trl")
    return args, trainers


def base_overrides(args) -> list[str]:
    """Every child's keys but the seed: the device first."""
    return [f"train.device={args.device}", *(LEARN_SMOKE if args.smoke else []), *args.overrides]


def seed_runs(children: Children, seed: int, args, trainers: list[str], keys: list[str], ckpt: Path) -> list[dict]:
    """The trainers' runs on one seed, then `covey eval` of the untrained model and every saved folder (deleted)."""
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


def spread_verdict(a: dict, b: dict) -> dict:
    """Do the seed ranges of views `a` (covey) and `b` (TRL) overlap, whose mean is higher, a - b per seed."""
    difference = a["mean"] - b["mean"]
    return {"within_spread": a["low"] <= b["high"] and b["low"] <= a["high"], "difference": difference,
            "higher": TRAINERS[0] if difference > 0 else TRAINERS[1] if difference < 0 else "neither",
            "paired": {seed: acc - b["seeds"][seed] for seed, acc in a["seeds"].items() if seed in b["seeds"]}}


def learn_summary(runs: list[dict]) -> dict:
    """Per view both trainers have: the accuracy per seed, mean, range, n, verdict, binomial standard error."""
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
    """The header, a row per trainer (untrained, both views, the step at the minutes mark, speed), the verdicts."""
    def at(tag: str, trainer: str, what: str = "seeds") -> str:
        if not (v := summary.get(tag, {}).get(trainer)):
            return "-"
        return "/".join(map(str, v["step"].values())) if what == "step" else \
            f"{pct(v['mean'])} ({', '.join(pct(x) for x in v['seeds'].values())})"

    def verdict(tag: str, where: str) -> str:
        v = summary[tag]["verdict"]
        paired = ", ".join(f"{100 * d:+.1f}" for d in v["paired"].values())
        judged = ("within the seeds' spread of each other" if v["within_spread"] else
                  f"{v['higher']} is higher in every seed")
        return (f"- {VIEWS[tag]} ({where}): covey {at(tag, 'covey')} vs TRL {at(tag, 'trl')}: {judged}; covey - TRL "
                f"per seed, on the same problems: {paired} points (one measurement's binomial standard error is about "
                f"{100 * summary[tag]['binomial_se']:.1f}).")

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
    return "\n".join(lines) + "\n"


def figures(runs: list[dict], out: Path) -> None:
    """Held-out accuracy against steps and against training minutes, drawn by covey's own report figures."""
    from covey.report.data import AlgoData, RunData
    from covey.report.report import plot_accuracy

    def rows(r: dict) -> list[dict]:
        return [*({"step": s["step"], "reward/mean": 0.0, "time/step": s["step_s"]} for s in r["steps"]),
                *({"step": p["step"], "eval/accuracy": p["accuracy"]} for p in r["points"])]

    data = {t: AlgoData(t, [RunData(t, r["seed"], out, rows(r)) for r in runs if r["trainer"] == t]) for t in TRAINERS}
    for x in ("steps", "minutes"):
        plot_accuracy({t: d for t, d in data.items() if d.runs}, out / f"learn-vs-trl-{x}.png", x == "minutes")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args, trainers = parse_args(argv)
    out = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="learn-vs-trl-"))
    (out / "logs").mkdir(parents=True, exist_ok=True)
    keys = base_overrides(args)
    from bench.trl_side import trl_grpo_kwargs
    from covey.config import as_dict, load_config
    cfg = load_config("grpo", keys)
    trl_grpo_kwargs(cfg)  # fails before any run if TRL cannot reproduce the config
    children = Children(out / "logs")
    with tempfile.TemporaryDirectory(prefix="learn-vs-trl-models-") as ckpt:  # saved policies, ~0.5 GB each
        runs = [r for seed in args.seeds.split(",") if seed.strip()
                for r in seed_runs(children, int(seed), args, trainers, keys, Path(ckpt))]
    summary = learn_summary(runs)
    head = (f"Learning side by side, covey vs TRL's GRPOTrainer, {datetime.datetime.now():%Y-%m-%d %H:%M}; "
            f"{machine()}; torch threads per run: {'/'.join(sorted({str(r['threads']) for r in runs}))}.\n"
            f"Command: `python -m bench.learn {' '.join(argv)}`")
    write_json(out / "learn-vs-trl.json", {"argv": argv, "covey_config": as_dict(cfg), "summary": summary, "runs": runs,
                                           "trl_settings": next((r["trl_settings"] for r in runs if r["trainer"] ==
                                                                 "trl"), None)})
    (out / "learn-vs-trl.md").write_text(markdown(runs, summary, head, args.steps, args.minutes))
    if importlib.util.find_spec("matplotlib"):  # a GPU machine may lack it: the figures alone
        figures(runs, out)
    print((out / "learn-vs-trl.md").read_text() + f"learn-vs-trl: wrote {out}/learn-vs-trl.md, .json, -*.png")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
