"""covey vs TRL's GRPOTrainer on one GPU (docs/scale.md; scripts/gpu_speed.sh, scripts/gpu_capacity.sh): speed
(`bench.gpu`: phases, peak memory, the decode step against its bandwidth floor, the update against the bf16 matmul
peak) and capacity (`bench.gpu_capacity`: which sizes a step fits under a memory cap, full-parameter, LoRA, QLoRA).
Each run and each random model folder is a child of its own; this process never touches the GPU.

    python -m bench.gpu --out LOGS/bench --decode-modes compile   # ~6 min on an H100; --smoke: a CPU, seconds
    python -m bench.gpu_capacity --dry-run                         # the capacity cells in order, their settings"""

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
    name: str
    trainer: str
    size: str
    spec: dict = field(default_factory=dict)
    why: str = ""  # a capacity cell's question


def run_cells(children: Children, cells: list[Cell], work: Path, common: dict, jsonl: Path):
    """The cells while the budget lasts, each a line of `jsonl`, a size's model folder built once: (results, shapes)."""
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
            f.write(json.dumps({**(results[cell.name] or {}), "name": cell.name}) + "\n")
        if last[cell.size] == i:
            shutil.rmtree(folder, ignore_errors=True)
    return results, {size: shape for size, shape in shapes.items() if shape}


def cell(trainer: str, size: str, setup: str, cap_gib: float, why: str = "") -> Cell:
    return Cell(f"{trainer}-{size}-{setup}-{cap_gib:g}g", trainer, size, {"setup": setup, "cap_gib": cap_gib}, why)


ACCEPTANCE = (
    cell("covey", "7b", "full", 80, "7B full-parameter on 80 GB"),
    cell("covey", "1.5b", "full", 24, "1.5B full-parameter under 24 GiB"),
    cell("covey", "7b", "qlora", 16, "7B QLoRA under 16 GiB"),
    cell("covey", "1.5b", "defaults", 80, "1.5B covey defaults vs TRL defaults; update vs bf16 matmul peak"),
    cell("trl", "1.5b", "defaults", 80, "1.5B covey defaults vs TRL defaults"),
)


def capacity_cells(trainers=("covey", "trl"), with_14b=True, sizes=("0.5b", "1.5b", "3b", "7b"), caps=(24, 80)):
    """The acceptance cells, TRL's side of the first three, then the grid small to large, 14B QLoRA last."""
    cells = [*ACCEPTANCE, *(cell("trl", c.size, *c.spec.values(), "TRL's side of: " + c.why) for c in ACCEPTANCE[:3])]
    grid = [cell(t, size, setup, cap) for size in sizes for setup in ("full", "lora", "qlora") for cap in caps
            for t in trainers] + ([cell(t, "14b", "qlora", cap) for cap in caps for t in trainers] if with_14b else [])
    return [c for c in cells + [g for g in grid if g.name not in {c.name for c in cells}] if c.trainer in trainers]


def describe(c: Cell) -> str:
    settings = SETUPS[c.trainer][c.spec["setup"]]
    return (" ".join(settings) if isinstance(settings, list) else ", ".join(f"{k}={v}" for k, v in settings.items())
            ) or "(as it ships)"


def why_not(log: Path) -> str:
    text = [line.strip()[:200] for line in (log.read_text(errors="replace") if log.is_file() else "").splitlines()]
    found = [x for x in text if "out of memory" in x or "OutOfMemoryError" in x or "does not fit" in x]
    return (found or [x for x in text if x][-1:] or ["not run: no time left in the budget"])[0]


def speed_cells(args) -> list[Cell]:
    """Per size: covey, TRL, the variant, covey under each further rollout.decode mode (auto is graphs on a GPU)."""
    modes = [m for m in args.decode_modes.split(",") if m not in ("", "auto", "graphs")]
    runs = {"covey": ("covey", {"profile": args.profile}), "trl": ("trl", {"setup": "gc"} if args.trl_gc else {}),
            "covey-variant": ("covey", {"keys": args.covey_variant.split()}),
            **{f"covey-{mode}": ("covey", {"keys": [f"rollout.decode={mode}"]}) for mode in modes}}
    labels = [*(r for r in args.runs.split(",") if r), *(["covey-variant"] if args.covey_variant else []),
              *(f"covey-{m}" for m in modes)]
    sizes = [s for s in (args.sizes or ("smoke" if args.smoke else "0.5b,1.5b")).split(",") if s]
    return [Cell(f"{label}-{size}", runs[label][0], size, runs[label][1]) for size in sizes for label in labels]


def gpu_summary(size: str, device: dict, shape: dict, results: dict, workload: dict) -> dict:
    """A size's row: each run's medians and rates, its decode step against the floor, covey against TRL."""
    flops = update_flops(shape, workload, shape["prompt_tokens_mean"])
    floor_ms = 1000 * floor_bytes(shape, workload, shape["prompt_tokens_mean"]) / device.get("copy_bytes_per_s", 1e30)
    out = {"size": size, "update_model_flops": flops, "decode_floor_ms": floor_ms, "labels": list(results)}
    for label, res in results.items():
        if (res or {}).get("steps"):
            med, decode = medians(res["steps"]), res.get("decode", {}).get("step_ms")
            out[label] = {**med, "peak_gpu_gib": res["peak_gpu_mib"] / 1024 if res.get("peak_gpu_mib") else None,
                          "first_step_s": res["steps"][0]["step_s"],
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
    """Each target of the size: measured, target, met or not (a share of the peak is met from above)."""
    checks = [(k, goals[row["size"]], row.get(k) if k.endswith("_vs_trl") else row.get("covey", {}).get(k))
              for k, goals in TARGETS.items() if row["size"] in goals]
    return [f"{row['size']} {k}: {v:.3f} (target {'>=' if k.endswith('peak') else '<='} {g}) "
            f"{'met' if (v >= g if k.endswith('peak') else v <= g) else 'NOT MET'}" for k, g, v in checks
            if v is not None]


def gpu_table(rows: list[dict]) -> str:
    def cells(r: dict) -> list[str]:
        share = f" ({100 * r['update_share_of_peak']:.0f}%)" if r["update_share_of_peak"] is not None else ""
        return [*(f"{r[k]:.2f}" for k in ("step_s", "first_step_s", "generate_s", "logprobs_s", "update_s")),
                "-" if r["peak_gpu_gib"] is None else f"{r['peak_gpu_gib']:.2f}", f"{r['generate_ms_per_token']:.2f}",
                f"{r['decode_ms']:.3f} ({r['decode_vs_floor']:.1f} x)" if r["decode_ms"] else "-",
                f"{r['update_tflops']:.1f}{share}"]

    return table(["shape", "run", "median s/step", "first step s", "generate s", "reference s", "update s",
                  "peak GPU GiB", "generate ms/token", "decode ms/step (x floor)", "update TFLOP/s (% of bf16 peak)"],
                 [[row["size"], label, *(cells(row[label]) if label in row else ["no step"] + [""] * 8)]
                  for row in rows for label in row["labels"]])


def parse_args(argv=None, capacity: bool = False):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokenizer", default="", help="folder with SmolLM2's tokenizer files (default: covey's cache)")
    p.add_argument("--budget-s", type=float, default=420.0 if capacity else 440.0, help="stop starting runs after")
    p.add_argument("--work", default="", help="folder for the model folders (default: a temporary one)")
    p.add_argument("--out", default="", help="results prefix (default: a temporary folder)")
    if capacity:
        p.add_argument("--dry-run", action="store_true", help="print the cells and their settings; run nothing")
        p.add_argument("--trainers", default="covey,trl", help="covey, trl or both")
        p.add_argument("--no-14b", action="store_true", help="leave out the 14B QLoRA cells")
        return p.parse_args(argv)
    p.add_argument("--smoke", action="store_true", help="tiny shapes and few tokens: runs on a CPU")
    p.add_argument("--sizes", default="", help="comma-separated from " + ", ".join(SHAPES))
    p.add_argument("--runs", default="covey,trl", help="covey, trl or both")
    p.add_argument("--decode-modes", default="", help="a covey run per size and further rollout.decode mode")
    p.add_argument("--covey-variant", default="", help="one more covey run per size with these key=value settings")
    p.add_argument("--profile", action="store_true", help="covey: one more step under torch.profiler (its log)")
    p.add_argument("--trl-gc", action="store_true", help="TRL with gradient checkpointing, its own default")
    return p.parse_args(argv)


def main(argv=None, capacity: bool = False) -> int:
    args = parse_args(argv, capacity)
    cells = capacity_cells(tuple(args.trainers.split(",")), not args.no_14b) if capacity else speed_cells(args)
    if capacity and args.dry_run:
        print("\n".join(f"{i:2d}. {c.name}: {describe(c)}" + (f"  [{c.why}]" if c.why else "")
                        for i, c in enumerate(cells, 1)))
        return 0
    workload = "capacity" if capacity else "gpu-smoke" if args.smoke else "gpu"
    w, out = WORKLOADS[workload], out_prefix(args.out, "bench")
    children = Children(out.parent / f"{out.name}-logs", args.budget_s)
    device = children.run("covey", "device", "device", {}) or {}
    results, shapes = run_cells(children, cells, Path(args.work or tempfile.mkdtemp(prefix="gpu-bench-models-")),
                                {"workload": workload, "steps": w["steps"], "tokenizer": args.tokenizer},
                                out.with_suffix(".jsonl"))
    rows = [gpu_summary(size, device, shape, {c.name if capacity else c.name.removesuffix(f"-{size}"): results[c.name]
                                              for c in cells if c.size == size}, w) for size, shape in shapes.items()]
    why = {c.name: why_not(children.log_dir / f"{c.name}.log") for c in cells if not (results[c.name] or {}).get(
        "steps")}
    lines = [f"device: {device.get('name', 'unknown')}; copy {device.get('copy_bytes_per_s', 0) / 1e12:.2f} TB/s; "
             f"bf16 matmul peak {device.get('matmul_tflops', 0):.1f} TFLOP/s; medians of steps 2..{w['steps']}",
             "workload: " + json.dumps(w), *(f"{r['size']}: {shapes[r['size']]['describe']}; decode floor "
                                            f"{r['decode_floor_ms']:.3f} ms/step" for r in rows),
             "", gpu_table(rows), "", *(f"{name}: no step ({text})" for name, text in why.items())]
    publish(out, "\n".join(lines + ([] if capacity else [v for r in rows for v in verdicts(r)])),
            {"device": device, "workload": w, "rows": rows, "no_step": why})
    if capacity:  # each acceptance cell ran, or ran out of memory, or covey's fit check refused it
        return int(any(c.name in why and not any(m in why[c.name] for m in ("out of memory", "OutOfMemory",
                                                                            "does not fit")) for c in ACCEPTANCE))
    return int(children.failed > 0)


if __name__ == "__main__":
    sys.exit(main())
