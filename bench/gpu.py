"""covey vs TRL's GRPOTrainer on one GPU. Speed (`bench.gpu`): step time by phase, peak GPU memory, the decode step
against its memory-bandwidth floor, the update's FLOP rate against the bf16 matmul peak. Capacity
(`bench.gpu_capacity`, scripts/gpu_capacity.sh): which sizes a step fits under a memory cap, full-parameter, LoRA
and QLoRA, per cell whether a step runs (or why not), peak memory, s/step and the first step's time.

    python -m bench.gpu --out LOGS/bench --decode-modes compile   # ~6 min on an H100
    python -m bench.gpu --smoke --out /tmp/bench                  # a CPU: tiny shapes, the whole pipeline
    python -m bench.gpu_capacity --dry-run                         # the capacity cells in order, their settings

Every run, and every random model folder (bench/workloads.py), is a child of its own; this process never touches
the GPU. covey runs with its GPU defaults; TRL with its default model load, bf16 autocast, HF `generate` and
covey's settings (gradient checkpointing off like covey's; --trl-gc: on). A capacity cell's CUDA allocator is
capped at its GiB (covey's train.gpu_memory_gib=0 is then the cap less 10%): the acceptance cells first.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from bench.harness import Children, medians, out_prefix, publish, table
from bench.workloads import SETUPS, SHAPES, WORKLOADS, floor_bytes, update_flops

LIMIT_S = {"0.5b": 90, "1.5b": 120, "3b": 120, "7b": 150, "14b": 180}  # a run's seconds before it is killed
TARGETS = {"step_vs_trl": {"0.5b": 0.15, "1.5b": 0.25}, "decode_vs_floor": {"0.5b": 3.0, "1.5b": 2.0},
           "update_share_of_peak": {"1.5b": 0.35}, "memory_vs_trl": {"0.5b": 0.7, "1.5b": 0.7}}


@dataclass(frozen=True)
class Cell:
    """A trainer's run (its `steps` role) on a size's model folder, `spec` added to the workload's."""
    name: str
    trainer: str
    size: str
    spec: dict = field(default_factory=dict)
    why: str = ""  # a capacity cell's question


def run_cells(children: Children, cells: list[Cell], work: Path, common: dict, jsonl: Path):
    """The cells in order while the budget lasts, each killed past its size's time, each result a line of `jsonl`
    as it ends; each size's folder built before its first cell, deleted after its last. (results, shapes)"""
    results, shapes, last = {}, {}, {c.size: i for i, c in enumerate(cells)}
    jsonl.write_text("")
    for i, cell in enumerate(cells):
        folder = work / f"model-{cell.size}"
        if cell.size not in shapes and children.left() > 20:
            shapes[cell.size] = children.run("covey", "build", f"build-{cell.size}",
                                             {**common, "size": cell.size, "model": str(folder)})
        if shapes.get(cell.size):
            results[cell.name] = children.run(cell.trainer, "steps", cell.name, {**common, **cell.spec, "model":
                                              str(folder)}, max(0.0, children.left() - LIMIT_S.get(cell.size, 120)))
        else:
            results[cell.name] = children.skip(cell.name, f"no model folder of {cell.size}")
        with open(jsonl, "a") as f:
            f.write(json.dumps({"name": cell.name, **(results[cell.name] or {})}) + "\n")
        if last[cell.size] == i:
            shutil.rmtree(folder, ignore_errors=True)
    return results, {size: shape for size, shape in shapes.items() if shape}


# --------------------------------------------------------------------------- capacity


def cell(trainer: str, size: str, setup: str, cap_gib: float, why: str = "") -> Cell:
    return Cell(f"{trainer}-{size}-{setup}-{cap_gib:g}g", trainer, size, {"setup": setup, "cap_gib": cap_gib}, why)


ACCEPTANCE = (
    cell("covey", "7b", "full", 80, "7B full-parameter on 80 GB"),
    cell("covey", "1.5b", "full", 24, "1.5B full-parameter under 24 GiB"),
    cell("covey", "7b", "qlora", 16, "7B QLoRA under 16 GiB"),
    cell("covey", "1.5b", "defaults", 80, "1.5B covey defaults vs TRL defaults; update vs bf16 matmul peak"),
    cell("trl", "1.5b", "defaults", 80, "1.5B covey defaults vs TRL defaults"),
)


def capacity_cells(trainers=("covey", "trl"), with_14b=True, smoke=False, sizes=("0.5b", "1.5b", "3b", "7b"),
                   caps=(24, 80)) -> list[Cell]:
    """The acceptance cells, TRL's side of the first three, then the grid small to large, 14B QLoRA last; on a CPU
    (smoke) covey's cells that run there."""
    if smoke:
        return [cell("covey", "smoke", "defaults", 0, "smoke"), cell("covey", "smoke", "lora", 0)]
    cells = [*ACCEPTANCE, *(cell("trl", c.size, *c.spec.values(), "TRL's side of: " + c.why) for c in ACCEPTANCE[:3])]
    grid = [cell(t, size, setup, cap) for size in sizes for setup in ("full", "lora", "qlora") for cap in caps
            for t in trainers] + ([cell(t, "14b", "qlora", cap) for cap in caps for t in trainers] if with_14b else [])
    return [c for c in cells + [g for g in grid if g.name not in {c.name for c in cells}] if c.trainer in trainers]


def describe(c: Cell) -> str:
    settings = SETUPS[c.trainer][c.spec["setup"]]
    return (" ".join(settings) if isinstance(settings, list) else ", ".join(f"{k}={v}" for k, v in settings.items())
            ) or "(as it ships)"


def capacity_record(c: Cell, result: dict | None, log: Path) -> dict:
    """Whether a step ran (else why not: out of memory, covey's fit check, the log's last line, no time left),
    peak GiB, median s/step of steps 2..N, the first step's seconds."""
    record = {"name": c.name, **c.spec, "why": c.why, "settings": describe(c), "runs": bool((result or {}).get("steps"))}
    if record["runs"]:
        peak = result.get("peak_gpu_mib")
        return {**record, **medians(result["steps"], ("step_s", "update_s")), "first_step_s": result["steps"][0][
            "step_s"], "peak_gib": peak / 1024 if peak else None}
    text = log.read_text(errors="replace") if log.is_file() else ""
    for mark, reason in (("OutOfMemoryError", "out of memory"), ("CUDA out of memory", "out of memory"),
                         ("does not fit", "covey's fit check refused it")):
        if mark in text:
            return {**record, "error": f"{reason}: " + next(x for x in text.splitlines() if mark in x).strip()[:200]}
    lines = [x.strip() for x in text.splitlines() if x.strip()]
    return {**record, "error": lines[-1][:200] if lines else "not run (no time left in the budget)"}


def capacity_table(records: list[dict]) -> str:
    def number(value, spec: str) -> str:
        return "-" if value is None else f"{value:{spec}}"

    return table(["cell", "runs", "peak GiB", "s/step", "first step s", "settings", "answers"],
                 [[r["name"], "yes" if r["runs"] else f"no: {r['error']}", number(r.get("peak_gib"), ".1f"),
                   number(r.get("step_s"), ".2f"), number(r.get("first_step_s"), ".1f"), r["settings"], r["why"]]
                  for r in records])


# --------------------------------------------------------------------------- speed


def speed_cells(args) -> list[Cell]:
    """Per size: covey (with --profile: one more step under torch.profiler), TRL, the variant, then covey under
    each further rollout.decode mode (auto is graphs on a GPU)."""
    modes = [m for m in args.decode_modes.split(",") if m not in ("", "auto", "graphs")]
    runs = {"covey": ("covey", {"profile": args.profile}), "trl": ("trl", {"setup": "gc"} if args.trl_gc else {}),
            "covey-variant": ("covey", {"keys": args.covey_variant.split()}),
            **{f"covey-{mode}": ("covey", {"keys": [f"rollout.decode={mode}"]}) for mode in modes}}
    labels = [*(r for r in args.runs.split(",") if r), *(["covey-variant"] if args.covey_variant else []),
              *(f"covey-{m}" for m in modes)]
    sizes = [s for s in (args.sizes or ("smoke" if args.smoke else "0.5b,1.5b")).split(",") if s]
    return [Cell(f"{label}-{size}", runs[label][0], size, runs[label][1]) for size in sizes for label in labels]


def gpu_summary(size: str, device: dict, shape: dict, results: dict, workload: dict) -> dict:
    """A size's row: each run's medians and rates (`results`: label -> result or None), the decode step against its
    floor (floor_bytes over the copy bandwidth), covey against TRL."""
    flops = update_flops(shape, workload, shape["prompt_tokens_mean"])
    floor_ms = 1000 * floor_bytes(shape, workload, shape["prompt_tokens_mean"]) / device.get("copy_bytes_per_s", 1e30)
    out = {"size": size, "update_model_flops": flops, "decode_floor_ms": floor_ms, "labels": list(results)}
    for label, res in results.items():
        if (res or {}).get("steps"):
            med, decode = medians(res["steps"]), res.get("decode", {}).get("step_ms")
            out[label] = {**med, "peak_gpu_gib": res["peak_gpu_mib"] / 1024 if res.get("peak_gpu_mib") else None,
                          "generate_ms_per_token": 1000 * med["generate_s"] / workload["new_tokens"],
                          "update_tflops": flops / med["update_s"] / 1e12, "decode_ms": decode,
                          "decode_vs_floor": decode / floor_ms if decode else None,
                          "update_share_of_peak": flops / med["update_s"] / 1e12 / device["matmul_tflops"]
                          if device else None, "detail": {k: v for k, v in res.items() if k != "steps"}}
    if (covey := out.get("covey")) and (trl := out.get("trl")):
        out["step_vs_trl"] = covey["step_s"] / trl["step_s"]
        if covey["peak_gpu_gib"] and trl["peak_gpu_gib"]:
            out["memory_vs_trl"] = covey["peak_gpu_gib"] / trl["peak_gpu_gib"]
    return out


def verdicts(row: dict) -> list[str]:
    """Each target that applies to the size: measured, target, met or not."""
    lines = []
    for key, goals in TARGETS.items():
        value, goal = row.get(key) if key.endswith("_vs_trl") else row.get("covey", {}).get(key), goals.get(row["size"])
        if goal is not None and value is not None:
            higher = key == "update_share_of_peak"
            lines.append(f"{row['size']} {key}: {value:.3f} (target {'>=' if higher else '<='} {goal}) "
                         f"{'met' if (value >= goal if higher else value <= goal) else 'NOT MET'}")
    return lines


def gpu_table(rows: list[dict]) -> str:
    def cells(r: dict) -> list[str]:
        share = f" ({100 * r['update_share_of_peak']:.0f}%)" if r["update_share_of_peak"] is not None else ""
        return [*(f"{r[k]:.2f}" for k in ("step_s", "generate_s", "logprobs_s", "update_s")),
                "-" if r["peak_gpu_gib"] is None else f"{r['peak_gpu_gib']:.2f}", f"{r['generate_ms_per_token']:.2f}",
                f"{r['decode_ms']:.3f} ({r['decode_vs_floor']:.1f} x)" if r["decode_ms"] else "-",
                f"{r['update_tflops']:.1f}{share}"]

    return table(["shape", "run", "median s/step", "generate s", "reference s", "update s", "peak GPU GiB",
                  "generate ms/token", "decode ms/step (x floor)", "update TFLOP/s (% of bf16 peak)"],
                 [[row["size"], label, *(cells(row[label]) if label in row else ["failed or skipped"] + [""] * 7)]
                  for row in rows for label in row["labels"]])


# --------------------------------------------------------------------------- the driver


def parse_args(argv=None, capacity: bool = False):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--smoke", action="store_true", help="tiny shapes and few tokens: runs on a CPU")
    p.add_argument("--tokenizer", default="", help="folder with SmolLM2's tokenizer files (default: covey's cache)")
    p.add_argument("--budget-s", type=float, default=420.0 if capacity else 440.0, help="stop starting runs after")
    p.add_argument("--work", default="", help="folder for the model folders (default: a temporary one)")
    p.add_argument("--out", default="", help="results prefix (default: a temporary folder)")
    if capacity:
        p.add_argument("--dry-run", action="store_true", help="print the cells and their settings; run nothing")
        p.add_argument("--trainers", default="covey,trl", help="covey, trl or both")
        p.add_argument("--no-14b", action="store_true", help="leave out the 14B QLoRA cells")
        return p.parse_args(argv)
    p.add_argument("--sizes", default="", help="comma-separated from " + ", ".join(SHAPES))
    p.add_argument("--runs", default="covey,trl", help="covey, trl or both")
    p.add_argument("--decode-modes", default="", help="a covey run per size and further rollout.decode mode")
    p.add_argument("--covey-variant", default="", help="one more covey run per size with these key=value settings")
    p.add_argument("--profile", action="store_true", help="covey: one more step under torch.profiler (its log)")
    p.add_argument("--trl-gc", action="store_true", help="TRL with gradient checkpointing, its own default")
    return p.parse_args(argv)


def main(argv=None, capacity: bool = False) -> int:
    args = parse_args(argv, capacity)
    cells = capacity_cells(tuple(args.trainers.split(",")), not args.no_14b, args.smoke) if capacity else \
        speed_cells(args)
    if capacity and args.dry_run:
        print("\n".join(f"{i:2d}. {c.name}: {describe(c)}" + (f"  [{c.why}]" if c.why else "")
                        for i, c in enumerate(cells, 1)))
        return 0
    workload = ("capacity" if capacity else "gpu") + ("-smoke" if args.smoke else "")
    w, out = WORKLOADS[workload], out_prefix(args.out, "bench")
    children = Children(out.parent / f"{out.name}-logs", args.budget_s)
    device = children.run("covey", "device", "device", {}) or {}
    results, shapes = run_cells(children, cells, Path(args.work or tempfile.mkdtemp(prefix="gpu-bench-models-")),
                                {"workload": workload, "steps": w["steps"], "tokenizer": args.tokenizer},
                                out.with_suffix(".jsonl"))
    text = [f"device: {device.get('name', 'unknown')}; copy {device.get('copy_bytes_per_s', 0) / 1e12:.2f} TB/s; bf16 "
            f"matmul peak {device.get('matmul_tflops', 0):.1f} TFLOP/s; medians of steps 2..{w['steps']}",
            "workload: " + json.dumps(w), *(f"{size}: {shape['describe']}" for size, shape in shapes.items()), ""]
    if capacity:
        rows = [capacity_record(c, results[c.name], children.log_dir / f"{c.name}.log") for c in cells]
        publish(out, "\n".join([*text, capacity_table(rows)]), {"device": device, "workload": w, "records": rows})
        return int(not all(r["runs"] or "does not fit" in r["error"] or "out of memory" in r["error"]
                           for r in rows[:len(ACCEPTANCE)]))
    rows = [gpu_summary(size, device, shape, {c.name.removesuffix(f"-{size}"): results[c.name] for c in cells
                                              if c.size == size}, w) for size, shape in shapes.items()]
    publish(out, "\n".join([*text, *(f"{r['size']}: decode floor {r['decode_floor_ms']:.3f} ms/step" for r in rows),
                            "", gpu_table(rows), "", *(line for r in rows for line in verdicts(r))]),
            {"device": device, "workload": w, "rows": rows})
    return int(children.failed > 0)


if __name__ == "__main__":
    sys.exit(main())
