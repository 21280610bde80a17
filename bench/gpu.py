"""covey vs TRL's GRPOTrainer on one GPU: step time by phase, peak GPU memory, the decode step against its
memory-bandwidth floor, the update's FLOP rate against the GPU's bf16 matmul peak.

    python -m bench.gpu --out LOGS/bench --decode-modes graphs,compile   # a GPU: ~6 min on an H100
    python -m bench.gpu --smoke --out /tmp/bench    # on a CPU: tiny shapes, the whole pipeline, TRL included

The workload (bench/workloads.py, `gpu`): random Qwen2 models of Qwen2.5-0.5B's and -1.5B's dimensions,
8 prompts x 8 samples x 256 new tokens at full length, one optimizer step per rollout, the same
deterministic reward. covey runs with its GPU defaults (fp32 weights and AdamW, bf16 autocast, bf16
sampling copy, CUDA-graph decoding, the update's micro-batches sized to train.gpu_memory_gib); TRL with
its default model load, bf16 autocast, HF `generate`, covey's settings mapped by bench/trl_side.py
(gradient checkpointing off like covey's; --trl-gc: on). Each run is a child process (its peak GPU memory
is its own; this process never touches the GPU), each model size built once in a child of its own; medians
over steps 2..N. Then, while the budget lasts, `--decode-modes` times rollout.decode modes on each model's
bf16 weights alone. Results: a table on stdout, `<out>.md`, `<out>.json`, each child's log in `<out>-logs/`.
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from bench.harness import Children, out_prefix, publish
from bench.report import decode_lines, gpu_summary, gpu_table, verdicts
from bench.workloads import SHAPES, WORKLOADS

LIMIT_S = {"0.5b": 120, "1.5b": 160, "smoke": 120}
"""Seconds a run of the size may take (load, steps, decode timing) before it is killed."""


@dataclass(frozen=True)
class Cell:
    """One child run on a model size's folder: `python -m bench.<trainer>_side <role> ... <args>`."""
    name: str
    trainer: str
    size: str
    args: tuple = ()
    role: str = "steps"
    limit_s: float = 0.0  # seconds it may take before it is killed (0: what the budget has)


def run_cells(children: Children, cells: list[Cell], work: Path, common: list[str], on_result=None):
    """Every cell in order while the budget lasts, each size's model folder built by a child before its first
    cell and deleted after its last one; on_result(cell, result) after each. Returns (name -> result or None,
    size -> its shape)."""
    results, shapes, last = {}, {}, {c.size: i for i, c in enumerate(cells)}
    for i, cell in enumerate(cells):
        folder = work / f"model-{cell.size}"
        if cell.size not in shapes and children.left() > 20:
            shapes[cell.size] = children.run("covey_side", "build", f"build-{cell.size}",
                                             [*common, "--size", cell.size, "--model", str(folder)])
            if shapes[cell.size]:
                children.say(f"{cell.size}: {shapes[cell.size]['describe']}")
        if shapes.get(cell.size):
            reserve = max(0.0, children.left() - cell.limit_s) if cell.limit_s else 0.0
            results[cell.name] = children.run(f"{cell.trainer}_side", cell.role, cell.name,
                                              [*common, *cell.args, "--model", str(folder)], reserve_s=reserve)
        else:
            results[cell.name] = children.skip(cell.name, f"no model folder of {cell.size}")
        if on_result is not None:
            on_result(cell, results[cell.name])
        if last[cell.size] == i:
            shutil.rmtree(folder, ignore_errors=True)
    return results, {size: shape for size, shape in shapes.items() if shape}


def measure_device(children: Children) -> dict:
    device = children.run("covey_side", "device", "device", []) or {}
    if device:
        children.say(f"device: {device['name']}; copy {device['copy_bytes_per_s'] / 1e12:.2f} TB/s (read + written), "
                     f"bf16 matmul peak {device['matmul_tflops']:.1f} TFLOP/s {device['matmul_shape']}")
    return device


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--smoke", action="store_true", help="tiny shapes and few tokens: runs on a CPU")
    p.add_argument("--sizes", default="", help="comma-separated from " + ", ".join(SHAPES))
    p.add_argument("--steps", type=int, default=0, help="optimizer steps per run (medians of 2..N)")
    p.add_argument("--runs", default="covey,trl", help="covey, trl or both")
    p.add_argument("--decode-modes", default="", help="rollout.decode modes timed on each model's bf16 weights after "
                                                      "the GRPO runs, while the budget lasts (e.g. graphs,compile)")
    p.add_argument("--covey-variant", default="", help="one more covey run per size with these key=value settings, "
                                                       "reported as covey-variant (e.g. 'algo.micro_batch_size=32')")
    p.add_argument("--profile", action="store_true", help="covey: one more step under torch.profiler, the top "
                                                          "ops in its log")
    p.add_argument("--trl-gc", action="store_true", help="TRL with gradient checkpointing, its own default "
                                                         "(default: covey's setting, off, as the CPU benchmark's trl)")
    p.add_argument("--work", default="", help="folder for the model folders (default: a temporary one)")
    p.add_argument("--tokenizer", default="", help="folder with SmolLM2's tokenizer files (default: covey's model "
                                                   "cache)")
    p.add_argument("--budget-s", type=float, default=440.0, help="stop starting runs after this long")
    p.add_argument("--out", default="", help="results prefix (default: a temporary folder)")
    return p.parse_args(argv)


def plan(args, sizes: list[str]) -> list[Cell]:
    """Per size: covey, TRL and the variant; then each size's decode modes."""
    runs = {"covey": ("covey", ("--profile",) if args.profile else ()),
            "trl": ("trl", ("--setup", "gc") if args.trl_gc else ()),
            "covey-variant": ("covey", tuple(args.covey_variant.split()))}
    chosen = [r for r in args.runs.split(",") if r] + (["covey-variant"] if args.covey_variant else [])
    cells = [Cell(f"{label}-{size}", runs[label][0], size, runs[label][1], limit_s=LIMIT_S.get(size, 160))
             for size in sizes for label in chosen]
    return cells + [Cell(f"decode-{size}", "covey", size, ("--decode-modes", args.decode_modes), "decode",
                         LIMIT_S.get(size, 160)) for size in sizes if args.decode_modes]


def main(argv=None) -> int:
    args = parse_args(argv)
    workload = "gpu-smoke" if args.smoke else "gpu"
    w, steps = WORKLOADS[workload], args.steps or WORKLOADS[workload]["steps"]
    sizes = [s for s in (args.sizes or ("smoke" if args.smoke else "0.5b,1.5b")).split(",") if s]
    out = out_prefix(args.out, "bench")
    children = Children(out.parent / f"{out.name}-logs", args.budget_s)
    device = measure_device(children)
    common = ["--workload", workload, "--steps", str(steps), *(["--tokenizer", args.tokenizer] if args.tokenizer
                                                                else [])]
    cells = plan(args, sizes)
    results, shapes = run_cells(children, cells, Path(args.work or tempfile.mkdtemp(prefix="gpu-bench-models-")),
                                common)
    rows = []
    for size, shape in shapes.items():
        mine = {c.name.removesuffix(f"-{size}"): results[c.name] for c in cells if c.size == size and c.role == "steps"}
        row = {**gpu_summary(size, device, shape, mine, w), "shape": shape}
        rows.append({**row, "decode_modes": (results.get(f"decode-{size}") or {}).get("modes", {})})
    text = "\n".join([f"device: {device.get('name', 'unknown')}; copy bandwidth "
                      f"{device.get('copy_bytes_per_s', 0) / 1e12:.2f} TB/s; bf16 matmul peak "
                      f"{device.get('matmul_tflops', 0):.1f} TFLOP/s; medians of steps 2..{steps}",
                      "workload: " + json.dumps({k: v for k, v in w.items() if k != "steps"}),
                      *[f"{r['size']}: {r['shape']['describe']}" for r in rows], "", gpu_table(rows), "",
                      *decode_lines(rows), "", *[line for r in rows for line in verdicts(r)]])
    publish(out, text, {"device": device, "workload": w, "rows": rows})
    if children.failed:
        children.say(f"{children.failed} run(s) failed, stopped early or were skipped")
    return int(children.failed > 0)


if __name__ == "__main__":
    raise SystemExit(main())
