"""Child of bench/learn_vs_trl.py: one training run that saves the policy at its evaluation points,
or the held-out evaluation of saved model folders.

    learn_run.py train --trainer covey|trl --steps N --minutes M --eval-every K --save-dir DIR
                       --result FILE [key=value ...]
    learn_run.py eval --result FILE [key=value ...] --folders LABEL=FOLDER ...

Both trainers read one covey config (the `grpo` preset plus the key=value overrides, which carry
train.seed and model.threads): covey trains it with `covey.train.loop.train`, TRL's GRPOTrainer
with the settings bench/trl_map.py derives from it. Training time is the wall clock from the
start of the first step to the end of the current one, minus the time spent saving the
evaluation folders (model loading and set-up before the first step are not counted, on
either side). Both sides then go through the same evaluation: `covey eval` of each saved
folder (covey.cli.eval.run_eval_command: greedy answers to the held-out problems, judged by
covey's verifier), in a process of its own. That is `covey eval`'s HF generate, not the fast
engine of covey's in-run evaluation, so a figure can differ slightly from what `covey train`
prints for the same model.

The covey run is `covey.train.loop.train` as `covey train` runs it, with four of the loop's
module-level names replaced here (the training code itself is untouched): `train_step` is
wrapped to time the step and save the policy at evaluation points (with covey's own
`save_final`), `out_of_time` applies the stop rule below, and `run_eval` / `save_on_main` are
skipped, because held-out accuracy is measured from the saved folders for both trainers and
the run's own end-of-run checkpoint (about 2 GB for 135M parameters) is never read. (The covey
log's last line says the run was "stopped by the time budget": the Schedule stops it through
`out_of_time`.)

Stop rule (Schedule): a run ends at the first step that is at least `--steps` AND at least
`--minutes` of training time. Evaluation points: step 0 (the untrained model), every
`--eval-every` steps, step `--steps`, the first step boundary past `--minutes`, and the last step.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

STEP_CAP = 1_000_000  # train.steps / max_steps given to the libraries: the Schedule stops the run


@dataclass(frozen=True)
class Schedule:
    """When a run stops and which of its steps are evaluated; `seconds` is training time after the step."""
    steps: int
    minutes: float
    eval_every: int

    def done(self, step: int, seconds: float) -> bool:
        return step >= self.steps and seconds >= 60 * self.minutes

    def tags(self, step: int, seconds: float, before: float) -> list[str]:
        """Why step `step` is evaluated (empty: it is not); `before` is the training time after the previous step."""
        limit = 60 * self.minutes
        tags = []
        if self.eval_every and step % self.eval_every == 0:
            tags.append("every")
        if step == self.steps:
            tags.append("steps")
        if limit > 0 and before < limit <= seconds:
            tags.append("minutes")
        if self.done(step, seconds):
            tags.append("final")
        return tags


class Tracker:
    """Training time, per-step records and saved evaluation points of one run (either trainer)."""

    def __init__(self, schedule: Schedule, samples_per_step: int, save_dir: Path):
        self.schedule, self.samples_per_step, self.save_dir = schedule, samples_per_step, save_dir
        self.steps: list[dict] = []
        self.points: list[dict] = []
        self.start: float | None = None
        self.saving = 0.0
        self.done = False

    def begin(self) -> None:
        if self.start is None:
            self.start = time.perf_counter()

    def end(self, step: int, step_s: float, save) -> None:
        """After optimizer step `step` (its own duration `step_s`): record, and save via save(folder) when due."""
        seconds = time.perf_counter() - self.start - self.saving
        before = self.steps[-1]["seconds"] if self.steps else 0.0
        self.steps.append({"step": step, "seconds": seconds, "step_s": step_s})
        tags = self.schedule.tags(step, seconds, before)
        if tags:
            t0 = time.perf_counter()
            folder = self.save_dir / f"step-{step:06d}"
            save(folder)
            self.saving += time.perf_counter() - t0
            self.points.append({"step": step, "samples": step * self.samples_per_step,
                                "minutes": seconds / 60, "tags": tags, "folder": str(folder)})
        self.done = self.schedule.done(step, seconds)

    def result(self, **extra) -> dict:
        import torch
        return {"steps": self.steps, "points": self.points, "threads": torch.get_num_threads(), **extra}


def samples_per_step(cfg) -> int:
    return cfg.rollout.prompts_per_step * cfg.rollout.group_size


def train_covey(args, overrides: list[str]) -> dict:
    from covey.config import load_config
    from covey.rollout.precision import resolve_precision
    from covey.runtime.precision import resolve_autocast
    from covey.train import loop
    from covey.train.checkpoint import save_final

    with tempfile.TemporaryDirectory(prefix="learn-covey-") as tmp:
        cfg = load_config("grpo", [*overrides, f"train.steps={STEP_CAP}", "train.max_minutes=0", "train.eval_every=0",
                                   "train.save_every=0", "train.samples_every=0", "train.progress=false",
                                   f"train.output_dir={tmp}", "train.run_name=covey"])
        tracker = Tracker(Schedule(args.steps, args.minutes, args.eval_every), samples_per_step(cfg), args.save_dir)
        step_fn = loop.train_step

        def tracked_step(run, *a, **k):
            tracker.begin()
            metrics = step_fn(run, *a, **k)
            tracker.end(run.step, metrics["time/step"], lambda folder: shutil.move(save_final(run), folder))
            tracker.steps[-1]["reward"] = metrics.get("reward/mean")
            print(f"covey step {run.step}: {tracker.steps[-1]['seconds']:.1f}s of training", flush=True)
            return metrics

        loop.train_step, loop.out_of_time = tracked_step, lambda run: tracker.done
        loop.run_eval = lambda run, feed: {"eval/accuracy": float("nan"), "eval/n": 0}  # measured from folders
        loop.save_on_main = lambda run, write: None
        print("learn_run: held-out accuracy is measured from the saved folders (learn_run.py eval)", flush=True)
        loop.train(cfg)
    return tracker.result(precision=resolve_autocast(cfg.model.autocast),
                          rollout_precision=resolve_precision(cfg.rollout.precision, "cpu"))


def trl_callback(tracker: Tracker, box: dict):
    from transformers import TrainerCallback

    class Track(TrainerCallback):
        """Times each optimizer step (generation included), saves at evaluation points, stops by the Schedule."""

        def on_step_begin(self, args, state, control, **kwargs):
            tracker.begin()
            self.t0 = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            trainer = box["trainer"]

            def save(folder):
                trainer.accelerator.unwrap_model(trainer.model).save_pretrained(folder, safe_serialization=True)
                trainer.processing_class.save_pretrained(folder)

            tracker.end(state.global_step, time.perf_counter() - self.t0, save)
            print(f"trl step {state.global_step}: {tracker.steps[-1]['seconds']:.1f}s of training", flush=True)
            if tracker.done:
                control.should_training_stop = True

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "reward" in logs and tracker.steps:
                tracker.steps[-1]["reward"] = logs["reward"]

    return Track()


def train_trl(args, overrides: list[str]) -> dict:
    import torch
    from trl import GRPOConfig, GRPOTrainer

    from covey.config import load_config
    from covey.models.load import resolve_model_path
    from covey.rewards.rules import correctness_reward
    from covey.runtime.precision import resolve_autocast
    from covey.tasks.data import load_task_data
    from covey.tasks.verifiers import resolve_verifier
    from trl_map import trl_dataset, trl_grpo_kwargs

    cfg = load_config("grpo", overrides)
    if cfg.model.threads:
        torch.set_num_threads(cfg.model.threads)
    data = load_task_data(cfg.task, cfg.train.seed)
    verifier = resolve_verifier(cfg.eval.metric, [ex.answer for ex in data.eval])
    if verifier != "math":  # covey's correctness reward, as TRL calls it, verifies with its default: math
        raise SystemExit(f"learn_run: eval.metric resolves to {verifier!r}; the TRL side scores with 'math'")
    bf16 = resolve_autocast(cfg.model.autocast) == "bfloat16"
    settings = trl_grpo_kwargs(cfg, micro_batch=args.trl_micro_batch, autocast_bf16=bf16)
    tracker = Tracker(Schedule(args.steps, args.minutes, args.eval_every), samples_per_step(cfg), args.save_dir)
    box = {}
    with tempfile.TemporaryDirectory(prefix="learn-trl-") as tmp:
        config = GRPOConfig(output_dir=tmp, max_steps=STEP_CAP, use_cpu=True, **settings, logging_steps=1,
                            report_to="none", save_strategy="no", disable_tqdm=True, dataloader_num_workers=0)
        box["trainer"] = GRPOTrainer(model=resolve_model_path(cfg.model.path), reward_funcs=correctness_reward,
                                     args=config, train_dataset=trl_dataset(data.train, cfg.task.system_prompt),
                                     callbacks=[trl_callback(tracker, box)])
        box["trainer"].train()
    return tracker.result(precision="bfloat16" if bf16 else "none", trl_settings=settings)


def evaluate_folders(overrides: list[str], folders: dict[str, str]) -> dict:
    """`covey eval` of each folder on the config's held-out problems: label -> accuracy, n, seconds."""
    from covey.cli.eval import run_eval_command
    from covey.config import load_config
    from covey.runtime.cpu import apply_cpu_settings

    cfg = load_config("grpo", overrides)
    apply_cpu_settings(cfg)
    out = {}
    for label, folder in folders.items():
        cfg.model.path = folder
        t0 = time.perf_counter()
        result = run_eval_command(cfg)
        out[label] = {"accuracy": result["eval/accuracy"], "n": result["eval/n"], "eval_s": time.perf_counter() - t0}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("mode", choices=("train", "eval"))
    parser.add_argument("--trainer", choices=("covey", "trl"))
    parser.add_argument("--result", required=True)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--minutes", type=float, default=12.0)
    parser.add_argument("--eval-every", type=int, default=10)
    parser.add_argument("--save-dir", type=Path)
    parser.add_argument("--trl-micro-batch", type=int, default=0)
    parser.add_argument("--folders", nargs="*", default=[], help="LABEL=FOLDER of the eval mode")
    parser.add_argument("overrides", nargs="*", help="covey key=value overrides (both trainers)")
    args = parser.parse_intermixed_args()
    if args.mode == "eval":
        result = evaluate_folders(args.overrides, dict(item.split("=", 1) for item in args.folders))
    else:
        args.save_dir.mkdir(parents=True, exist_ok=True)
        result = (train_covey if args.trainer == "covey" else train_trl)(args, args.overrides)
    Path(args.result).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
