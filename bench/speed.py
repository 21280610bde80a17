"""covey vs TRL's GRPOTrainer on the CPU workload, in one run: step time, phases, tokens/s, memory, FLOP rate.

    nice -n 10 python -m bench.speed --steps 6 --runs covey,trl,trl-gc
    python -m bench.speed --smoke --runs covey      # the tiny model, seconds: the pipeline only

TRL comes from the `bench` extra (pip install -e '.[bench]'). Every run is a child process (its peak RSS is
its own), one after the other, on the same model, prompts, G, lengths, beta, lr and precision
(bench/workloads.py, `cpu`). The machine's matmul peak is measured before and after, for fp32 and bf16; the
training phase's FLOP rate is reported against the peak of its precision. Results: a table on stdout, and
JSON + Markdown at --out.
"""

from __future__ import annotations

import argparse
import os

from bench.harness import Children, interleaved, machine, out_prefix, peaks, pooled, publish, summarize
from bench.report import cpu_table

RUNS = {  # name -> (trainer, its setup or covey key=value settings, glibc malloc reuse as `covey` sets it)
    "covey": ("covey", [], True),  # covey's defaults: fast engine, fp32 weights, bf16 sampling and autocast
                                   # where bf16 is native
    "covey-fp32": ("covey", ["rollout.precision=float32", "model.autocast=none"], True),  # fp32 throughout
    "covey-fp32-train": ("covey", ["model.autocast=none"], True),  # fp32 passes, bf16 sampling where native
    "covey-plain-malloc": ("covey", [], False),  # without covey/runtime/cpu.py's malloc variables
    "covey-mb16": ("covey", ["algo.micro_batch_size=16"], True),  # fewer, larger passes:
    "covey-mb32": ("covey", ["algo.micro_batch_size=32"], True),  # speed against memory
    "trl": ("trl", "mapped", False),  # TRL as it ships: the step's samples in one forward
    "trl-malloc": ("trl", "mapped", True),  # TRL given covey's malloc variables too
    "trl-gc": ("trl", "gc", False),  # with gradient checkpointing
    "trl-bf16": ("trl", "bf16", False),  # with bf16 autocast
}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=6, help="optimizer steps per run; step 1 is not timed")
    p.add_argument("--runs", default="covey,trl", help=f"comma-separated, from: {', '.join(RUNS)}")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="torch threads of every run")
    p.add_argument("--out", default="", help="results prefix (default: a temporary folder)")
    p.add_argument("--rounds", type=int, default=1, help="run the list this many times, interleaved (covey, trl, "
                   "covey, trl, ...), and pool each run's timed steps: a machine whose speed drifts slows every "
                   "run alike")
    p.add_argument("--smoke", action="store_true", help="the tiny model and workload (seconds)")
    p.add_argument("--model", default="", help="model folder (default: SmolLM2-135M-Instruct; --smoke: the tiny "
                                               "model, built in the output folder)")
    args = p.parse_args(argv)
    names = [n.strip() for n in args.runs.split(",") if n.strip()]
    if set(names) - set(RUNS) or args.steps < 2 or args.rounds < 1:
        p.error(f"unknown runs {sorted(set(names) - set(RUNS))}, --steps < 2 or --rounds < 1")
    return args, names


def run_one(children: Children, args, model: str, name: str, tag: str) -> dict:
    trainer, setup, malloc = RUNS[name]
    flags = ["--steps", str(args.steps), "--threads", str(args.threads), "--workload",
             "cpu-smoke" if args.smoke else "cpu", "--name", name, "--flops", *(["--model", model] if model else [])]
    flags += setup if trainer == "covey" else ["--setup", setup]
    return children.must(f"{trainer}_side", "steps", f"{name}{tag}", flags, malloc=malloc)


def main(argv: list[str] | None = None):
    """Runs the benchmark; returns the path of the JSON results."""
    args, names = parse_args(argv)
    out = out_prefix(args.out, "bench")
    model = args.model
    if args.smoke and not model:
        from covey.models.tiny import build_tiny_model
        model = str(build_tiny_model(out.parent / "tiny-model"))
    n_max = 512 if args.smoke else 2048
    before = peaks(args.threads, n_max)
    children = Children(out.parent / f"{out.name}-logs")
    by_name = interleaved(names, args.rounds, lambda name, tag: run_one(children, args, model, name, tag))
    after = peaks(args.threads, n_max)
    results = [pooled(rounds) for rounds in by_name.values()]
    rows = [summarize(r) for r in results]
    text = (f"{machine()}\nmatmul peak (n^3 with n <= {n_max}, best of 6, before/after): fp32 "
            f"{before['float32']:.0f}/{after['float32']:.0f}, bf16 {before['bfloat16']:.0f}/{after['bfloat16']:.0f} "
            f"GFLOP/s; threads={args.threads}; medians over steps 2..{args.steps}"
            + (f"; {args.rounds} interleaved rounds pooled" if args.rounds > 1 else "") + "\n\n"
            + cpu_table(rows, {k: max(before[k], after[k]) for k in before}))
    if args.rounds > 1:  # how far the machine drifted between rounds
        text += "\n\nmedian s/step of each round: " + "; ".join(
            f"{name} " + " / ".join(f"{summarize(r)['step_s']:.1f}" for r in rounds) for name, rounds in by_name.items())
    publish(out, text, {"peak_before": before, "peak_after": after, "summary": rows, "runs": results,
                        "rounds": by_name})
    return out.with_suffix(".json")


if __name__ == "__main__":
    main()
