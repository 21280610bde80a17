"""The covey side of every benchmark, one role per child process:

    python -m bench.covey_side steps|learn|eval|decode|device|build --result FILE [options] [key=value ...]

covey runs through its public step API, as `covey train` does: `open_run` (here without the held-out
evaluation before training) -> `steps` (one step per iteration; `break` stops early) -> `finish` (here
without evaluation or saving). Measurements read covey's step metrics (time/*, response/len_mean,
memory/gpu_peak_mb/*), forward hooks on `session.run.policy` (the FLOP counter) and the wall clock around
public calls (the decode step: the engine's `generate`); nothing of covey's is replaced or reached into.

- steps: a workload (bench/workloads.py) with a memory setup and an allocator cap; on a GPU workload then
  the decode step timed from outside and, with --profile, one more step under torch.profiler;
- learn: a learning run to its Schedule's stop, the policy saved at its points with covey's `save_final`;
- eval: `covey eval` of saved folders, the same evaluation for both trainers' folders;
- decode: rollout.decode modes on a model folder's bf16 weights; device: the device's peaks; build: a
  random Qwen2 model folder.
"""

from __future__ import annotations

import contextlib
import shutil
import tempfile
import time
from pathlib import Path

import torch

from bench.harness import (PHASES, LinearFlops, best_seconds, cap_memory, child_args, measure_device,
                           peak_rss_mib, say, sync, write_json)
from bench.workloads import (SETUPS, STEP_CAP, WORKLOADS, Schedule, Tracker, build_model, varied_reward,
                             workload_keys)
from covey.config import load_config
from covey.runtime.dist import resolve_device
from covey.runtime.precision import resolve_autocast
from covey.train.checkpoint import save_final
from covey.train.loop import finish, open_run, steps


@contextlib.contextmanager
def covey_run(cfg, reward_funcs=None):
    """An open covey run, no held-out evaluation before it; finished without evaluation or saving
    (the benchmark measures and saves by itself), closed if the body fails."""
    session = open_run(cfg, reward_funcs=reward_funcs, evaluate_before=False)
    try:
        yield session
        finish(session, evaluate=False, save=False)
    finally:
        session.close()


def step_record(step: int, m: dict, w: dict, flops: LinearFlops | None) -> dict:
    """One step in the harness's format, from covey's step metrics."""
    peaks = [v for k, v in m.items() if k.startswith("memory/gpu_peak_mb/")]
    record = {"step": step, "step_s": m["time/step"], **{f"{p}_s": m[f"time/{p}"] for p in PHASES},
              "tokens": round(m["response/len_mean"] * w["prompts"] * w["group_size"]),
              "flops": flops.take() if flops else 0.0, "gpu_peak_mib": max(peaks) if peaks else None,
              "update_micro_batch": m.get("memory/micro_batch/update")}
    say(f"covey step {step}: {m['time/step']:.2f} s (generate {m['time/generate']:.2f}, log-probs "
        f"{m['time/logprobs']:.2f}, update {m['time/update']:.2f} in micro-batches of {record['update_micro_batch']})")
    return record


def role_steps(args) -> dict:
    """A workload's steps under covey's defaults plus the setup's keys and the overrides."""
    w, allowed = WORKLOADS[args.workload], cap_memory(args.cap_gib)
    with tempfile.TemporaryDirectory(prefix="bench-covey-") as out_dir:
        cfg = load_config("grpo", [*workload_keys(args.workload, args.steps + args.profile, out_dir, args.model,
                                                  args.threads), *SETUPS["covey"][args.setup or "defaults"], *args.overrides])
        with covey_run(cfg, [varied_reward] if w["gpu"] else None) as session:
            flops = LinearFlops(session.run.policy) if args.flops else None
            run_steps = steps(session)
            records = [step_record(i + 1, next(run_steps), w, flops) for i in range(args.steps)]
            peaks = [r["gpu_peak_mib"] for r in records if r["gpu_peak_mib"] is not None]
            autocast = resolve_autocast(cfg.model.autocast, resolve_device(cfg.train.device))
            result = {"name": args.name, "steps": records, "peak_rss_mib": peak_rss_mib(), "allowed_gib": allowed,
                      "peak_gpu_mib": max(peaks) if peaks else None, "overrides": args.overrides,
                      "precision": "bfloat16 (autocast)" if autocast == "bfloat16" else cfg.model.dtype,
                      "config": {k: str(v) for k, v in (("rollout.decode", cfg.rollout.decode),
                                                        ("model.autocast", cfg.model.autocast),
                                                        ("rollout.precision", cfg.rollout.precision))}}
            if w["gpu"]:
                result["decode"] = decode_timing(session.feed.engine, session.feed.prompts[:w["prompts"]], w)
            if args.profile:
                write_json(args.result, result)  # kept if profiling fails
                result["profile"] = profile_step(run_steps)
            run_steps.close()
    return result


def decode_timing(engine, prompts: list[str], w: dict) -> dict:
    """The decode step at the workload's rows, timed around the engine's public `generate`: the best of two
    warm calls of L and of L/2 new tokens; their difference over L/2 steps leaves the prefill out (every
    response runs to its length: bench/workloads.py, build_model)."""
    length, half = w["new_tokens"], w["new_tokens"] // 2
    seconds = {n: best_seconds(lambda: engine.generate(prompts, w["group_size"], max_new_tokens=n), 2)
               for n in (length, half)}
    out = {"rows": len(prompts) * w["group_size"], "generate_s": seconds[length],
           "step_ms": 1000 * (seconds[length] - seconds[half]) / (length - half)}
    say(f"decode at {out['rows']} rows: {out['step_ms']:.3f} ms/step, generate {seconds[length]:.3f} s")
    return out


def profile_step(run_steps) -> dict:
    """The next step of a covey run (`run_steps`, its steps generator) under torch.profiler: the ops that take
    the most device and host time, printed to the log, and the device's busy time against the step's wall
    time (busy well under wall: the host's launches bound the step)."""
    from torch.profiler import ProfilerActivity, profile
    gpu = torch.cuda.is_available()
    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if gpu else [])) as prof:
        t0 = time.perf_counter()
        metrics = next(run_steps)
        sync()
        wall_s = time.perf_counter() - t0
    events = prof.key_averages()
    busy_s = sum(e.self_device_time_total for e in events) / 1e6 if gpu else 0.0
    for key in (["self_device_time_total"] if gpu else []) + ["self_cpu_time_total"]:
        print(f"profile of one step, top ops by {key}:\n" + events.table(sort_by=key, row_limit=25), flush=True)
    micro = metrics.get("memory/micro_batch/update")
    say(f"profiled step: {wall_s:.2f} s wall (update {metrics['time/update']:.2f} s), device busy {busy_s:.2f} s")
    return {"step_wall_s": wall_s, "update_s": metrics["time/update"], "device_busy_s": busy_s, "micro_batch": micro}


def role_decode(args) -> dict:
    """rollout.decode modes on the bf16 weights of the model folder at the workload's rows and tokens: per mode
    the first call's seconds (captures, compilation), then the decode step (decode_timing). The result file
    is rewritten after each mode, so a run stopped at its time limit keeps the modes it finished."""
    from covey.models.load import load_policy
    from covey.rollout.local import DecodeOptions, local_engine
    from covey.tasks.data import format_prompts, load_task_data
    w, out = WORKLOADS[args.workload], {}
    model, tok = load_policy(args.model, dtype=torch.bfloat16, device="cuda" if torch.cuda.is_available() else "cpu")
    model.requires_grad_(False)
    prompts = format_prompts(tok, load_task_data(load_config("grpo", []).task, w["seed"]).train[:w["prompts"]])
    for mode in [m for m in args.decode_modes.split(",") if m]:
        try:
            engine = local_engine("fast", model, tok, max_new_tokens=w["new_tokens"], temperature=w["temperature"],
                                  precision="bfloat16", decode=DecodeOptions(mode))
        except ValueError as err:  # graphs on a CPU
            out[mode] = {"error": str(err)}
            continue
        t0 = time.perf_counter()
        engine.generate(prompts, w["group_size"])
        sync()
        out[mode] = {"first_call_s": round(time.perf_counter() - t0, 2), **decode_timing(engine, prompts, w)}
        write_json(args.result, {"modes": out})
    return {"modes": out}


def role_learn(args) -> dict:
    """A learning run: covey's config (the grpo preset and the overrides) until the Schedule stops it
    (`break`), the policy saved at each evaluation point with save_final."""
    from covey.rollout.precision import resolve_precision
    Path(args.save_dir).mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="learn-covey-") as tmp:
        cfg = load_config("grpo", [*args.overrides, f"train.steps={STEP_CAP}", "train.max_minutes=0",
                                   "train.eval_every=0", "train.save_every=0", "train.samples_every=0",
                                   "train.progress=false", f"train.output_dir={tmp}", "train.run_name=covey"])
        device = resolve_device(cfg.train.device)
        tracker = Tracker(Schedule(args.steps, args.minutes, args.eval_every, args.max_minutes),
                          cfg.rollout.prompts_per_step * cfg.rollout.group_size, args.save_dir)
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
    """`covey eval` of each LABEL=FOLDER on the config's held-out problems: label -> accuracy, n, seconds
    (`covey eval`'s HF generate, so a figure can differ slightly from what `covey train` prints)."""
    from covey.cli.eval import run_eval_command
    from covey.runtime.cpu import apply_cpu_settings
    out = {}
    for label, folder in (item.split("=", 1) for item in args.folders):
        cfg = load_config("grpo", [*args.overrides, f"model.path={folder}"])
        apply_cpu_settings(cfg)
        t0 = time.perf_counter()
        result = run_eval_command(cfg)
        out[label] = {"accuracy": result["eval/accuracy"], "n": result["eval/n"], "eval_s": time.perf_counter() - t0}
    return out


ROLES = {"steps": role_steps, "learn": role_learn, "eval": role_eval, "decode": role_decode,
         "device": lambda args: measure_device(),
         "build": lambda args: build_model(args.size, args.model, args.tokenizer, args.workload)}


def main(argv=None) -> None:
    args = child_args("the covey side of bench/'s drivers", ROLES, argv)
    write_json(args.result, ROLES[args.role](args))


if __name__ == "__main__":
    main()
