"""bench/gpu_bench.py's covey child: GRPO steps with covey's GPU defaults, timed by phase (covey's own
time/* and memory/gpu_peak_mb/* metrics), then its decode step against the bandwidth floor.

The steps are `covey.train.loop.train_step`, the function `covey train` runs, on a run built the way
`train()` builds it (no held-out evaluation, no checkpoint). The end-of-sequence token is taken away
from the engine (fixed-length responses). Decode timing: a CUDA event after every step of the
engine's loop (a graph replay, the token picked inside it, and the host's checks) during the last rollout,
and each captured 64-row graph replayed back to back; `--decode-modes` times other rollout.decode modes on the same weights.
"""

from __future__ import annotations

import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from gpu_roles import WORKLOADS, peak_gpu_bytes, say

from covey.rollout.static_decode import row_bucket


def overrides(args, out_dir: str) -> list[str]:
    w = WORKLOADS[args.workload]
    device = "cuda" if torch.cuda.is_available() else "cpu"
    return [f"model.path={args.model}", f"train.device={device}", f"train.steps={args.steps}",
            f"rollout.prompts_per_step={w['prompts']}", f"rollout.group_size={w['group_size']}",
            f"rollout.max_new_tokens={w['new_tokens']}", f"algo.beta={w['beta']}", f"optim.lr={w['lr']}",
            f"rollout.temperature={w['temperature']}", f"algo.micro_batch_size={w['micro_batch']}",
            f"train.seed={w['seed']}", "reward.correctness=0", "reward.functions=bench/gpu_bench.py:varied_reward",
            "task.eval_size=8", f"train.output_dir={out_dir}", "train.run_name=bench", "train.progress=false",
            "train.samples_every=0", "train.max_minutes=0", *args.keys.split()]


def innermost(engine):
    while hasattr(engine, "engine"):
        engine = engine.engine
    return engine


class StepEvents:
    """Stands in for a StaticDecoder's step runner: a CUDA event after every step while `on`."""

    def __init__(self, decoder):
        self.inner, self.events, self.on = decoder.runner, [], False
        decoder.runner = self

    def __call__(self, weights, state, length, picker):
        self.inner(weights, state, length, picker)
        if self.on and torch.cuda.is_available():
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.events.append(event)

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def step_ms(self) -> list[float]:
        torch.cuda.synchronize()
        return [a.elapsed_time(b) for a, b in zip(self.events, self.events[1:])]


def build(args, out_dir: str):
    from covey.config import load_config
    from covey.rewards.build import build_rewarder
    from covey.tasks.data import load_task_data
    from covey.train.plan import make_plan
    from covey.train.setup import build_run, open_feed, open_world, prepare_run_dir, seed_everything
    cfg = load_config("grpo", overrides(args, out_dir))
    plan = make_plan(cfg)
    world = open_world(cfg)
    data = load_task_data(cfg.task, cfg.train.seed)
    run_dir = prepare_run_dir(cfg, plan.label)
    seed_everything(cfg.train.seed)
    run = build_run(cfg, run_dir, len(data.train), world, plan)
    return cfg, run, open_feed(run, data, build_rewarder(cfg))


def held_bytes(run, fast) -> dict:
    """What stays on the device between steps, by role."""
    def size(tensors):
        seen, total = set(), 0
        for t in tensors:
            if t.data_ptr() not in seen:
                seen.add(t.data_ptr())
                total += t.numel() * t.element_size()
        return total
    states = [t for s in run.optimizer.state.values() for t in s.values() if torch.is_tensor(t)]
    out = {"policy": size(run.policy.parameters()), "optimizer": size(states),
           "reference": size(run.reference.parameters()) if run.reference is not None else 0,
           "sampling_copy": size(fast.model.parameters()) if fast.model is not run.policy else 0}
    if fast.static is not None:
        out["static_kv"] = sum(s.nbytes() for s in fast.static.states.values())
    return out


def replay_ms(fast, rows: int, repeats: int = 16) -> dict:
    """Each captured `rows`-row graph replayed alone: ms per replay, writing its last `repeats` columns."""
    if fast.static is None or not torch.cuda.is_available() or rows not in fast.static.states:
        return {}
    state, out = fast.static.states[rows], {}
    runner = fast.static.runner.inner if isinstance(fast.static.runner, StepEvents) else fast.static.runner
    for (_, graph_rows, length, _), graph in runner.graphs.items():
        if graph_rows != rows or length <= repeats:
            continue
        with torch.inference_mode():  # the static state was made under inference mode, as the engine runs
            state.column.fill_(length - repeats - 1)  # the last replay picks at column length - 1
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(repeats):
            graph.replay()
        end.record()
        end.synchronize()
        out[length] = start.elapsed_time(end) / repeats
    return out


def floor_bytes(fast, shape_rows: int, prompt_tokens: float, new_tokens: int) -> float:
    """Bytes a decode step must read, averaged over the steps: every weight matrix and norm of the
    sampling model once (the embedding rows read are negligible), and the keys and values in use."""
    model, seen, weights = fast.model, set(), 0
    for name, p in model.named_parameters():
        if "embed_tokens" in name and model.lm_head.weight is not p or p.data_ptr() in seen:
            continue
        seen.add(p.data_ptr())
        weights += p.numel() * p.element_size()
    config = model.config
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    per_token = 2 * config.num_hidden_layers * config.num_key_value_heads * head_dim * model.dtype.itemsize
    mean_positions = prompt_tokens + (new_tokens + 1) / 2
    return weights + shape_rows * mean_positions * per_token


def role_decode(args) -> dict:
    """rollout.decode modes on the bf16 weights of the model folder, 8 prompts x 8 samples x 256 tokens:
    per mode the first call's seconds (captures, compilation) and, on a second call, the median ms per
    step of the loop (CUDA events) and the generate call's seconds. The result file is rewritten after
    each mode, so a run stopped at its time limit keeps the modes it finished."""
    from covey.models.load import load_policy
    from covey.rollout.fast import FastEngine
    from covey.rollout.local import DecodeOptions
    from covey.tasks.data import format_prompts, load_task_data
    from covey.config import load_config
    w, device = WORKLOADS[args.workload], "cuda" if torch.cuda.is_available() else "cpu"
    model, tok = load_policy(args.model, dtype=torch.bfloat16, device=device)
    model.requires_grad_(False)
    data = load_task_data(load_config("grpo", []).task, w["seed"])
    prompts = format_prompts(tok, data.train[:w["prompts"]])
    out = {"modes": {}}
    for mode in [m for m in args.decode_modes.split(",") if m]:
        try:
            options = DecodeOptions(mode).resolve(device)
        except ValueError as err:  # graphs on a CPU
            out["modes"][mode] = {"error": str(err)}
            continue
        engine = FastEngine(model, tok, max_new_tokens=w["new_tokens"], temperature=w["temperature"], **options)
        engine.eos = []
        probe = StepEvents(engine.static) if engine.static is not None else None
        times = []
        for call in range(2):
            if probe is not None:
                probe.on, probe.events = call == 1, []
            t0 = time.perf_counter()
            engine.generate(prompts, w["group_size"])
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        res = {"first_call_s": round(times[0], 2), "generate_s": round(times[1], 3),
               "generate_ms_per_token": round(1000 * times[1] / w["new_tokens"], 3)}
        if probe is not None and torch.cuda.is_available():
            res["loop_ms_median"] = round(statistics.median(probe.step_ms()), 4)
        out["modes"][mode] = res
        say(f"rollout.decode={mode}: {res}")
        Path(args.result).write_text(json.dumps(out, indent=1))
        del engine, probe
    return out


def profile_step(run, feed, train_step) -> dict:
    """One more step (not among the timed ones) with its update phase under torch.profiler: the ops
    that take the most device and host time, printed to the log, and the device's busy time against
    the update's wall time (busy well under wall: the host's launches bound the update)."""
    import covey.train.loop as loop
    from torch.profiler import ProfilerActivity, profile
    gpu, box, real = torch.cuda.is_available(), {}, loop.update

    def profiled_update(run_, rollout):
        with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if gpu else [])) as prof:
            t0 = time.perf_counter()
            out = real(run_, rollout)
            if gpu:
                torch.cuda.synchronize()
            box["wall_s"] = time.perf_counter() - t0
        box["prof"] = prof
        return out

    loop.update = profiled_update
    try:
        m = train_step(run, feed.engine, feed.rewarder, feed.data, feed.prompts)
    finally:
        loop.update = real
    events = box["prof"].key_averages()
    device_key = "self_device_time_total" if hasattr(events[0], "self_device_time_total") else "self_cuda_time_total"
    busy_s = sum(getattr(e, device_key) for e in events) / 1e6
    for key in ([device_key] if gpu else []) + ["self_cpu_time_total"]:
        print(f"profile of the update, top ops by {key}:\n" + events.table(sort_by=key, row_limit=25), flush=True)
    micro = m.get("memory/micro_batch/update")
    say(f"profiled update: {box['wall_s']:.2f} s wall (profiler on), device busy {busy_s:.2f} s, "
        f"micro-batch {micro}")
    return {"update_wall_s": box["wall_s"], "device_busy_s": busy_s, "micro_batch": micro}


def role_covey(args) -> dict:
    w = WORKLOADS[args.workload]
    with tempfile.TemporaryDirectory(prefix="bench-covey-") as out_dir:
        cfg, run, feed = build(args, out_dir)
        from covey.train.loop import train_step
        fast = innermost(feed.engine)
        fast.eos = []  # fixed-length responses
        probe = StepEvents(fast.static) if fast.static is not None else None
        steps = []
        for i in range(args.steps):
            if probe is not None:
                probe.on, probe.events = i == args.steps - 1, []
            m = train_step(run, feed.engine, feed.rewarder, feed.data, feed.prompts)
            steps.append({"step_s": m["time/step"], "generate_s": m["time/generate"], "score_s": m["time/score"],
                          "reference_s": m["time/logprobs"], "update_s": m["time/update"],
                          "gpu_peak_mb": {k.rsplit("/", 1)[1]: v for k, v in m.items()
                                          if k.startswith("memory/gpu_peak_mb/")},
                          "response_tokens": m.get("response/len_mean", 0) * w["prompts"] * w["group_size"],
                          "update_micro_batch": m.get("memory/micro_batch/update")})
            say(f"covey step {i + 1}: {m['time/step']:.2f} s (generate {m['time/generate']:.2f}, reference "
                f"{m['time/logprobs']:.2f}, update {m['time/update']:.2f} in micro-batches of "
                f"{m.get('memory/micro_batch/update')})")
        peaks = [v for s in steps for v in s["gpu_peak_mb"].values()]
        result = {"steps": steps, "peak_gpu_bytes": max(peaks) * 2**20 if peaks else peak_gpu_bytes(),
                  "held_bytes": held_bytes(run, fast), "config": {"rollout.decode": cfg.rollout.decode,
                                                                   "model.autocast": cfg.model.autocast,
                                                                   "rollout.precision": cfg.rollout.precision}}
        try:
            result["decode"] = decode_details(fast, feed, probe, w)
        except Exception as err:  # the timed steps stand without the decode details
            say(f"decode details failed: {type(err).__name__}: {err}")
            result["decode_error"] = f"{type(err).__name__}: {err}"
        if args.profile:
            Path(args.result).write_text(json.dumps(result, indent=1, default=str))  # kept if profiling fails
            if probe is not None:
                probe.on = False
            result["profile"] = profile_step(run, feed, train_step)
        return result


def decode_details(fast, feed, probe, w: dict) -> dict | None:
    """The last rollout's decode steps (CUDA events), each captured graph replayed alone, and the floor."""
    if probe is None or not torch.cuda.is_available():
        return None
    rows, loop = w["prompts"] * w["group_size"], probe.step_ms()
    prompt_tokens = statistics.mean(len(fast.tokenizer(p, add_special_tokens=False)["input_ids"])
                                    for p in feed.prompts[:200])
    out = {"rows": rows, "loop_ms_median": statistics.median(loop), "loop_ms_mean": statistics.mean(loop),
           "steps_timed": len(loop), "replay_ms": replay_ms(fast, row_bucket(rows)),
           "floor_bytes_per_step": floor_bytes(fast, rows, prompt_tokens, w["new_tokens"]),
           "graphs_captured": fast.static.runner.captures}
    say(f"decode loop: {out['loop_ms_median']:.3f} ms/step (median of {len(loop)}); replays back to back: {out['replay_ms']}")
    return out
