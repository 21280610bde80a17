"""covey vs TRL's GRPOTrainer on the CPU workload (docs/benchmark.md): step time, phases, tokens/s, memory, FLOP rate
against the matmul peak of each precision, measured before and after; each run a child (its peak RSS its own).

    nice -n 10 python -m bench.speed --steps 6 --runs covey,trl,trl-gc --rounds 2 --out runs/speed"""

from __future__ import annotations

import argparse
import os

import torch

from bench.harness import Children, interleaved, machine, matmul_peak, out_prefix, pooled, publish, summarize, table

RUNS = {  # name -> (trainer, covey key=value settings or TRL setup, covey's glibc malloc variables)
    "covey": ("covey", [], True),  # covey's defaults: bf16 sampling and autocast where bf16 is native
    "covey-fp32": ("covey", ["rollout.precision=float32", "model.autocast=none"], True),
    "covey-fp32-train": ("covey", ["model.autocast=none"], True),
    "covey-plain-malloc": ("covey", [], False),
    "covey-mb16": ("covey", ["algo.micro_batch_size=16"], True),
    "covey-mb32": ("covey", ["algo.micro_batch_size=32"], True),
    "trl": ("trl", "mapped", False),  # TRL as it ships: the step's samples in one forward
    "trl-malloc": ("trl", "mapped", True),
    "trl-gc": ("trl", "gc", False),
    "trl-bf16": ("trl", "bf16", False),
}


def cpu_table(rows: list[dict], peak: dict) -> str:
    """A line per run (summarize's rows); ratios against `trl` (TRL as it ships) and TRL's best."""
    trl = [r for r in rows if r["name"].startswith("trl")]
    base = next((r for r in trl if r["name"] == "trl"), trl[0] if trl else None)
    refs = ((base, "step_s"), (min(trl, key=lambda r: r["step_s"], default=None), "step_s"), (base, "peak_rss_mib"),
            (min(trl, key=lambda r: r["peak_rss_mib"], default=None), "peak_rss_mib"))

    def line(r: dict) -> list[str]:
        share = 100 * r["train_gflops"] / peak["bfloat16" if r["precision"].startswith("bfloat16") else "float32"]
        return [r["name"], r["precision"], *(f"{r[k]:.{d}f}" for k, d in (
            ("step_s", 1), ("min_s", 1), ("generate_s", 1), ("score_s", 2), ("logprobs_s", 1), ("update_s", 1))),
            f"{r['tokens_per_s']:.0f}", f"{r['train_gflops']:.0f} ({share:.0f}%)",
            f"{r['peak_rss_mib'] / 1024:.2f}", *(f"{r[k] / ref[k]:.2f}" if ref else "-" for ref, k in refs)]

    return table(["run", "precision", "median s/step", "min s", "generate", "score", "ref logp", "update",
                  "tokens/s", "train GFLOP/s (% of peak)", "peak RSS GiB", "step / trl",
                  "step / fastest TRL", "RSS / trl", "RSS / leanest TRL"], [line(r) for r in rows])


def main(argv: list[str] | None = None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=6, help="optimizer steps per run; step 1 is not timed")
    p.add_argument("--runs", default="covey,trl", help=f"comma-separated, from: {', '.join(RUNS)}")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="torch threads of every run")
    p.add_argument("--rounds", type=int, default=1, help="the runs this many times, interleaved, steps pooled")
    p.add_argument("--smoke", action="store_true", help="the smoke workload: a few tokens, seconds on a tiny model")
    p.add_argument("--model", default="", help="model folder (default: SmolLM2-135M-Instruct)")
    p.add_argument("--out", default="", help="results prefix (default: a temporary folder)")
    args = p.parse_args(argv)
    names = [n for n in args.runs.split(",") if n]
    if set(names) - set(RUNS) or args.steps < 2 or args.rounds < 1:
        p.error(f"unknown runs {sorted(set(names) - set(RUNS))}, --steps < 2 or --rounds < 1")
    out, n_max = out_prefix(args.out, "bench"), 512 if args.smoke else 2048
    torch.set_num_threads(args.threads)

    def peaks() -> dict:  # the matmul peak of each precision, before and after the runs
        return {"float32": matmul_peak(torch.float32, n_max), "bfloat16": matmul_peak(torch.bfloat16, n_max)}

    children, before = Children(out.parent / f"{out.name}-logs"), peaks()

    def run_one(name: str, tag: str) -> dict:
        trainer, setup, malloc = RUNS[name]
        spec = {"workload": "cpu-smoke" if args.smoke else "cpu", "steps": args.steps, "threads": args.threads,
                "model": args.model, "name": name, "flops": True, "keys" if trainer == "covey" else "setup": setup}
        return children.must(trainer, "steps", f"{name}{tag}", spec, malloc=malloc)

    by_name = interleaved(names, args.rounds, run_one)
    after = peaks()
    results = [pooled(rounds) for rounds in by_name.values()]
    rows = [summarize(r) for r in results]
    text = (f"{machine()}\nmatmul peak (n^3 with n <= {n_max}, best of 6, before/after): fp32 "
            f"{before['float32']:.0f}/{after['float32']:.0f}, bf16 {before['bfloat16']:.0f}/{after['bfloat16']:.0f} "
            f"GFLOP/s; threads={args.threads}; medians over steps 2..{args.steps}"
            + (f"; {args.rounds} interleaved rounds pooled" if args.rounds > 1 else "") + "\n\n"
            + cpu_table(rows, {k: max(before[k], after[k]) for k in before}))
    if args.rounds > 1:  # how far the machine drifted between rounds
        text += "\n\nmedian s/step of each round: " + "; ".join(
            f"{n} " + " / ".join(f"{summarize(r)['step_s']:.1f}" for r in rounds) for n, rounds in by_name.items())
    publish(out, text, {"peak_before": before, "peak_after": after, "summary": rows, "runs": results,
                        "rounds": by_name})
    return out.with_suffix(".json")


if __name__ == "__main__":
    main()
