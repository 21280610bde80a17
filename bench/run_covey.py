"""Benchmark child: `covey train grpo` on the workload of bench/common.py.

Phase times are covey's own metrics (time/generate, time/score, time/logprobs,
time/update, time/step); a FLOP counter on the policy's linear layers is read around
each `train_step`. Extra `key=value` overrides (e.g. rollout.engine=hf) follow `--`.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import WORKLOAD, LinearFlops, StepRecord, write_result  # noqa: E402


def overrides(steps: int, threads: int, out_dir: str, extra: list[str]) -> list[str]:
    w = WORKLOAD
    return [f"train.steps={steps}", "train.max_minutes=0", f"rollout.prompts_per_step={w['prompts_per_step']}",
            f"rollout.group_size={w['group_size']}", f"rollout.max_new_tokens={w['max_new_tokens']}",
            f"algo.beta={w['beta']}", f"optim.lr={w['lr']}", f"algo.micro_batch_size={w['micro_batch']}",
            f"rollout.temperature={w['temperature']}", f"task.train_size={w['train_size']}",
            f"train.seed={w['seed']}", f"model.threads={threads}", "task.eval_size=8",
            "rollout.eval_max_new_tokens=8", f"train.output_dir={out_dir}", "train.run_name=bench",
            "train.progress=false", "train.samples_every=0", *extra]


def patch_flop_counter(covey_train) -> None:
    """Attach a LinearFlops to the policy when the run is built; record its count per step."""
    build_run, train_step = covey_train.build_run, covey_train.train_step
    state = {}

    def counted_build_run(*args, **kwargs):
        run = build_run(*args, **kwargs)
        state["counter"] = LinearFlops(run.policy)
        return run

    def counted_train_step(*args, **kwargs):
        state["counter"].take()
        metrics = train_step(*args, **kwargs)
        metrics["bench/train_flops"] = state["counter"].take()
        return metrics

    covey_train.build_run, covey_train.train_step = counted_build_run, counted_train_step


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--result", required=True)
    parser.add_argument("--threads", type=int, default=0)
    parser.add_argument("--name", default="covey")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    from covey.train import loop as covey_train
    from covey.config import load_config
    from covey.runtime.precision import resolve_autocast

    patch_flop_counter(covey_train)
    # The run folder (checkpoints and the saved model, ~2 GB) is only read for its metrics.
    with tempfile.TemporaryDirectory(prefix="bench-covey-") as out_dir:
        cfg = load_config("grpo", overrides(args.steps, args.threads, out_dir, args.overrides))
        covey_train.train(cfg)
        metrics = (Path(out_dir) / "bench" / "metrics.jsonl").read_text().splitlines()
    n_seq = cfg.rollout.prompts_per_step * cfg.rollout.group_size
    rows = [json.loads(line) for line in metrics]
    records = [StepRecord(step=r["step"], seconds=r["time/step"],
                          phases={"generate": r["time/generate"], "score": r["time/score"],
                                  "logprobs": r["time/logprobs"], "update": r["time/update"]},
                          completion_tokens=round(r["response/len_mean"] * n_seq),
                          train_flops=r["bench/train_flops"])
               for r in rows if "time/step" in r and "time/generate" in r]
    precision = "bfloat16 (autocast)" if resolve_autocast(cfg.model.autocast) == "bfloat16" else cfg.model.dtype
    write_result(args.result, args.name, records, {"precision": precision, "overrides": args.overrides})


if __name__ == "__main__":
    main()
