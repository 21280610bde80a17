"""Instruments of the GPU benchmark's covey child: its decode step against the memory-bandwidth floor, the
rollout.decode modes side by side, what stays on the device, one step under torch.profiler.

Decode timing: a CUDA event after every step of the engine's loop (a graph replay, the token picked inside
it, and the host's checks) during the last rollout, and each captured graph replayed back to back. The
floor: the bytes a decode step must read (every weight once, the keys and values in use) over the
bandwidth of a device-to-device copy (bench/harness.py, measure_device).
"""

from __future__ import annotations

import statistics
import time

import torch

from bench.harness import say, write_json
from bench.workloads import WORKLOADS
from covey.rollout.static_decode import row_bucket


def innermost(engine):
    """The engine that samples (wrappers hold theirs in `.engine`)."""
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


def decode_details(fast, prompts: list[str], probe, w: dict) -> dict | None:
    """The last rollout's decode steps (CUDA events), each captured graph replayed alone, and the floor."""
    if probe is None or not torch.cuda.is_available():
        return None
    rows, loop = w["prompts"] * w["group_size"], probe.step_ms()
    prompt_tokens = statistics.mean(len(fast.tokenizer(p, add_special_tokens=False)["input_ids"])
                                    for p in prompts[:200])
    out = {"rows": rows, "loop_ms_median": statistics.median(loop), "loop_ms_mean": statistics.mean(loop),
           "steps_timed": len(loop), "replay_ms": replay_ms(fast, row_bucket(rows)),
           "floor_bytes_per_step": floor_bytes(fast, rows, prompt_tokens, w["new_tokens"]),
           "graphs_captured": fast.static.runner.captures}
    say(f"decode loop: {out['loop_ms_median']:.3f} ms/step (median of {len(loop)}); "
        f"replays back to back: {out['replay_ms']}")
    return out


def profile_step(steps_left) -> dict:
    """The next step of a covey run (`steps_left`, its steps generator; not among the timed steps) under
    torch.profiler: the ops that take the most device and host time, printed to the log, and the device's
    busy time against the step's wall time (busy well under wall: the host's launches bound the step)."""
    from torch.profiler import ProfilerActivity, profile
    gpu = torch.cuda.is_available()
    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if gpu else [])) as prof:
        t0 = time.perf_counter()
        metrics = next(steps_left)
        if gpu:
            torch.cuda.synchronize()
        wall_s = time.perf_counter() - t0
    events = prof.key_averages()
    device_key = "self_device_time_total" if hasattr(events[0], "self_device_time_total") else "self_cuda_time_total"
    busy_s = sum(getattr(e, device_key) for e in events) / 1e6 if gpu else 0.0
    for key in ([device_key] if gpu else []) + ["self_cpu_time_total"]:
        print(f"profile of one step, top ops by {key}:\n" + events.table(sort_by=key, row_limit=25), flush=True)
    micro = metrics.get("memory/micro_batch/update")
    say(f"profiled step: {wall_s:.2f} s wall (profiler on; update {metrics['time/update']:.2f} s), device busy "
        f"{busy_s:.2f} s, micro-batch {micro}")
    return {"step_wall_s": wall_s, "update_s": metrics["time/update"], "device_busy_s": busy_s, "micro_batch": micro}


def decode_modes(model_dir: str, modes: str, workload: str, result: str) -> dict:
    """rollout.decode modes on the bf16 weights of the model folder, the workload's prompts x samples x tokens:
    per mode the first call's seconds (captures, compilation) and, on a second call, the median ms per
    step of the loop (CUDA events) and the generate call's seconds. The result file is rewritten after
    each mode, so a run stopped at its time limit keeps the modes it finished."""
    from covey.config import load_config
    from covey.models.load import load_policy
    from covey.tasks.data import format_prompts, load_task_data
    w, device = WORKLOADS[workload], "cuda" if torch.cuda.is_available() else "cpu"
    model, tok = load_policy(model_dir, dtype=torch.bfloat16, device=device)
    model.requires_grad_(False)
    prompts = format_prompts(tok, load_task_data(load_config("grpo", []).task, w["seed"]).train[:w["prompts"]])
    out = {"modes": {}}
    for mode in [m for m in modes.split(",") if m]:
        out["modes"][mode] = time_decode_mode(model, tok, prompts, mode, w, device)
        say(f"rollout.decode={mode}: {out['modes'][mode]}")
        write_json(result, out)
    return out


def time_decode_mode(model, tok, prompts: list[str], mode: str, w: dict, device: str) -> dict:
    from covey.rollout.fast import FastEngine
    from covey.rollout.local import DecodeOptions
    try:
        options = DecodeOptions(mode).resolve(device)
    except ValueError as err:  # graphs on a CPU
        return {"error": str(err)}
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
    return res
