"""The covey side of every benchmark, one role per child process:

    python -m bench.covey_side speed|gpu|learn|eval|decode|device|build --result FILE [options] [key=value ...]

covey runs through its public step API, as `covey train` does: `open_run` (here without the held-out
evaluation before training) -> `steps` (one step per iteration; `break` stops early) -> `finish` (here
without evaluation or saving). Measurements read covey's own step metrics (time/generate, time/score,
time/logprobs, time/update, time/step, memory/gpu_peak_mb/*) and hooks on `session.run.policy` (the FLOP
counter); learning runs save their evaluation points with covey's `save_final`.

- speed: the CPU workload (bench/workloads.py), FLOPs of the training passes per step;
- gpu: the GPU workload on a model folder with fixed-length responses (the engine's end-of-sequence
  token taken away), then the decode step against its floor and, with --profile, one more step under
  torch.profiler (bench/probes.py);
- learn: a learning run to its Schedule's stop (bench/workloads.py), saving the policy at its points;
- eval: `covey eval` of saved folders (greedy answers to the held-out problems, covey's verifier), the
  same evaluation for both trainers' folders; `covey eval`'s HF generate, so a figure can differ
  slightly from what `covey train` prints for the same model;
- decode, device, build: rollout.decode modes timed, the device's peaks, a random Qwen2 model folder.
"""

from __future__ import annotations

import argparse
import contextlib
import shutil
import tempfile
import time
from pathlib import Path

from bench.harness import PHASES, LinearFlops, StepRecord, measure_device, peak_gpu_bytes, say, step_result, write_json
from bench.probes import StepEvents, decode_details, decode_modes, held_bytes, innermost, profile_step
from bench.workloads import STEP_CAP, WORKLOADS, Schedule, Tracker, build_model, cpu_keys, gpu_keys, varied_reward
from covey.config import load_config
from covey.runtime.precision import resolve_autocast
from covey.train.checkpoint import save_final
from covey.train.loop import finish, open_run, steps


@contextlib.contextmanager
def covey_run(cfg, reward_funcs=None):
    """An open covey run, no held-out evaluation before it; finished without evaluation or saving
    (the benchmark measures and saves by itself), closed if the body fails."""
    session = open_run(cfg, reward_funcs, evaluate_before=False)
    try:
        yield session
        finish(session, evaluate=False, save=False)
    finally:
        session.close()


def role_speed(args) -> dict:
    """The CPU workload: each step's phases, response tokens and training FLOPs."""
    records = []
    with tempfile.TemporaryDirectory(prefix="bench-covey-") as out_dir:
        cfg = load_config("grpo", [*cpu_keys(args.workload, args.steps, args.threads, out_dir, args.model),
                                   *args.overrides])
        samples = cfg.rollout.prompts_per_step * cfg.rollout.group_size
        with covey_run(cfg) as session:
            flops = LinearFlops(session.run.policy)  # forward hooks on the policy's linear layers
            for m in steps(session):
                records.append(StepRecord(step=session.run.step, seconds=m["time/step"],
                                          phases={p: m[f"time/{p}"] for p in PHASES},
                                          completion_tokens=round(m["response/len_mean"] * samples),
                                          train_flops=flops.take()))
                say(f"covey step {session.run.step}: {m['time/step']:.2f} s")
    precision = "bfloat16 (autocast)" if resolve_autocast(cfg.model.autocast) == "bfloat16" else cfg.model.dtype
    return step_result(args.name, records, precision=precision, overrides=args.overrides)


def gpu_step(m: dict, w: dict, step: int) -> dict:
    """One timed step of the GPU child from covey's metrics."""
    say(f"covey step {step}: {m['time/step']:.2f} s (generate {m['time/generate']:.2f}, reference "
        f"{m['time/logprobs']:.2f}, update {m['time/update']:.2f} in micro-batches of "
        f"{m.get('memory/micro_batch/update')})")
    return {"step_s": m["time/step"], "generate_s": m["time/generate"], "score_s": m["time/score"],
            "reference_s": m["time/logprobs"], "update_s": m["time/update"],
            "gpu_peak_mb": {k.rsplit("/", 1)[1]: v for k, v in m.items() if k.startswith("memory/gpu_peak_mb/")},
            "response_tokens": m.get("response/len_mean", 0) * w["prompts"] * w["group_size"],
            "update_micro_batch": m.get("memory/micro_batch/update")}


def role_gpu(args) -> dict:
    """The GPU workload with covey's GPU defaults; the decode details of the last rollout; --profile: one
    more step under torch.profiler."""
    w = WORKLOADS[args.workload]
    with tempfile.TemporaryDirectory(prefix="bench-covey-") as out_dir:
        cfg = load_config("grpo", gpu_keys(args.workload, args.model, args.steps + args.profile, out_dir, args.keys))
        with covey_run(cfg, [varied_reward]) as session:
            fast = innermost(session.feed.engine)
            fast.eos = []  # fixed-length responses
            probe = StepEvents(fast.static) if fast.static is not None else None
            steps_left, timed = steps(session), []
            for i in range(args.steps):
                if probe is not None:
                    probe.on, probe.events = i == args.steps - 1, []
                timed.append(gpu_step(next(steps_left), w, i + 1))
            peaks = [v for s in timed for v in s["gpu_peak_mb"].values()]
            result = {"steps": timed, "peak_gpu_bytes": max(peaks) * 2**20 if peaks else peak_gpu_bytes(),
                      "held_bytes": held_bytes(session.run, fast),
                      "config": {"rollout.decode": cfg.rollout.decode, "model.autocast": cfg.model.autocast,
                                 "rollout.precision": cfg.rollout.precision}}
            try:
                result["decode"] = decode_details(fast, session.feed.prompts, probe, w)
            except Exception as err:  # the timed steps stand without the decode details
                say(f"decode details failed: {type(err).__name__}: {err}")
                result["decode_error"] = f"{type(err).__name__}: {err}"
            if args.profile:
                write_json(args.result, result)  # kept if profiling fails
                if probe is not None:
                    probe.on = False
                result["profile"] = profile_step(steps_left)
            steps_left.close()
    return result


def role_learn(args) -> dict:
    """A learning run: covey's config (the grpo preset and the overrides) until the Schedule stops it
    (`break`), the policy saved at each evaluation point with save_final."""
    from covey.rollout.precision import resolve_precision
    from covey.runtime.dist import resolve_device
    args.save_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="learn-covey-") as tmp:
        cfg = load_config("grpo", [*args.overrides, f"train.steps={STEP_CAP}", "train.max_minutes=0",
                                   "train.eval_every=0", "train.save_every=0", "train.samples_every=0",
                                   "train.progress=false", f"train.output_dir={tmp}", "train.run_name=covey"])
        device = resolve_device(cfg.train.device)
        samples = cfg.rollout.prompts_per_step * cfg.rollout.group_size
        tracker = Tracker(Schedule(args.steps, args.minutes, args.eval_every, args.max_minutes), samples,
                          args.save_dir)
        with covey_run(cfg) as session:
            tracker.begin()
            for m in steps(session):
                peaks = [v for k, v in m.items() if k.startswith("memory/gpu_peak_mb/")]
                tracker.end(session.run.step, m["time/step"],
                            lambda folder: shutil.move(save_final(session.run), folder), m.get("reward/mean"),
                            max(peaks) if peaks else None)
                if tracker.done:
                    break
    return tracker.result(precision=resolve_autocast(cfg.model.autocast, device), device=device,
                          rollout_precision=resolve_precision(cfg.rollout.precision, device))


def role_eval(args) -> dict:
    """`covey eval` of each LABEL=FOLDER on the config's held-out problems: label -> accuracy, n, seconds."""
    from covey.cli.eval import run_eval_command
    from covey.runtime.cpu import apply_cpu_settings
    cfg = load_config("grpo", args.overrides)
    apply_cpu_settings(cfg)
    out = {}
    for label, folder in (item.split("=", 1) for item in args.folders):
        cfg.model.path = folder
        t0 = time.perf_counter()
        result = run_eval_command(cfg)
        out[label] = {"accuracy": result["eval/accuracy"], "n": result["eval/n"], "eval_s": time.perf_counter() - t0}
    return out


ROLES = {
    "speed": role_speed, "gpu": role_gpu, "learn": role_learn, "eval": role_eval,
    "decode": lambda a: decode_modes(a.model, a.decode_modes, a.workload, a.result),
    "device": lambda a: measure_device(),
    "build": lambda a: build_model(a.size, a.model, a.tokenizer, a.workload),
}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description="the covey side of bench/'s drivers")
    p.add_argument("role", choices=tuple(ROLES))
    p.add_argument("--result", required=True)
    p.add_argument("--workload", default="cpu", choices=tuple(WORKLOADS))
    p.add_argument("--steps", type=int, default=0)
    p.add_argument("--threads", type=int, default=0, help="speed: torch threads (model.threads)")
    p.add_argument("--name", default="covey", help="speed: the run's name in the result")
    p.add_argument("--model", default="", help="model folder (speed: the default model if not given)")
    p.add_argument("--size", default="", help="build: a key of SHAPES")
    p.add_argument("--tokenizer", default="", help="build: tokenizer folder (default: SmolLM2's)")
    p.add_argument("--keys", default="", help="gpu: extra covey key=value settings, space-separated")
    p.add_argument("--profile", action="store_true", help="gpu: one more step under torch.profiler")
    p.add_argument("--decode-modes", default="", help="decode: rollout.decode modes, comma-separated")
    p.add_argument("--minutes", type=float, default=12.0, help="learn: training minutes of the Schedule")
    p.add_argument("--eval-every", type=int, default=10, help="learn: evaluation points every K steps")
    p.add_argument("--max-minutes", type=float, default=0.0, help="learn: stop past this training time (0: no cap)")
    p.add_argument("--save-dir", type=Path, help="learn: where the evaluation points are saved")
    p.add_argument("--folders", nargs="*", default=[], help="eval: LABEL=FOLDER ...")
    p.add_argument("overrides", nargs="*", help="covey key=value settings (speed, learn, eval)")
    return p.parse_intermixed_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    write_json(args.result, ROLES[args.role](args))


if __name__ == "__main__":
    main()
