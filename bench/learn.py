"""What covey and TRL's GRPOTrainer learn from the same model, task, reward and hyperparameters.

    python -m bench.learn --out bench/results/learn-vs-trl algo.ddof=1 algo.adv_eps=1e-4
    python -m bench.learn --smoke --trainers covey    # the pipeline on the tiny model, seconds

The two overrides align covey's group std with TRL's (Bessel's correction, +1e-4), so that both run the
same algorithm and a difference beyond the seeds' spread is a bug. covey's default run (`covey train`) and
TRL's GRPOTrainer with the same settings (mapped by bench/trl_side.py, which refuses what does not map),
seeds interleaved (covey seed 0, TRL seed 0, covey seed 1, ...), each run a child process with the same torch
threads, each to step --steps AND --minutes of training time (bench/workloads.py, Schedule). The held-out
accuracy (greedy, covey's verifier) is measured at step 0, every --eval-every steps, step --steps and the
first step past --minutes, from folders each run saves there and one `covey eval` per seed (the same
evaluation for both trainers). Each seed draws its own problems, shared by its two runs. Training time
excludes loading, evaluation and saving on both sides. Run it alone on a quiet machine: about 2 hours for
two seeds on a 2-core CPU. A run that stops halfway continues where it stopped (finished seeds are kept
under <out>/runs/). Output under --out: learn-vs-trl.json (every run, point and setting), learn-vs-trl.md
(the two views, their verdicts, one row per evaluation point), learn-vs-trl.png; logs/ has each child's log.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import shutil
import sys
import tempfile
from pathlib import Path

from bench.harness import Children, machine, write_json
from bench.report import figure, learn_summary, markdown
from bench.workloads import LEARN_SMOKE


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=30, help="every run reaches this step (the per-sample view)")
    p.add_argument("--minutes", type=float, default=12.0, help="... and this much training time (the wall-clock view)")
    p.add_argument("--eval-every", type=int, default=10, help="held-out evaluation every K steps")
    p.add_argument("--seeds", default="0,1")
    p.add_argument("--trainers", default="covey,trl", help="covey, trl or both (the comparison needs both)")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"), help="where both trainers and the "
                   "evaluation run (covey's train.device; TRL's use_cpu follows it)")
    p.add_argument("--max-minutes", type=float, default=0.0, help="end every run at the first step past this much "
                   "training time, even short of --steps (0: no cap)")
    p.add_argument("--out", default="", help="output folder (default: a temporary folder)")
    p.add_argument("--smoke", action="store_true", help="tiny random model, 3 steps, 8 held-out problems")
    p.add_argument("overrides", nargs="*", help="covey key=value overrides, applied to both trainers")
    args = p.parse_args(argv)
    if args.smoke:  # again, with the smoke run's defaults
        p.set_defaults(steps=3, minutes=0.01, eval_every=2)
        args = p.parse_args(argv)
    trainers = [t for t in args.trainers.split(",") if t]
    if (args.steps < 1 or args.minutes < 0 or args.eval_every < 0 or args.max_minutes < 0
            or not set(trainers) <= {"covey", "trl"}):
        p.error("--steps must be >= 1, --minutes, --max-minutes and --eval-every >= 0, --trainers from covey, trl")
    return args, trainers


def base_overrides(args, work: Path | None) -> list[str]:
    """Overrides shared by every child (seed excluded): the device first; --smoke builds the tiny model
    into `work` unless model.path is given."""
    items = [f"train.device={args.device}"]
    if args.smoke:
        if not any(o.startswith("model.path=") for o in args.overrides):
            from covey.models.tiny import build_tiny_model
            items.append(f"model.path={build_tiny_model(work / 'tiny-model')}")
        items += LEARN_SMOKE
    return items + list(args.overrides)


def train_run(children: Children, trainer: str, seed: int, args, overrides: list[str], ckpt: Path) -> dict:
    flags = ["--steps", str(args.steps), "--minutes", str(args.minutes), "--eval-every", str(args.eval_every),
             "--max-minutes", str(args.max_minutes), "--save-dir", str(ckpt / f"{trainer}-seed{seed}")]
    result = children.must(f"{trainer}_side", "learn", f"{trainer}-seed{seed}", [*overrides, f"train.seed={seed}",
                                                                                  *flags], malloc=trainer == "covey")
    return {"trainer": trainer, "seed": seed, **{k: v for k, v in result.items() if k != "wall_s"}}


def evaluate_seed(children: Children, seed: int, runs: list[dict], base_folder: str, overrides: list[str]) -> None:
    """`covey eval` of the untrained model and of every saved folder of the seed's runs, in one process;
    deletes the folders, fills each point's accuracy, puts the untrained model first as step 0."""
    folders = {"base": base_folder, **{f"{r['trainer']}-{p['step']}": p["folder"] for r in runs for p in r["points"]}}
    scores = children.must("covey_side", "eval", f"eval-seed{seed}", [*overrides, f"train.seed={seed}", "--folders",
                                                                     *(f"{k}={v}" for k, v in folders.items())],
                           malloc=True)
    for folder in {Path(p["folder"]).parent for r in runs for p in r["points"]}:
        shutil.rmtree(folder, ignore_errors=True)
    for r in runs:
        for p in r["points"]:
            p.update(accuracy=scores[f"{r['trainer']}-{p['step']}"]["accuracy"],
                     n=scores[f"{r['trainer']}-{p['step']}"]["n"], folder=None)
        r["points"].insert(0, {"step": 0, "samples": 0, "minutes": 0.0, "tags": ["base"],
                               "accuracy": scores["base"]["accuracy"], "n": scores["base"]["n"]})
    print(f"learn-vs-trl: seed {seed}: " + "; ".join(
        f"{r['trainer']} {100 * r['points'][0]['accuracy']:.1f}% -> {100 * r['points'][-1]['accuracy']:.1f}% "
        f"at step {r['points'][-1]['step']}" for r in runs), flush=True)


def seed_runs(children: Children, seed: int, args, trainers: list[str], overrides: list[str], out: Path,
              settings: dict, ckpt: Path) -> list[dict]:
    """The trainers on one seed, evaluated; reused from <out>/runs/ when an earlier call finished them."""
    done = out / "runs" / f"seed{seed}.json"
    if done.exists() and (saved := json.loads(done.read_text()))["settings"] == settings:
        print(f"learn-vs-trl: seed {seed}: reusing {done}", flush=True)
        return saved["runs"]
    from covey.config import load_config
    from covey.models.load import resolve_model_path
    base = resolve_model_path(load_config("grpo", overrides).model.path)
    runs = [train_run(children, trainer, seed, args, overrides, ckpt) for trainer in trainers]
    evaluate_seed(children, seed, runs, base, overrides)
    write_json(done, {"settings": settings, "runs": runs})
    return runs


def header(runs: list[dict], argv: list[str]) -> str:
    import transformers
    try:
        import trl
        versions = f"TRL {trl.__version__} GRPOTrainer (transformers {transformers.__version__})"
    except ImportError:
        versions = f"TRL's GRPOTrainer (not installed; transformers {transformers.__version__})"
    threads = "/".join(sorted({str(r.get("threads")) for r in runs}))
    where = machine()
    if any(str(r.get("device", "cpu")).startswith("cuda") for r in runs):
        import torch
        where += f"; GPU {torch.cuda.get_device_name()}" if torch.cuda.is_available() else "; GPU"
    return (f"Learning side by side, covey vs {versions}, {datetime.datetime.now():%Y-%m-%d %H:%M}; {where}; torch "
            f"threads per run: {threads}.\nCommand: `python -m bench.learn {' '.join(argv)}`")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args, trainers = parse_args(argv)
    out = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="learn-vs-trl-"))
    for sub in ("runs", "logs"):
        (out / sub).mkdir(parents=True, exist_ok=True)
    overrides = base_overrides(args, out)
    from bench.trl_side import trl_grpo_kwargs
    from covey.config import as_dict, load_config
    cfg = load_config("grpo", overrides)
    trl_grpo_kwargs(cfg)  # fails before any run if TRL cannot reproduce the config
    settings = {"steps": args.steps, "minutes": args.minutes, "eval_every": args.eval_every,
                "max_minutes": args.max_minutes, "device": args.device, "overrides": overrides, "trainers": trainers}
    children = Children(out / "logs")
    with tempfile.TemporaryDirectory(prefix="learn-vs-trl-models-") as ckpt:  # saved policies, ~0.5 GB each
        runs = [r for seed in (int(s) for s in args.seeds.split(",") if s.strip())
                for r in seed_runs(children, seed, args, trainers, overrides, out, settings, Path(ckpt))]
    summary, head = learn_summary(runs), header(runs, argv)
    trl_settings = next((r["trl_settings"] for r in runs if r["trainer"] == "trl"), None)
    write_json(out / "learn-vs-trl.json", {"settings": settings, "covey_config": as_dict(cfg),
                                           "trl_settings": trl_settings, "summary": summary, "runs": runs})
    (out / "learn-vs-trl.md").write_text(markdown(runs, summary, head, args.steps, args.minutes))
    drawn = importlib.util.find_spec("matplotlib") is not None  # a GPU machine may lack it: the figure alone
    if drawn:
        figure(runs, out / "learn-vs-trl.png", head.splitlines()[0], args.minutes)
    print((out / "learn-vs-trl.md").read_text())
    print(f"learn-vs-trl: wrote {out / 'learn-vs-trl.md'}, .json" + (" and .png" if drawn else
                                                                      " (no .png: matplotlib is not installed)"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
