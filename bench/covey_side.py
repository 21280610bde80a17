"""The covey side, a role per child (`steps`, `learn`, `eval`, `device`, `build`): covey through open_run / steps /
finish; measured: its step metrics, forward hooks on `session.run.policy`, the clock around the engine's `generate`."""

from __future__ import annotations

import contextlib
import shutil
import tempfile
import time

import torch

from bench import harness
from bench.workloads import SETUPS, STEP_CAP, WORKLOADS, Schedule, Tracker, build_model, varied_reward, workload_keys
from covey.config import load_config
from covey.runtime.dist import resolve_device
from covey.runtime.precision import resolve_autocast
from covey.training.checkpoint import save_final
from covey.training.loop import finish, open_run, steps


@contextlib.contextmanager
def covey_run(cfg, reward_funcs=None):
    session = open_run(cfg, reward_funcs=reward_funcs, evaluate_before=False)
    try:
        yield session
        finish(session, evaluate=False, save=False)
    finally:
        session.close()


def gpu_peak(m: dict) -> float | None:
    return max((v for k, v in m.items() if k.startswith("memory/gpu_peak_mb/")), default=None)


def step_record(step: int, m: dict, w: dict, flops: harness.LinearFlops | None) -> dict:
    harness.say(f"covey step {step}: {m['time/step']:.2f} s, update in micro-batches of "
                f"{m.get('memory/micro_batch/update')}")
    return {"step": step, "step_s": m["time/step"], **{f"{p}_s": m[f"time/{p}"] for p in harness.PHASES},
            "tokens": round(m["response/len_mean"] * w["prompts"] * w["group_size"]),
            "flops": flops.take() if flops else 0.0, "gpu_peak_mib": gpu_peak(m)}


def role_steps(spec: dict) -> dict:
    w, allowed, n = WORKLOADS[spec["workload"]], harness.cap_memory(spec.get("cap_gib", 0)), spec["steps"]
    with tempfile.TemporaryDirectory(prefix="bench-covey-") as out_dir:
        keys = workload_keys(spec["workload"], n + spec.get("profile", False), out_dir, spec.get("model", ""),
                             spec.get("threads", 0))
        cfg = load_config("grpo", [*keys, *SETUPS["covey"][spec.get("setup", "defaults")], *spec.get("keys", [])])
        autocast = resolve_autocast(cfg.model.autocast, resolve_device(cfg.train.device))
        with covey_run(cfg, [varied_reward] if w["gpu"] else None) as session:
            flops = harness.LinearFlops(session.run.policy) if spec.get("flops") else None
            run_steps = steps(session)
            records = [step_record(i + 1, next(run_steps), w, flops) for i in range(n)]
            result = {"name": spec.get("name", "covey"), "steps": records, "peak_rss_mib": harness.peak_rss_mib(),
                      "peak_gpu_mib": max((r["gpu_peak_mib"] or 0 for r in records), default=0) or None,
                      "precision": "bfloat16 (autocast)" if autocast == "bfloat16" else cfg.model.dtype,
                      "allowed_gib": allowed}
            if w["gpu"]:
                result["decode"] = decode_timing(session.feed.engine, session.feed.prompts[:w["prompts"]], w)
            if spec.get("profile"):
                profile_step(run_steps)
            run_steps.close()
    return result


def decode_timing(engine, prompts: list[str], w: dict) -> dict:
    """A decode step at the workload's rows: warm `generate` calls of L and of L/2 tokens, the difference over L/2."""
    length, half = w["new_tokens"], w["new_tokens"] // 2
    seconds = {n: harness.best_seconds(lambda: engine.generate(prompts, w["group_size"], max_new_tokens=n), 2)
               for n in (length, half)}
    out = {"rows": len(prompts) * w["group_size"], "generate_s": seconds[length],
           "step_ms": 1000 * (seconds[length] - seconds[half]) / (length - half)}
    return out


def profile_step(run_steps) -> None:
    from torch.profiler import ProfilerActivity, profile
    gpu = torch.cuda.is_available()
    with profile(activities=[ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if gpu else [])]) as prof:
        next(run_steps)
        harness.sync()
    for key in (["self_device_time_total"] if gpu else []) + ["self_cpu_time_total"]:
        print(f"profile of one step, top ops by {key}:\n" + prof.key_averages().table(sort_by=key, row_limit=25))


def role_learn(spec: dict) -> dict:
    from covey.rollout.precision import resolve_precision
    with tempfile.TemporaryDirectory(prefix="learn-covey-") as tmp:
        cfg = load_config("grpo", [*spec["keys"], f"train.steps={STEP_CAP}", "train.max_minutes=0",
                                   "train.eval_every=0", "train.save_every=0", "train.samples_every=0",
                                   "train.progress=false", f"train.output_dir={tmp}", "train.run_name=covey"])
        device = resolve_device(cfg.train.device)
        tracker = Tracker(Schedule(*spec["schedule"]), cfg.rollout.prompts_per_step * cfg.rollout.group_size,
                          spec["save_dir"])
        with covey_run(cfg) as session:
            tracker.begin()
            for m in steps(session):
                tracker.end(session.run.step, m["time/step"], lambda to: shutil.move(save_final(session.run), to),
                            gpu_peak(m))
                if tracker.done:
                    break
    return tracker.result(precision=resolve_autocast(cfg.model.autocast, device), device=device,
                          rollout_precision=resolve_precision(cfg.rollout.precision, device))


def role_eval(spec: dict) -> dict:
    from covey.cli.eval import run_eval_command
    from covey.runtime.cpu import apply_cpu_settings
    out = {}
    for label, folder in spec["folders"].items():
        cfg = load_config("grpo", [*spec["keys"], f"model.path={folder}"])
        apply_cpu_settings(cfg.model.threads)
        t0 = time.perf_counter()
        result = run_eval_command(cfg)
        out[label] = {"accuracy": result["eval/accuracy"], "n": result["eval/n"], "eval_s": time.perf_counter() - t0}
    return out


ROLES = {"steps": role_steps, "learn": role_learn, "eval": role_eval, "device": lambda spec: harness.measure_device(),
         "build": lambda spec: build_model(spec["size"], spec["model"], spec.get("tokenizer", ""), spec["workload"])}

if __name__ == "__main__":
    harness.child_main(ROLES)
