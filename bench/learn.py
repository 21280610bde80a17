"""What covey and TRL's GRPOTrainer learn from the same model, task, reward and hyperparameters.

    python -m bench.learn --out bench/results/learn-vs-trl algo.ddof=1 algo.adv_eps=1e-4
    python -m bench.learn --smoke --trainers covey    # the pipeline on the tiny model, seconds

The measurement aligns covey's group std with TRL's (Bessel's correction, +1e-4: the two overrides
above), so that both run the same algorithm and a difference beyond the seeds' spread is a bug.

The measurement (run it alone on a quiet machine): covey's default run (`covey train`: GRPO on
SmolLM2-135M-Instruct, 2-digit x 1-digit multiplication, 8 prompts x 8 samples, 32 new tokens,
temperature 0.7) and TRL 1.16's GRPOTrainer with the same settings, seeds 0 and 1, interleaved (covey
seed 0, TRL seed 0, covey seed 1, TRL seed 1), each run in a process of its own with the same torch
threads. Each run goes to step 30 AND at least 12 minutes of training time (bench/workloads.py,
Schedule); the held-out accuracy (greedy, covey's verifier, 200 problems) is measured at step 0, every
10 steps, step 30 and the first step past 12 minutes, from folders each run saves there and one `covey
eval` per seed (the same evaluation for both trainers). Each seed draws its own train and held-out
problems, as `covey train train.seed=S` does, and a seed's two runs share them. About 55 min per seed
on a 2-core CPU, **about 2 hours** for the two seeds; peak memory TRL ~10 GB, covey ~5 GB, one at a
time; each saved folder takes 0.5 GB of disk until its seed is evaluated. A run that stops halfway
continues where it stopped (finished seeds are kept under <out>/runs/).

Same on both sides (bench/trl_side.py maps covey's config to TRL's and refuses what does not map):
model folder, train/held-out problems, prompts (TRL gets the chat messages covey's `format_prompts`
templates), reward (covey's `correctness_reward`, math verifier), B, G, max new tokens, sampling, lr
(constant, no warm-up), AdamW, max_grad_norm, beta with k3 in the loss, clip eps, group std
normalisation, one optimizer step per rollout, the seed, the training precision, loss aggregation
(covey's `seq_mean_token_mean` is TRL's `loss_type="grpo"`). Known differences that remain (reported,
not patched): the group std (see above); each library orders the prompts with its own generator; the
covey child gets covey's glibc malloc settings (covey/runtime/cpu.py), TRL runs as it ships
(`--trl-malloc` gives TRL the same); on a CPU with native bf16 covey samples from a bf16 copy and
autocasts its passes, TRL gets `bf16=True` (it samples with the training weights). Training time
excludes model loading, every evaluation and the saving of evaluation folders, on both sides.

Output under --out: learn-vs-trl.json (every run, point and setting), learn-vs-trl.md (the two views,
their verdicts, one row per evaluation point), learn-vs-trl.png (accuracy vs samples seen and vs training
minutes); logs/ has each child's log.
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

from bench.harness import Children, machine
from bench.report import figure, learn_summary, markdown
from bench.workloads import LEARN_SMOKE


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=30, help="every run reaches this step (the per-sample view)")
    p.add_argument("--minutes", type=float, default=12.0, help="... and this much training time (the wall-clock view)")
    p.add_argument("--eval-every", type=int, default=10, help="held-out evaluation every K steps")
    p.add_argument("--seeds", default="0,1")
    p.add_argument("--trainers", default="covey,trl", help="covey, trl or both (the comparison needs both)")
    p.add_argument("--threads", type=int, default=0, help="torch threads of every run (model.threads; 0: torch's "
                   "default, as `covey train` leaves it)")
    p.add_argument("--trl-micro-batch", type=int, default=0, help="TRL's per_device_train_batch_size "
                   "(0: covey's algo.micro_batch_size); the gradient does not depend on it")
    p.add_argument("--trl-malloc", action="store_true", help="give TRL covey's glibc malloc settings too")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"), help="where both trainers and the "
                   "evaluation run (covey's train.device; TRL's use_cpu follows it)")
    p.add_argument("--max-minutes", type=float, default=0.0, help="end every run at the first step past this much "
                   "training time, even short of --steps (0: no cap)")
    p.add_argument("--out", default="", help="output folder (default: a temporary folder)")
    p.add_argument("--smoke", action="store_true", help="tiny random model, 3 steps, 8 held-out problems")
    p.add_argument("overrides", nargs="*", help="covey key=value overrides, applied to both trainers")
    args = p.parse_args(argv)
    if args.smoke:
        args.steps, args.minutes, args.eval_every = 3, 0.01, 2
    args.trainer_list = [t for t in args.trainers.split(",") if t]
    if (args.steps < 1 or args.minutes < 0 or args.eval_every < 0 or args.max_minutes < 0
            or not set(args.trainer_list) <= {"covey", "trl"}):
        p.error("--steps must be >= 1, --minutes, --max-minutes and --eval-every >= 0, --trainers from covey, trl")
    return args


def base_overrides(args, work: Path) -> list[str]:
    """Overrides shared by every child (seed excluded): the device first; --smoke builds the tiny model
    into `work` unless model.path is given."""
    items = [f"train.device={args.device}", *([f"model.threads={args.threads}"] if args.threads else [])]
    if args.smoke:
        if not any(o.startswith("model.path=") for o in args.overrides):
            from covey.models.tiny import build_tiny_model
            items.append(f"model.path={build_tiny_model(work / 'tiny-model')}")
        items += LEARN_SMOKE
    return items + list(args.overrides)


def check_mapping(overrides: list[str]) -> dict:
    """Fail before any run if TRL cannot reproduce the config; returns covey's config for the record."""
    from bench.trl_side import trl_grpo_kwargs
    from covey.config import as_dict, load_config
    cfg = load_config("grpo", overrides)
    trl_grpo_kwargs(cfg)
    return as_dict(cfg)


def train_run(children: Children, trainer: str, seed: int, args, overrides: list[str]) -> dict:
    flags = ["--steps", str(args.steps), "--minutes", str(args.minutes), "--eval-every", str(args.eval_every),
             "--max-minutes", str(args.max_minutes), "--save-dir", str(args.ckpt / f"{trainer}-seed{seed}")]
    flags += ["--micro-batch", str(args.trl_micro_batch)] if trainer == "trl" else []
    result = children.must(f"{trainer}_side", "learn", f"{trainer}-seed{seed}",
                           [*overrides, f"train.seed={seed}", *flags], malloc=trainer == "covey" or args.trl_malloc)
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
        base = scores["base"]
        r["points"].insert(0, {"step": 0, "samples": 0, "minutes": 0.0, "tags": ["base"],
                               "accuracy": base["accuracy"], "n": base["n"]})
    print(f"learn-vs-trl: seed {seed}: " + "; ".join(
        f"{r['trainer']} {100 * r['points'][0]['accuracy']:.1f}% -> {100 * r['points'][-1]['accuracy']:.1f}% "
        f"at step {r['points'][-1]['step']}" for r in runs), flush=True)


def seed_runs(children: Children, seed: int, args, overrides: list[str], out: Path, settings: dict) -> list[dict]:
    """The trainers on one seed, evaluated; reused from <out>/runs/ when an earlier call finished them."""
    done = out / "runs" / f"seed{seed}.json"
    if done.exists():
        saved = json.loads(done.read_text())
        if saved["settings"] == settings:
            print(f"learn-vs-trl: seed {seed}: reusing {done}", flush=True)
            return saved["runs"]
    from covey.config import load_config
    from covey.models.load import resolve_model_path
    base = resolve_model_path(load_config("grpo", overrides).model.path)
    runs = [train_run(children, trainer, seed, args, overrides) for trainer in args.trainer_list]
    evaluate_seed(children, seed, runs, base, overrides)
    done.write_text(json.dumps({"settings": settings, "runs": runs}, indent=1))
    return runs


def header(runs: list[dict], argv: list[str]) -> str:
    import transformers
    try:
        import trl
        versions = f"TRL {trl.__version__} GRPOTrainer (transformers {transformers.__version__})"
    except ImportError:
        versions = f"TRL's GRPOTrainer (not installed; transformers {transformers.__version__})"
    threads = "/".join(sorted({str(r.get("threads")) for r in runs}))
    when = datetime.datetime.now().strftime("%Y-%m-%d %H:%M")
    where = machine()
    if any(str(r.get("device", "cpu")).startswith("cuda") for r in runs):
        import torch
        where += f"; GPU {torch.cuda.get_device_name()}" if torch.cuda.is_available() else "; GPU"
    return (f"Learning side by side, covey vs {versions}, {when}; {where}; torch threads per run: {threads}.\n"
            f"Command: `python -m bench.learn {' '.join(argv)}`")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    out = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="learn-vs-trl-"))
    for sub in ("runs", "logs"):
        (out / sub).mkdir(parents=True, exist_ok=True)
    overrides = base_overrides(args, out)
    covey_config = check_mapping(overrides)
    settings = {"steps": args.steps, "minutes": args.minutes, "eval_every": args.eval_every,
                "max_minutes": args.max_minutes, "device": args.device, "overrides": overrides,
                "trainers": args.trainer_list, "trl_micro_batch": args.trl_micro_batch, "trl_malloc": args.trl_malloc}
    children = Children(out / "logs")
    with tempfile.TemporaryDirectory(prefix="learn-vs-trl-models-") as ckpt:  # saved policies, ~0.5 GB each
        args.ckpt = Path(ckpt)
        runs = [r for seed in (int(s) for s in args.seeds.split(",") if s.strip())
                for r in seed_runs(children, seed, args, overrides, out, settings)]
    summary, head = learn_summary(runs), header(runs, argv)
    trl_settings = next((r["trl_settings"] for r in runs if r["trainer"] == "trl"), None)
    (out / "learn-vs-trl.json").write_text(json.dumps({"settings": settings, "covey_config": covey_config,
                                                       "trl_settings": trl_settings, "summary": summary,
                                                       "runs": runs}, indent=1))
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
