"""covey vs TRL's GRPOTrainer on the CPU workload, in one run: step time, phases, tokens/s, memory, FLOP rate.

    nice -n 10 python -m bench.speed --steps 6 --runs covey,trl,trl-gc
    python -m bench.speed --smoke --runs covey      # the tiny model, seconds: the pipeline only

Installs nothing: TRL comes from the `bench` extra (pip install -e '.[bench]'). Every run is a
subprocess of its own (so its peak RSS is its own), one after the other, on the same model, prompts
distribution, G, lengths, beta, lr and precision (bench/workloads.py). The machine's matmul peak is
measured in the same run, before and after, for fp32 and bf16; the training phase's FLOP rate is
reported against the peak of its precision. Results: a table on stdout, and JSON + Markdown next to --out.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

from bench.harness import Children, interleaved, machine, peaks, pooled, round_medians, summarize
from bench.report import cpu_table

RUNS = {  # name -> (side, its flags, covey key=value overrides, glibc malloc reuse as `covey` sets it)
    "covey": ("covey", [], [], True),                       # covey's defaults: fast engine, fp32 weights,
                                                            # bf16 sampling and autocast where bf16 is native
    "covey-fp32": ("covey", [], ["rollout.precision=float32", "model.autocast=none"], True),  # all fp32
    "covey-fp32-train": ("covey", [], ["model.autocast=none"], True),  # fp32 passes, bf16 sampling if native
    "covey-plain-malloc": ("covey", [], [], False),          # without covey/runtime/cpu.py's malloc variables
    "covey-hf": ("covey", [], ["rollout.engine=hf"], True),  # HF generate instead of the fast engine
    "covey-bf16": ("covey", [], ["model.autocast=bfloat16"], True),
    "covey-mb16": ("covey", [], ["algo.micro_batch_size=16"], True),  # fewer, larger passes:
    "covey-mb32": ("covey", [], ["algo.micro_batch_size=32"], True),  # speed against memory
    "trl": ("trl", [], [], False),                          # TRL as it ships: the step's 32 samples per forward
    "trl-malloc": ("trl", [], [], True),                    # TRL given covey's malloc variables too
    "trl-mb8": ("trl", ["--micro-batch", "8"], [], False),   # covey's micro-batch (less memory)
    "trl-gc": ("trl", ["--gradient-checkpointing"], [], False),
    "trl-bf16": ("trl", ["--bf16"], [], False),
}


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=6, help="optimizer steps per run; step 1 is not timed")
    parser.add_argument("--runs", default="covey,trl", help=f"comma-separated, from: {', '.join(RUNS)}")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="torch threads of every run")
    parser.add_argument("--out", default="", help="results prefix (default: a temporary folder)")
    parser.add_argument("--rounds", type=int, default=1,
                        help="run the list this many times, interleaved (covey, trl, covey, trl, ...), and pool "
                             "each run's timed steps: a machine whose speed drifts then slows every run alike")
    parser.add_argument("--smoke", action="store_true", help="the tiny model and workload (seconds)")
    parser.add_argument("--model", default="", help="model folder (default: SmolLM2-135M-Instruct; --smoke: the "
                                                    "tiny model, built in the output folder)")
    args = parser.parse_args(argv)
    args.names = [n.strip() for n in args.runs.split(",") if n.strip()]
    unknown = [n for n in args.names if n not in RUNS]
    if unknown or args.steps < 2 or args.rounds < 1:
        parser.error(f"unknown runs {unknown}, --steps < 2 or --rounds < 1")
    return args


def run_one(children: Children, args, name: str, tag: str) -> dict:
    side, flags, overrides, malloc = RUNS[name]
    common = ["--steps", str(args.steps), "--threads", str(args.threads), "--workload",
              "cpu-smoke" if args.smoke else "cpu", *(["--model", args.model] if args.model else [])]
    extra = ["--name", name, *overrides] if side == "covey" else flags
    return {**children.must(f"{side}_side", "speed", f"{name}{tag}", [*common, *extra], malloc=malloc), "name": name}


def main(argv: list[str] | None = None) -> Path:
    """Runs the benchmark; returns the path of the JSON results."""
    args = parse_args(argv)
    out = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="bench-")) / "bench"
    log_dir = out.parent / (out.name + "-logs")
    log_dir.mkdir(parents=True, exist_ok=True)
    if args.smoke and not args.model:
        from covey.models.tiny import build_tiny_model
        args.model = str(build_tiny_model(out.parent / "tiny-model"))
    n_max = 512 if args.smoke else 2048
    before = peaks(args.threads, n_max)
    children = Children(log_dir)
    by_name = interleaved(args.names, args.rounds, lambda name, tag: run_one(children, args, name, tag))
    after = peaks(args.threads, n_max)
    peak = {k: max(before[k], after[k]) for k in before}
    results = [pooled(rounds) for rounds in by_name.values()]
    rows = [summarize(r) for r in results]
    pooling = f"; {args.rounds} interleaved rounds pooled" if args.rounds > 1 else ""
    text = (f"{machine()}\nmatmul peak (n^3 with n <= {n_max}, best of 6, before/after): fp32 "
            f"{before['float32']:.0f}/{after['float32']:.0f}, bf16 {before['bfloat16']:.0f}/{after['bfloat16']:.0f} "
            f"GFLOP/s; threads={args.threads}; medians over steps 2..{args.steps}{pooling}\n\n" + cpu_table(rows, peak))
    if args.rounds > 1:
        text += "\n\n" + round_medians(by_name)
    print(text)
    out.with_suffix(".md").write_text(text + "\n")
    out.with_suffix(".json").write_text(json.dumps({"peak_before": before, "peak_after": after, "summary": rows,
                                                    "runs": results, "rounds": by_name, "argv": sys.argv}, indent=1))
    print(f"bench: wrote {out.with_suffix('.md')} and {out.with_suffix('.json')}")
    return out.with_suffix(".json")


if __name__ == "__main__":
    main()
