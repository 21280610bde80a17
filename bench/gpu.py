"""covey vs TRL's GRPOTrainer on one GPU: step time by phase, peak GPU memory, decode step against its
memory-bandwidth floor, update FLOP rate against the GPU's bf16 matmul peak.

    python -m bench.gpu --out LOGS/bench --decode-modes graphs,compile   # a GPU: ~6 min on an H100
    python -m bench.gpu --smoke --out /tmp/bench    # on a CPU: tiny shapes, the whole pipeline, TRL included

The workload (bench/workloads.py, `gpu`): random Qwen2 models of Qwen2.5-0.5B's and -1.5B's dimensions,
saved once in bf16 and loaded by each trainer its own way; covey's arithmetic prompts in SmolLM2's chat
format; 8 prompts x 8 samples; 256 new tokens at fixed length (covey: no end-of-sequence token; TRL:
min_new_tokens = 256); one optimizer step per rollout, micro-batches of 8 (covey's update: what fits
its GPU memory budget, train.gpu_memory_gib, by default the card less 10%; each step's size is in covey's
result); the same deterministic reward function (it varies between samples, so every step updates).

covey runs as `covey train grpo` would on a GPU (its defaults: fp32 weights and AdamW, bf16 autocast,
bf16 sampling copy, rollout.decode=auto = CUDA graphs); TRL 1.16's GRPOTrainer with its default model
load (fp32 weights), bf16 autocast, HF `generate` (no vLLM), and covey's settings mapped by
bench/trl_side.py as in the CPU benchmark (gradient checkpointing off like covey's; --trl-gc: on, TRL's
own default). Every run is a subprocess of its own (its peak GPU memory is its own; this process never
touches the GPU), covey and TRL alternating per model size; medians over steps 2..N. The copy bandwidth
and the matmul peak are measured in the same run. Then, while the budget lasts, `--decode-modes` times
rollout.decode modes on each model's bf16 weights alone. Results: a table on stdout, `<out>.md` and
`<out>.json`; each child's log and result in `<out>-logs/`; the model folders in `--work`.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

from bench.harness import Children
from bench.report import decode_lines, gpu_summary, gpu_table, verdicts
from bench.workloads import SHAPES, WORKLOADS


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--smoke", action="store_true", help="tiny shapes and few tokens: runs on a CPU")
    p.add_argument("--sizes", default="", help="comma-separated from " + ", ".join(SHAPES))
    p.add_argument("--steps", type=int, default=0, help="optimizer steps per run (medians of 2..N)")
    p.add_argument("--runs", default="covey,trl", help="covey, trl or both")
    p.add_argument("--decode-modes", default="", help="rollout.decode modes timed on each model's bf16 weights after "
                                                      "the GRPO runs, while the budget lasts (e.g. graphs,compile)")
    p.add_argument("--covey-keys", default="", help="extra covey key=value settings of the covey runs, "
                                                    "space-separated (e.g. 'algo.micro_batch_size=16')")
    p.add_argument("--covey-variant", default="", help="one more covey run per size with these key=value settings, "
                                                       "reported as covey-variant (e.g. 'algo.micro_batch_size=32')")
    p.add_argument("--profile", action="store_true", help="covey: one more step under torch.profiler, the top "
                                                          "ops in covey-<size>.log")
    p.add_argument("--trl-gc", action="store_true", help="TRL with gradient checkpointing, its own default "
                                                         "(default: covey's setting, off, as the CPU benchmark's trl)")
    p.add_argument("--work", default="", help="folder for the model folders (default: a temporary one)")
    p.add_argument("--tokenizer", default="", help="folder with SmolLM2's tokenizer files (default: covey's model "
                                                   "cache)")
    p.add_argument("--budget-s", type=float, default=440.0, help="stop starting runs after this long")
    p.add_argument("--out", default="", help="results prefix (default: a temporary folder)")
    args = p.parse_args(argv)
    args.workload = "gpu-smoke" if args.smoke else "gpu"
    args.size_list = [s for s in (args.sizes or ("smoke" if args.smoke else "0.5b,1.5b")).split(",") if s]
    args.steps = args.steps or WORKLOADS[args.workload]["steps"]
    return args


def trainer_args(args, name: str) -> list[str]:
    """The flags of one trainer run beyond the workload, model and steps."""
    flags = {"covey": ["--keys", args.covey_keys] if args.covey_keys else [],
             "covey-variant": ["--keys", args.covey_variant], "trl": ["--trl-gc"] if args.trl_gc else []}[name]
    return flags + (["--profile"] if name == "covey" and args.profile else [])


def run_size(children: Children, args, i: int, size: str, work: Path, common: list[str]) -> dict | None:
    """One model size: its folder built, then each trainer run (time kept for the sizes after it)."""
    model_dir = work / f"model-{size}"
    tokenizer = ["--tokenizer", args.tokenizer] if args.tokenizer else []
    shape = children.run("covey_side", "build", f"build-{size}", [*common, *tokenizer, "--size", size, "--model",
                                                                 str(model_dir)])
    if shape is None:
        return None
    children.say(f"{size}: {shape['describe']}")
    runs = [r for r in args.runs.split(",") if r] + (["covey-variant"] if args.covey_variant else [])
    results = {}
    for name in runs:
        later = ((len(args.size_list) - i - 1) * (150 + 45 * bool(args.covey_variant))
                 + (60 if name == "covey" and "trl" in runs else 0))
        side = "trl_side" if name == "trl" else "covey_side"
        results[name] = children.run(side, "gpu", f"{name}-{size}", [*common, "--model", str(model_dir), "--steps",
                                                                     str(args.steps), *trainer_args(args, name)],
                                     reserve_s=later)
        children.failed += results[name] is None or bool(results[name].get("partial"))
    return {"size": size, "shape": shape, "model_dir": str(model_dir), "results": results}


def main(argv=None) -> int:
    args = parse_args(argv)
    out = Path(args.out) if args.out else Path(os.environ.get("TMPDIR", "/tmp")) / f"gpu-bench-{os.getpid()}" / "bench"
    log_dir = out.parent / (out.name + "-logs")
    log_dir.mkdir(parents=True, exist_ok=True)
    children = Children(log_dir, args.budget_s)
    work = Path(args.work or tempfile.mkdtemp(prefix="gpu-bench-models-"))
    common = ["--workload", args.workload]
    device = children.run("covey_side", "device", "device", []) or {}
    if device:
        children.say(f"device: {device['name']}; copy {device['copy_bytes_per_s'] / 1e12:.2f} TB/s (read + written), "
                     f"bf16 matmul peak {device['matmul_tflops']:.1f} TFLOP/s {device['matmul_shape']}")
    workload, rows = WORKLOADS[args.workload], []
    for i, size in enumerate(args.size_list):
        done = run_size(children, args, i, size, work, common)
        if done is not None:
            rows.append({**gpu_summary(size, device, done["shape"], done["results"], workload),
                         "shape": done["shape"], "model_dir": done["model_dir"]})
    for row in rows if args.decode_modes else []:  # after every GRPO run: what the budget has left
        modes = children.run("covey_side", "decode", f"decode-{row['size']}",
                             ["--workload", args.workload, "--model", row["model_dir"], "--decode-modes",
                              args.decode_modes])
        row["decode_modes"] = (modes or {}).get("modes", {})
    text = "\n".join([f"device: {device.get('name', 'unknown')}; copy bandwidth "
                      f"{device.get('copy_bytes_per_s', 0) / 1e12:.2f} TB/s; bf16 matmul peak "
                      f"{device.get('matmul_tflops', 0):.1f} TFLOP/s; medians of steps 2..{args.steps}",
                      "workload: " + json.dumps({k: v for k, v in workload.items() if k != "steps"}),
                      *[f"{r['size']}: {r['shape']['describe']}" for r in rows], "",
                      gpu_table(rows), "", *decode_lines(rows), "", *[line for r in rows for line in verdicts(r)]])
    print(text)
    out.with_suffix(".md").write_text(text + "\n")
    out.with_suffix(".json").write_text(json.dumps({"device": device, "workload": workload, "rows": rows,
                                                    "argv": sys.argv}, indent=1, default=str))
    children.say(f"wrote {out.with_suffix('.md')} and {out.with_suffix('.json')}")
    if children.failed:
        children.say(f"{children.failed} trainer run(s) failed, stopped early or were skipped")
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
