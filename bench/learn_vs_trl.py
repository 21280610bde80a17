"""What covey and TRL's GRPOTrainer learn from the same model, task, reward and hyperparameters.

    .venv/bin/python bench/learn_vs_trl.py --out bench/results/learn-vs-trl algo.ddof=1 algo.adv_eps=1e-4
    .venv/bin/python bench/learn_vs_trl.py --smoke         # the pipeline on the tiny model, ~3 min

The measurement aligns covey's group std with TRL's (Bessel's correction, +1e-4: the two overrides
above), so that both run the same algorithm and a difference beyond the seeds' spread is a bug.

The measurement (run it alone on a quiet machine; nothing else on the cores): covey's default run
(`covey train`: GRPO on SmolLM2-135M-Instruct, 2-digit x 1-digit multiplication, 8 prompts x 8
samples, 32 new tokens, temperature 0.7) and TRL 1.16's GRPOTrainer with the same settings, seeds
0 and 1, interleaved (covey seed 0, TRL seed 0, covey seed 1, TRL seed 1), each run in a process of
its own with the same torch threads. Each run goes to step 30 AND at least 12 minutes of training
time; the held-out accuracy (greedy, covey's verifier, 200 problems) is measured at step 0, every 10
steps, step 30 and the first step past 12 minutes. Each seed draws its own train and held-out
problems, as `covey train train.seed=S` does, and a seed's two runs share them.

Expected duration, from bench/results (2-core AMD EPYC: covey ~12 s/step with native bf16, ~20
s/step in fp32; TRL ~50 s/step either way, on the benchmark workload, which has as many tokens
per step as this one) and from the smoke run: covey passes step 30 and goes on to the 12-minute
mark (~60 steps with bf16, ~36 in fp32; ~13 min with loading); TRL needs ~25 min for 30 steps
(~27 min with loading); about 11 evaluations per seed (step 0, covey's 4-7 points, TRL's 4),
each a `covey eval` of 200 prompts with HF generate and up to 64 new tokens, ~1-1.5 min: ~15 min
per seed. About 55 min per seed, **about 2 hours** for the two seeds. Peak memory: TRL ~10 GB,
covey ~5 GB, one at a time; each saved evaluation folder takes 0.5 GB of disk until its seed is
evaluated. A run that stops halfway continues where it stopped (finished seeds are kept under
<out>/runs/).

Output under --out: learn-vs-trl.json (every run, point and setting), learn-vs-trl.md (the two views,
their verdicts, one row per evaluation point) and learn-vs-trl.png (accuracy vs samples seen and vs
training minutes; each trainer's mean over seeds with each seed's points); logs/ has each child's log.

Same on both sides (bench/trl_map.py maps covey's config to TRL's and refuses what does not map):
model folder, train/held-out problems (`load_task_data(task, seed)`), prompts (TRL gets the chat
messages covey's `format_prompts` templates), reward (covey's `correctness_reward`, math verifier),
B, G, max new tokens, temperature / top-p / top-k, lr (constant, no warm-up), AdamW betas and weight
decay, max_grad_norm, beta with k3 in the loss, clip eps, group std normalisation, one optimizer
step per rollout (TRL: steps_per_generation = gradient_accumulation_steps, num_iterations=1), the
seed, the training precision. Loss aggregation: covey's default `algo.loss_agg=seq_mean_token_mean`
(1/N sum_i 1/|o_i| sum_t, GRPO as Shao et al. 2024, arXiv:2402.03300, write it) is TRL's
`loss_type="grpo"` (each micro-batch's mean of per-sequence token means, divided by the accumulation
steps: with equal micro-batches, the mean over the step's N sequences); TRL's own default, "dapo",
would normalise by tokens instead.

Known differences that remain (reported, not patched): TRL's group std uses Bessel's correction and
+1e-4, covey's the population std + 1e-6 (advantages ~7% larger in covey for G=8; pass
algo.ddof=1 algo.adv_eps=1e-4 to align covey); each library orders the prompts with its own generator; covey's
`covey train` restarts itself with glibc malloc settings (covey/runtime/cpu.py) and the covey child
gets them, TRL runs as it ships (`--trl-malloc` gives TRL the same); on a CPU with native bf16,
covey samples from a bf16 copy of the policy and autocasts its passes to bf16, while TRL gets
`bf16=True` (accelerate's bf16 autocast of its passes; it samples with the training weights), so the
two sample in different precisions there; on a CPU without it both run in fp32. Training time = wall
clock from the first step's start, minus the time spent saving evaluation folders; model loading and
every evaluation are excluded on both sides (bench/learn_run.py).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from learn_report import figure, markdown, summarize  # noqa: E402

from covey.runtime.cpu import MALLOC_ENV  # noqa: E402

SMOKE = ["task.train_size=32", "task.eval_size=8", "rollout.prompts_per_step=2", "rollout.group_size=4",
         "rollout.max_new_tokens=8", "rollout.eval_max_new_tokens=8", "algo.micro_batch_size=4"]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=30, help="every run reaches this step (the per-sample view)")
    p.add_argument("--minutes", type=float, default=12.0, help="... and this much training time (the wall-clock view)")
    p.add_argument("--eval-every", type=int, default=10, help="held-out evaluation every K steps")
    p.add_argument("--seeds", default="0,1")
    p.add_argument("--threads", type=int, default=0, help="torch threads of every run (model.threads; 0: torch's "
                   "default, as `covey train` leaves it)")
    p.add_argument("--trl-micro-batch", type=int, default=0, help="TRL's per_device_train_batch_size "
                   "(0: covey's algo.micro_batch_size); the gradient does not depend on it")
    p.add_argument("--trl-malloc", action="store_true", help="give TRL covey's glibc malloc settings too")
    p.add_argument("--out", default="", help="output folder (default: a temporary folder)")
    p.add_argument("--smoke", action="store_true", help="tiny random model, 4 steps, 8 held-out problems")
    p.add_argument("overrides", nargs="*", help="covey key=value overrides, applied to both trainers")
    args = p.parse_args(argv)
    if args.smoke:
        args.steps, args.minutes, args.eval_every = 4, 0.15, 2
    if args.steps < 1 or args.minutes < 0 or args.eval_every < 0:
        p.error("--steps must be >= 1, --minutes and --eval-every >= 0")
    return args


def base_overrides(args, work: Path) -> list[str]:
    """Overrides shared by every child (seed excluded); --smoke builds the tiny model into `work`."""
    items = [f"model.threads={args.threads}"] if args.threads else []
    if args.smoke:
        from covey.models.tiny import build_tiny_model
        items += [f"model.path={build_tiny_model(work / 'tiny-model')}", *SMOKE]
    return items + list(args.overrides)


def check_mapping(overrides: list[str]) -> dict:
    """Fail before any run if TRL cannot reproduce the config; returns covey's config for the record."""
    from covey.config import as_dict, load_config
    from trl_map import trl_grpo_kwargs
    cfg = load_config("grpo", overrides)
    trl_grpo_kwargs(cfg)
    return as_dict(cfg)


def run_child(argv: list[str], log: Path, env: dict) -> None:
    print(f"learn-vs-trl: {' '.join(argv)}  (log: {log})", flush=True)
    with open(log, "w") as f:
        done = subprocess.run([sys.executable, str(HERE / "learn_run.py"), *argv], stdout=f,
                              stderr=subprocess.STDOUT, cwd=HERE.parent, env=env)
    if done.returncode != 0:
        raise SystemExit(f"learn-vs-trl: {argv[0]} failed (exit {done.returncode}), log {log}:\n"
                         f"{log.read_text()[-3000:]}")


def child_env(with_malloc: bool) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in MALLOC_ENV}
    return {**env, **MALLOC_ENV} if with_malloc else env


def train_run(trainer: str, seed: int, args, overrides: list[str], out: Path) -> dict:
    result = out / "runs" / f"{trainer}-seed{seed}.train.json"
    run_child(["train", *overrides, f"train.seed={seed}", "--trainer", trainer, "--steps", str(args.steps),
               "--minutes", str(args.minutes), "--eval-every", str(args.eval_every),
               "--save-dir", str(args.ckpt / f"{trainer}-seed{seed}"), "--result", str(result),
               "--trl-micro-batch", str(args.trl_micro_batch)],
              out / "logs" / f"{trainer}-seed{seed}.log", child_env(trainer == "covey" or args.trl_malloc))
    return {"trainer": trainer, "seed": seed, **json.loads(result.read_text())}


def evaluate_seed(seed: int, runs: list[dict], base_folder: str, overrides: list[str], out: Path) -> None:
    """`covey eval` of the untrained model and of every saved folder of the seed's runs, in one process;
    deletes the folders, fills each point's accuracy, puts the untrained model first as step 0."""
    folders = {"base": base_folder}
    folders.update({f"{r['trainer']}-{p['step']}": p["folder"] for r in runs for p in r["points"]})
    result = out / "runs" / f"eval-seed{seed}.json"
    run_child(["eval", *overrides, f"train.seed={seed}", "--result", str(result), "--folders",
               *(f"{k}={v}" for k, v in folders.items())], out / "logs" / f"eval-seed{seed}.log", child_env(True))
    scores = json.loads(result.read_text())
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


def seed_runs(seed: int, args, overrides: list[str], out: Path, settings: dict) -> list[dict]:
    """Both trainers on one seed, evaluated; reused from <out>/runs/ when an earlier call finished them."""
    done = out / "runs" / f"seed{seed}.json"
    if done.exists():
        saved = json.loads(done.read_text())
        if saved["settings"] == settings:
            print(f"learn-vs-trl: seed {seed}: reusing {done}", flush=True)
            return saved["runs"]
    from covey.config import load_config
    from covey.models.load import resolve_model_path
    base = resolve_model_path(load_config("grpo", overrides).model.path)
    runs = [train_run(trainer, seed, args, overrides, out) for trainer in ("covey", "trl")]
    evaluate_seed(seed, runs, base, overrides, out)
    done.write_text(json.dumps({"settings": settings, "runs": runs}, indent=1))
    return runs


def header(runs: list[dict], argv: list[str]) -> str:
    from bench_grpo import machine
    import transformers
    import trl
    threads = "/".join(sorted({str(r.get("threads")) for r in runs}))
    when = datetime.datetime.now().strftime("%Y-%m-%d %H:%M")
    return (f"Learning side by side, covey vs TRL {trl.__version__} GRPOTrainer (transformers "
            f"{transformers.__version__}), {when}; {machine()}; torch threads per run: {threads}.\n"
            f"Command: `.venv/bin/python bench/learn_vs_trl.py {' '.join(argv)}`")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    out = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="learn-vs-trl-"))
    for sub in ("runs", "logs"):
        (out / sub).mkdir(parents=True, exist_ok=True)
    overrides = base_overrides(args, out)
    covey_config = check_mapping(overrides)
    settings = {"steps": args.steps, "minutes": args.minutes, "eval_every": args.eval_every, "overrides": overrides,
                "trl_micro_batch": args.trl_micro_batch, "trl_malloc": args.trl_malloc}
    with tempfile.TemporaryDirectory(prefix="learn-vs-trl-models-") as ckpt:  # saved policies, ~0.5 GB each
        args.ckpt = Path(ckpt)
        runs = [r for seed in (int(s) for s in args.seeds.split(",") if s.strip())
                for r in seed_runs(seed, args, overrides, out, settings)]
    summary = summarize(runs)
    head = header(runs, argv)
    trl_settings = next((r["trl_settings"] for r in runs if r["trainer"] == "trl"), None)
    (out / "learn-vs-trl.json").write_text(json.dumps({"settings": settings, "covey_config": covey_config,
                                                       "trl_settings": trl_settings, "summary": summary,
                                                       "runs": runs}, indent=1))
    (out / "learn-vs-trl.md").write_text(markdown(runs, summary, head, args.steps, args.minutes))
    figure(runs, out / "learn-vs-trl.png", head.splitlines()[0], args.minutes)
    print((out / "learn-vs-trl.md").read_text())
    print(f"learn-vs-trl: wrote {out / 'learn-vs-trl.md'}, .json and .png")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
