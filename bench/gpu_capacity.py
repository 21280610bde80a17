"""GPU capacity: which model sizes a GRPO step fits under a memory cap, full-parameter, LoRA and QLoRA, for
covey and for TRL's GRPOTrainer; per cell whether a step runs, peak GPU memory, s/step and the first step's time.

    python -m bench.gpu_capacity --out LOGS/capacity      # one GPU, ~7 min (scripts/gpu_capacity.sh runs it)
    python -m bench.gpu_capacity --dry-run                 # the cells in their order and each one's settings
    python -m bench.gpu_capacity --smoke --out /tmp/cap    # a CPU: tiny shapes, covey's cells that run there

Models: random Qwen2 models of Qwen2.5-0.5B, -1.5B, -3B, -7B (and -14B for QLoRA) dimensions, built in bf16
and saved once per size (bench/workloads.py). Workload `capacity`: 8 prompts x 8 samples x 512 new tokens at
full length, micro-batches of 8, 3 steps (s/step is the median of steps 2..3). Each cell is a child process
(an out-of-memory or a hang costs that cell only, killed at its time limit) whose CUDA allocator is capped
at the cell's GiB (a cap at or above the card is the card); covey's budget, train.gpu_memory_gib=0, is then
the cap less 10%. The cells run in this order while `--budget-s` lasts: the acceptance cells, TRL's side of
the first three, then the grid (sizes x setups x caps x trainers). The setups are bench/workloads.py SETUPS:
covey's `defaults` as it ships, `full` (bf16 weights, 8-bit AdamW, gradient checkpointing, fused kernels),
`lora` / `qlora` (rank-16 adapters on every linear layer, bf16 / 4-bit NF4 base); TRL 1.16's `defaults` (its
fp32 load, bf16 autocast, gradient checkpointing) and its documented memory settings for the same three.
Results: one JSON line per cell in `<out>.jsonl` as it ends, a table and the acceptance lines in `<out>.md`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path
from typing import NamedTuple

from bench.gpu import Cell, measure_device, run_cells
from bench.harness import Children, medians, out_prefix, publish
from bench.report import table
from bench.workloads import SETUPS, WORKLOADS, update_flops

CELL_LIMIT_S = {"0.5b": 60, "1.5b": 90, "3b": 120, "7b": 150, "14b": 180, "smoke": 120}
"""Seconds a cell may take (load, 3 steps) before it is killed: one hang cannot eat the budget."""


class Spec(NamedTuple):
    trainer: str
    size: str
    setup: str
    cap_gib: float
    why: str = ""  # the acceptance question it answers

    @property
    def name(self) -> str:
        return f"{self.trainer}-{self.size}-{self.setup}-{self.cap_gib:g}g"

    def cell(self) -> Cell:
        return Cell(self.name, self.trainer, self.size, ("--setup", self.setup, "--cap-gib", str(self.cap_gib)),
                    limit_s=CELL_LIMIT_S.get(self.size, 120))


ACCEPTANCE = (
    Spec("covey", "7b", "full", 80, "7B full-parameter on 80 GB"),
    Spec("covey", "1.5b", "full", 24, "1.5B full-parameter under 24 GiB"),
    Spec("covey", "7b", "qlora", 16, "7B QLoRA under 16 GiB"),
    Spec("covey", "1.5b", "defaults", 80, "1.5B covey defaults vs TRL defaults; update vs bf16 matmul peak"),
    Spec("trl", "1.5b", "defaults", 80, "1.5B covey defaults vs TRL defaults"),
)


def plan_cells(sizes=("0.5b", "1.5b", "3b", "7b"), caps=(24, 80), trainers=("covey", "trl"), with_14b=True,
               smoke: bool = False) -> list[Spec]:
    """The acceptance cells, TRL's counterparts of the first three, then the grid small to large; 14B QLoRA last."""
    if smoke:  # what runs on a CPU: no memory cap, no 8-bit optimizer or 4-bit weights, no TRL
        return [Spec("covey", "smoke", "defaults", 0, "smoke"), Spec("covey", "smoke", "lora", 0)]
    cells = [*ACCEPTANCE, *(Spec("trl", *c[1:4], "TRL's side of: " + c.why) for c in ACCEPTANCE[:3])]
    grid = [Spec(t, size, setup, cap) for size in sizes for setup in ("full", "lora", "qlora") for cap in caps
            for t in trainers] + ([Spec(t, "14b", "qlora", cap) for cap in caps for t in trainers] if with_14b else [])
    seen = {c.name for c in cells}
    return [c for c in cells + [c for c in grid if c.name not in seen] if c.trainer in trainers]


def describe(spec: Spec) -> str:
    settings = SETUPS[spec.trainer][spec.setup]
    text = " ".join(settings) if isinstance(settings, list) else ", ".join(f"{k}={v}" for k, v in settings.items())
    return text or "(as it ships)"


def cell_record(spec: Spec, result: dict | None, log: Path) -> dict:
    """A cell's JSON line: whether a step ran, peak GiB, median s/step of steps 2..N, the first step's time."""
    record = {**spec._asdict(), "name": spec.name, "settings": describe(spec), "runs": False}
    steps = (result or {}).get("steps") or []
    if not steps:
        return {**record, "error": failure_line(log)}
    peak = result.get("peak_gpu_mib")
    return {**record, **medians(steps, ("step_s", "update_s")), "runs": True, "steps": len(steps),
            "first_step_s": steps[0]["step_s"], "peak_gib": peak / 1024 if peak else None,
            "partial": bool(result.get("partial"))}


def failure_line(log: Path) -> str:
    """Why a cell did not run: out of memory, covey's fit check, the time limit, or the log's last line."""
    text = log.read_text(errors="replace") if log.is_file() else ""
    for mark, reason in (("OutOfMemoryError", "out of memory"), ("CUDA out of memory", "out of memory"),
                         ("does not fit", "covey's fit check refused it")):
        if mark in text:
            return f"{reason}: {next(x for x in text.splitlines() if mark in x).strip()[:200]}"
    lines = [x for x in text.splitlines() if x.strip()]
    return lines[-1].strip()[:200] if lines else "not run (no time left in the budget)"


def number(value, spec: str) -> str:
    return f"{value:{spec}}" if isinstance(value, (int, float)) else "-"


def capacity_table(records: list[dict]) -> str:
    return table(["cell", "runs", "peak GiB", "s/step", "first step s", "settings"],
                 [[r["name"], "yes" if r["runs"] else f"no: {r.get('error', '')}", number(r.get("peak_gib"), ".1f"),
                   number(r.get("step_s"), ".2f"), number(r.get("first_step_s"), ".1f"), r["settings"]]
                  for r in records])


def acceptance_lines(records: list[dict], device: dict, shapes: dict, workload: dict) -> list[str]:
    """The answers: each acceptance cell ran or not; covey / TRL peak and step ratios at 1.5B defaults; the
    update's model FLOP rate at 1.5B against the bf16 matmul peak; first step against a steady one."""
    by = {r["name"]: r for r in records}
    lines = [f"{c.why}: " + (f"runs, peak {r['peak_gib']:.1f} GiB, {r['step_s']:.1f} s/step" if r.get("runs")
                             else f"does not run ({r.get('error', 'not run')})")
             for c in ACCEPTANCE[:3] for r in [by.get(c.name, {})]]
    covey, trl = by.get("covey-1.5b-defaults-80g", {}), by.get("trl-1.5b-defaults-80g", {})
    if covey.get("runs") and trl.get("runs"):
        lines.append(f"1.5B defaults, covey / TRL: peak memory {covey['peak_gib'] / trl['peak_gib']:.2f}, "
                     f"step time {covey['step_s'] / trl['step_s']:.2f}")
    if covey.get("runs") and "1.5b" in shapes and device.get("matmul_tflops"):
        tflops = update_flops(shapes["1.5b"], workload, shapes["1.5b"]["prompt_tokens_mean"]) / covey["update_s"] / 1e12
        lines.append(f"1.5B covey defaults update: {tflops:.1f} TFLOP/s = {tflops / device['matmul_tflops']:.2f} of "
                     f"the bf16 matmul peak ({device['matmul_tflops']:.0f} TFLOP/s)")
    ran = [r for r in records if r.get("runs") and r.get("steps", 0) > 1]
    if ran:
        ratios = [r["first_step_s"] / r["step_s"] for r in ran]
        lines.append("first step / steady step: " + ", ".join(f"{r['name']} {x:.1f}x" for r, x in zip(ran, ratios))
                     + f" (median {statistics.median(ratios):.1f}x)")
    return lines


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=0, help="optimizer steps per cell (default: the workload's)")
    p.add_argument("--tokenizer", default="", help="folder with SmolLM2's tokenizer files (default: covey's cache)")
    p.add_argument("--smoke", action="store_true", help="a CPU: tiny shapes, covey's cells that run there")
    p.add_argument("--dry-run", action="store_true", help="print the cells and their settings; run nothing")
    p.add_argument("--trainers", default="covey,trl", help="covey, trl or both")
    p.add_argument("--no-14b", action="store_true", help="leave out the 14B QLoRA cells")
    p.add_argument("--budget-s", type=float, default=420.0, help="stop starting cells after this long")
    p.add_argument("--work", default="", help="folder for the model folders (default: a temporary one)")
    p.add_argument("--out", default="", help="results prefix (default: a temporary folder)")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    specs = plan_cells(trainers=tuple(t for t in args.trainers.split(",") if t), with_14b=not args.no_14b,
                       smoke=args.smoke)
    if args.dry_run:
        for i, spec in enumerate(specs, 1):
            print(f"{i:2d}. {spec.name}: {describe(spec)}" + (f"  [{spec.why}]" if spec.why else ""))
        return 0
    workload = "capacity-smoke" if args.smoke else "capacity"
    w, steps = WORKLOADS[workload], args.steps or WORKLOADS[workload]["steps"]
    out = out_prefix(args.out, "cap")
    children = Children(out.parent / f"{out.name}-logs", args.budget_s)
    jsonl, records, by_name = out.with_suffix(".jsonl"), [], {s.name: s for s in specs}
    jsonl.write_text("")
    device = measure_device(children)

    def record(cell: Cell, result: dict | None) -> None:
        records.append(cell_record(by_name[cell.name], result, children.log_dir / f"{cell.name}.log"))
        with open(jsonl, "a") as f:
            f.write(json.dumps(records[-1]) + "\n")
        r = records[-1]
        children.say(f"{r['name']}: " + (f"peak {r['peak_gib'] or 0:.1f} GiB, {r['step_s']:.2f} s/step" if r["runs"]
                                          else f"no: {r['error']}"))

    common = ["--workload", workload, "--steps", str(steps), *(["--tokenizer", args.tokenizer] if args.tokenizer
                                                                else [])]
    _, shapes = run_cells(children, [s.cell() for s in specs],
                          Path(args.work or tempfile.mkdtemp(prefix="capacity-models-")), common, record)
    text = "\n".join([f"device: {device.get('name', 'unknown')}; bf16 matmul peak "
                      f"{device.get('matmul_tflops', 0):.1f} TFLOP/s",
                      "workload: " + json.dumps({k: v for k, v in w.items() if k != "steps"})
                      + f"; {steps} steps, s/step the median of steps 2..{steps}",
                      *[f"{size}: {shape['describe']}" for size, shape in shapes.items()], "",
                      capacity_table(records), "", *acceptance_lines(records, device, shapes, w)])
    publish(out, text, {"device": device, "workload": w, "records": records})
    return 0 if all(r["runs"] or "does not fit" in r.get("error", "") or "out of memory" in r.get("error", "")
                    for r in records[:len(ACCEPTANCE)]) else 1


if __name__ == "__main__":
    sys.exit(main())
