"""GPU capacity: which model sizes a GRPO step fits under a memory cap, full-parameter, LoRA and QLoRA, for
covey and for TRL's GRPOTrainer; per cell whether a step runs, peak GPU memory, s/step and the first step's time.

    python -m bench.gpu_capacity --out LOGS/capacity      # one GPU, ~7 min (scripts/gpu_capacity.sh runs it)
    python -m bench.gpu_capacity --dry-run                 # the cells in their order and each one's settings
    python -m bench.gpu_capacity --smoke --out /tmp/cap    # a CPU: tiny shapes, covey's cells that run there

Models: random Qwen2 models of Qwen2.5-0.5B, -1.5B, -3B, -7B (and -14B for QLoRA) dimensions
(bench/workloads.py SHAPES) built on the GPU in bf16 and saved once (no download; SmolLM2's tokenizer).
Workload `capacity`: 8 prompts x 8 samples x 512 new tokens at fixed length, micro-batches of 8, 3 steps
(step 1 is the first step; s/step is the median of steps 2..3). Each cell is a child process (its peak is
its own; an out-of-memory or a hang costs that cell only, killed at its share of the budget) whose CUDA
allocator is capped with torch.cuda.set_per_process_memory_fraction at the cell's GiB (a cap at or above
the card is the card). covey's budget, train.gpu_memory_gib=0, is then the cap less 10%.

The cells run in this order while `--budget-s` lasts: the acceptance cells (ACCEPTANCE), then the rest
of the grid (sizes x setups x caps x trainers). The setups (SETUPS, printed with each cell):

- covey `defaults`: `covey train grpo` as it ships on a GPU (fp32 weights and AdamW, bf16 autocast, bf16
  sampling copy, CUDA-graph decoding); `full`: bf16 weights, optim.name=adamw_8bit, gradient checkpointing,
  model.fused_kernels=auto; `lora` / `qlora`: rank-16 adapters on every linear layer, bf16 / 4-bit NF4 base.
- TRL 1.16 `defaults`: its model load (fp32), bf16 autocast, gradient checkpointing (TRL's default);
  `full`: model_init_kwargs dtype bf16, gradient_checkpointing, optim="adamw_8bit", use_liger_kernel;
  `lora` / `qlora`: the same with peft's LoraConfig (and BitsAndBytesConfig NF4) handed to GRPOTrainer.

Results: one JSON line per cell in `<out>.jsonl` as it ends, a markdown table and the acceptance lines in
`<out>.md`; each child's log in `<out>-logs/`.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from types import SimpleNamespace

from bench.harness import Children, write_json
from bench.report import step_medians
from bench.workloads import WORKLOADS, update_flops

LORA = ["model.lora_rank=16", "model.lora_alpha=32", "model.gradient_checkpointing=true", "model.fused_kernels=auto"]
TRL_MEMORY = {"model_init_kwargs": {"dtype": "bfloat16"}, "gradient_checkpointing": True, "optim": "adamw_8bit",
              "use_liger_kernel": True}
SETUPS = {
    "covey": {"defaults": [],
              "full": ["model.dtype=bfloat16", "optim.name=adamw_8bit", "model.gradient_checkpointing=true",
                       "model.fused_kernels=auto"],
              "lora": ["model.dtype=bfloat16", *LORA],
              "qlora": ["model.load_in_4bit=true", *LORA]},
    "trl": {"defaults": {"gradient_checkpointing": True},
            "full": TRL_MEMORY,
            "lora": {**TRL_MEMORY, "peft_config": "LoraConfig(r=16, lora_alpha=32, target_modules='all-linear')"},
            "qlora": {**TRL_MEMORY, "peft_config": "LoraConfig(r=16, lora_alpha=32, target_modules='all-linear')",
                      "quantization_config": "BitsAndBytesConfig(nf4, double quantization, bf16 compute)"}},
}
TRAINER_KEYS = ("peft_config", "quantization_config")  # GRPOTrainer's arguments, not GRPOConfig's


@dataclass(frozen=True)
class Cell:
    trainer: str
    size: str
    setup: str
    cap_gib: float
    why: str = ""  # the acceptance question it answers

    @property
    def name(self) -> str:
        return f"{self.trainer}-{self.size}-{self.setup}-{self.cap_gib:g}g"

    def settings(self):
        return SETUPS[self.trainer][self.setup]


ACCEPTANCE = (
    Cell("covey", "7b", "full", 80, "7B full-parameter on 80 GB"),
    Cell("covey", "1.5b", "full", 24, "1.5B full-parameter under 24 GiB"),
    Cell("covey", "7b", "qlora", 16, "7B QLoRA under 16 GiB"),
    Cell("covey", "1.5b", "defaults", 80, "1.5B covey defaults vs TRL defaults; update vs bf16 matmul peak"),
    Cell("trl", "1.5b", "defaults", 80, "1.5B covey defaults vs TRL defaults"),
)


def plan_cells(sizes=("0.5b", "1.5b", "3b", "7b"), caps=(24, 80), trainers=("covey", "trl"), with_14b=True,
               smoke: bool = False) -> list[Cell]:
    """The acceptance cells, TRL's counterparts of the first three, then the grid small to large; 14B QLoRA last."""
    if smoke:  # what runs on a CPU: no memory cap, no 8-bit optimizer or 4-bit weights, no TRL
        return [Cell("covey", "smoke", "defaults", 0, "smoke"), Cell("covey", "smoke", "lora", 0)]
    cells = list(ACCEPTANCE) + [Cell("trl", c.size, c.setup, c.cap_gib, "TRL's side of: " + c.why)
                                for c in ACCEPTANCE[:3]]
    grid = [Cell(t, size, setup, cap) for size in sizes for setup in ("full", "lora", "qlora") for cap in caps
            for t in trainers]
    grid += [Cell(t, "14b", "qlora", cap) for cap in caps for t in trainers] if with_14b else []
    seen = {(c.trainer, c.size, c.setup, c.cap_gib) for c in cells}
    cells += [c for c in grid if (c.trainer, c.size, c.setup, c.cap_gib) not in seen]
    return [c for c in cells if c.trainer in trainers]


def describe(cell: Cell) -> str:
    settings = cell.settings()
    text = " ".join(settings) if isinstance(settings, list) else ", ".join(f"{k}={v}" for k, v in settings.items())
    return text or "(as it ships)"


# --------------------------------------------------------------------------- the child: one cell


def cap_memory(cap_gib: float) -> float:
    """The CUDA allocator capped at cap_gib (the whole card when the cap is at or above it); the GiB allowed."""
    import torch
    if not torch.cuda.is_available() or cap_gib <= 0:
        return 0.0
    total = torch.cuda.get_device_properties(0).total_memory
    fraction = min(1.0, cap_gib * 2**30 / total)
    torch.cuda.set_per_process_memory_fraction(fraction, 0)
    return fraction * total / 2**30


def trl_objects(settings: dict) -> tuple[dict, dict]:
    """(GRPOConfig settings, GRPOTrainer keyword arguments) of a TRL setup, peft and bitsandbytes objects made."""
    import torch
    config = {k: v for k, v in settings.items() if k not in TRAINER_KEYS}
    kwargs = {}
    if "peft_config" in settings:
        from peft import LoraConfig
        kwargs["peft_config"] = LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules="all-linear",
                                           task_type="CAUSAL_LM")
    if "quantization_config" in settings:
        from transformers import BitsAndBytesConfig
        kwargs["quantization_config"] = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                                           bnb_4bit_use_double_quant=True,
                                                           bnb_4bit_compute_dtype=torch.bfloat16)
    return config, kwargs


def role_cell(args) -> dict:
    """One cell's GRPO steps through bench/covey_side.py's or bench/trl_side.py's GPU role."""
    cell = Cell(args.trainer, args.size, args.setup, args.cap_gib)
    allowed = cap_memory(cell.cap_gib)
    print(f"bench: {cell.name}: settings {describe(cell)}; allocator cap {allowed:.1f} GiB", flush=True)
    child = SimpleNamespace(workload=args.workload, model=args.model, steps=args.steps, profile=False,
                            result=args.result, trl_gc=False, keys=" ".join(cell.settings()) if
                            cell.trainer == "covey" else "")
    if cell.trainer == "covey":
        from bench.covey_side import role_gpu
        result = role_gpu(child)
    else:
        from bench.trl_side import role_gpu
        result = role_gpu(child, *trl_objects(cell.settings()))
    return {**result, "allowed_gib": allowed}


def role_build(args) -> dict:
    """A random Qwen2 of the size's shape, made in bf16 on the GPU (on the CPU for the smoke shape), saved."""
    import torch

    from bench.workloads import build_model
    torch.set_default_dtype(torch.bfloat16)
    return build_model(args.size, args.model, args.tokenizer, args.workload)


# --------------------------------------------------------------------------- the driver


def cell_record(cell: Cell, result: dict | None, log: Path) -> dict:
    """A cell's JSON line: whether a step ran, peak GiB, median s/step of steps 2..N, the first step's time."""
    record = {**asdict(cell), "name": cell.name, "settings": describe(cell), "runs": False}
    steps = (result or {}).get("steps") or []
    if steps:
        peak = result.get("peak_gpu_bytes")
        record.update(runs=True, steps=len(steps), first_step_s=steps[0]["step_s"],
                      step_s=step_medians(steps)["step_s"], update_s=step_medians(steps)["update_s"],
                      peak_gib=peak / 2**30 if peak else None, partial=bool(result.get("partial")))
    else:
        record["error"] = failure_line(log)
    return record


def failure_line(log: Path) -> str:
    """Why a cell did not run: out of memory, covey's fit check, the time limit, or the log's last line."""
    text = log.read_text(errors="replace") if log.is_file() else ""
    for mark, reason in (("OutOfMemoryError", "out of memory"), ("CUDA out of memory", "out of memory"),
                         ("does not fit", "covey's fit check refused it")):
        if mark in text:
            line = next((x for x in text.splitlines() if mark in x), "")
            return f"{reason}: {line.strip()[:200]}"
    lines = [x for x in text.splitlines() if x.strip()]
    return lines[-1].strip()[:200] if lines else "not run (no time left in the budget)"


def number(value, spec: str) -> str:
    return f"{value:{spec}}" if isinstance(value, (int, float)) else "-"


def table(records: list[dict]) -> str:
    head = ("| cell | runs | peak GiB | s/step | first step s | settings |\n"
            "|---|---|---|---|---|---|")
    rows = []
    for r in records:
        runs = "yes" if r["runs"] else f"no: {r.get('error', '')}"
        rows.append(f"| {r['name']} | {runs} | {number(r.get('peak_gib'), '.1f')} | {number(r.get('step_s'), '.2f')} | "
                    f"{number(r.get('first_step_s'), '.1f')} | {r['settings']} |")
    return "\n".join([head, *rows])


def acceptance_lines(records: list[dict], device: dict, shapes: dict, workload: dict) -> list[str]:
    """The answers: each acceptance cell ran or not; covey / TRL peak and step ratios at 1.5B defaults; the
    update's model FLOP rate at 1.5B against the bf16 matmul peak; first step against a steady one."""
    by = {r["name"]: r for r in records}
    lines = []
    for cell in ACCEPTANCE[:3]:
        r = by.get(cell.name, {})
        lines.append(f"{cell.why}: " + (f"runs, peak {r['peak_gib']:.1f} GiB, {r['step_s']:.1f} s/step"
                                        if r.get("runs") else f"does not run ({r.get('error', 'not run')})"))
    covey, trl = by.get("covey-1.5b-defaults-80g", {}), by.get("trl-1.5b-defaults-80g", {})
    if covey.get("runs") and trl.get("runs"):
        lines.append(f"1.5B defaults, covey / TRL: peak memory {covey['peak_gib'] / trl['peak_gib']:.2f}, "
                     f"step time {covey['step_s'] / trl['step_s']:.2f}")
    if covey.get("runs") and "1.5b" in shapes and device.get("matmul_tflops"):
        tflops = update_flops(shapes["1.5b"], workload, shapes["1.5b"]["prompt_tokens_mean"]) / covey["update_s"]
        lines.append(f"1.5B covey defaults update: {tflops / 1e12:.1f} TFLOP/s = "
                     f"{tflops / 1e12 / device['matmul_tflops']:.2f} of the bf16 matmul peak "
                     f"({device['matmul_tflops']:.0f} TFLOP/s)")
    ran = [r for r in records if r.get("runs") and r.get("steps", 0) > 1]
    if ran:
        ratios = [r["first_step_s"] / r["step_s"] for r in ran]
        lines.append("first step / steady step: " + ", ".join(f"{r['name']} {x:.1f}x" for r, x in zip(ran, ratios))
                     + f" (median {statistics.median(ratios):.1f}x)")
    return lines


CELL_LIMIT_S = {"0.5b": 60, "1.5b": 90, "3b": 120, "7b": 150, "14b": 180, "smoke": 120}
"""Seconds a cell may take (load, 3 steps) before it is killed: one hang cannot eat the budget."""


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("role", nargs="?", default="drive", choices=("drive", "cell", "build"))
    p.add_argument("--result", default="", help="cell, build: the child's result file")
    p.add_argument("--trainer", default="covey")
    p.add_argument("--size", default="")
    p.add_argument("--setup", default="defaults")
    p.add_argument("--cap-gib", type=float, default=0.0)
    p.add_argument("--model", default="", help="cell, build: the model folder")
    p.add_argument("--workload", default="capacity", choices=("capacity", "capacity-smoke"))
    p.add_argument("--steps", type=int, default=0)
    p.add_argument("--tokenizer", default="", help="folder with SmolLM2's tokenizer files (default: covey's cache)")
    p.add_argument("--smoke", action="store_true", help="a CPU: tiny shapes, covey's cells that run there")
    p.add_argument("--dry-run", action="store_true", help="print the cells and their settings; run nothing")
    p.add_argument("--trainers", default="covey,trl", help="covey, trl or both")
    p.add_argument("--no-14b", action="store_true", help="leave out the 14B QLoRA cells")
    p.add_argument("--budget-s", type=float, default=420.0, help="stop starting cells after this long")
    p.add_argument("--work", default="", help="folder for the model folders (default: a temporary one)")
    p.add_argument("--out", default="", help="results prefix (default: a temporary folder)")
    args = p.parse_args(argv)
    args.workload = "capacity-smoke" if args.smoke else args.workload
    args.steps = args.steps or WORKLOADS[args.workload]["steps"]
    return args


def last_uses(cells: list[Cell]) -> dict[str, int]:
    """Each size's last cell: its model folder is deleted after it (the disk holds a few sizes, not all)."""
    return {c.size: i for i, c in enumerate(cells)}


def run_cells(children: Children, args, cells: list[Cell], work: Path, jsonl: Path) -> tuple[list[dict], dict]:
    """Every cell in order while the budget lasts, each size's model built before its first cell."""
    records, shapes, last = [], {}, last_uses(cells)
    common = ["--workload", args.workload, *(["--tokenizer", args.tokenizer] if args.tokenizer else [])]
    for i, cell in enumerate(cells):
        folder = work / f"model-{cell.size}"
        if cell.size not in shapes and children.left() > 20:
            shapes[cell.size] = children.run("gpu_capacity", "build", f"build-{cell.size}",
                                             [*common, "--size", cell.size, "--model", str(folder)])
        result = None
        if shapes.get(cell.size):
            limit = CELL_LIMIT_S.get(cell.size, 120)
            result = children.run("gpu_capacity", "cell", cell.name,
                                  [*common, "--trainer", cell.trainer, "--size", cell.size, "--setup", cell.setup,
                                   "--cap-gib", str(cell.cap_gib), "--model", str(folder), "--steps", str(args.steps)],
                                  reserve_s=max(0.0, children.left() - limit))
        record = cell_record(cell, result, children.log_dir / f"{cell.name}.log")
        records.append(record)
        with open(jsonl, "a") as f:
            f.write(json.dumps(record) + "\n")
        children.say(f"{cell.name}: " + (f"peak {record['peak_gib'] or 0:.1f} GiB, {record['step_s']:.2f} s/step"
                                         if record["runs"] else f"no: {record['error']}"))
        if last[cell.size] == i:
            shutil.rmtree(folder, ignore_errors=True)
    return records, {size: shape for size, shape in shapes.items() if shape}


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.role != "drive":
        write_json(args.result, (role_cell if args.role == "cell" else role_build)(args))
        return 0
    cells = plan_cells(trainers=tuple(t for t in args.trainers.split(",") if t), with_14b=not args.no_14b,
                       smoke=args.smoke)
    if args.dry_run:
        for i, cell in enumerate(cells, 1):
            print(f"{i:2d}. {cell.name}: {describe(cell)}" + (f"  [{cell.why}]" if cell.why else ""))
        return 0
    out = Path(args.out) if args.out else Path(os.environ.get("TMPDIR", "/tmp")) / f"capacity-{os.getpid()}" / "cap"
    children = Children(out.parent / (out.name + "-logs"), args.budget_s)
    children.log_dir.mkdir(parents=True, exist_ok=True)
    jsonl = out.with_suffix(".jsonl")
    jsonl.unlink(missing_ok=True)
    work = Path(args.work or tempfile.mkdtemp(prefix="capacity-models-"))
    device = children.run("covey_side", "device", "device", []) or {}
    records, shapes = run_cells(children, args, cells, work, jsonl)
    workload = WORKLOADS[args.workload]
    text = "\n".join([f"device: {device.get('name', 'unknown')}; bf16 matmul peak "
                      f"{device.get('matmul_tflops', 0):.1f} TFLOP/s",
                      "workload: " + json.dumps({k: v for k, v in workload.items() if k != "steps"})
                      + f"; {args.steps} steps, s/step the median of steps 2..{args.steps}",
                      *[f"{size}: {shape['describe']}" for size, shape in shapes.items()], "",
                      table(records), "", *acceptance_lines(records, device, shapes, workload)])
    print(text)
    out.with_suffix(".md").write_text(text + "\n")
    children.say(f"wrote {jsonl}, {out.with_suffix('.md')}")
    return 0 if all(r["runs"] or "does not fit" in r.get("error", "") or "out of memory" in r.get("error", "")
                    for r in records[:len(ACCEPTANCE)]) else 1


if __name__ == "__main__":
    sys.exit(main())
