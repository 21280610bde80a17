"""Benchmark child: TRL's GRPOTrainer on the workload of bench/common.py, timed per phase.

Same model folder, same task (covey's arithmetic problems as chat prompts), same reward
function, and the settings of covey's config for this workload mapped by bench/trl_map.py
(G, lengths, beta, lr (constant), temperature, loss aggregation, clipping). `--micro-batch 32` is TRL's
setting as it ships (one forward/backward over the 32 samples); `--micro-batch 8` uses
gradient_accumulation_steps=4 like covey's micro-batches. Either way one rollout of 32
samples makes one optimizer step, so TRL skips its old-log-prob pass exactly like covey.
Phases are timed by wrapping TRL's own methods; `update` is the rest of the step.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from collections import defaultdict
from contextlib import contextmanager
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import WORKLOAD, LinearFlops, StepRecord, write_result  # noqa: E402
from run_covey import overrides  # noqa: E402
from trl_map import trl_dataset, trl_grpo_kwargs  # noqa: E402


def workload_config(steps: int, threads: int):
    """covey's config of the workload (what run_covey.py trains), the source of TRL's settings."""
    from covey.config import load_config
    return load_config("grpo", overrides(steps, threads, tempfile.gettempdir(), []))


def make_trainer_class():
    from trl import GRPOTrainer

    class TimedGRPOTrainer(GRPOTrainer):
        """GRPOTrainer whose generation, scoring and no-grad log-prob passes add to `self.phase_times`."""

        phase_times: dict = defaultdict(float)
        completion_tokens: int = 0

        @contextmanager
        def _timed(self, phase: str):
            t0 = time.perf_counter()
            yield
            self.phase_times[phase] += time.perf_counter() - t0

        def _generate(self, prompts):
            with self._timed("generate"):
                out = super()._generate(prompts)
            self.completion_tokens += sum(len(ids) for ids in out[1])
            return out

        def _calculate_rewards(self, *args, **kwargs):
            with self._timed("score"):
                return super()._calculate_rewards(*args, **kwargs)

        def _get_per_token_logps_and_entropies(self, *args, **kwargs):
            if torch.is_grad_enabled():  # the training forward: part of `update`
                return super()._get_per_token_logps_and_entropies(*args, **kwargs)
            with self._timed("logprobs"):
                return super()._get_per_token_logps_and_entropies(*args, **kwargs)

    return TimedGRPOTrainer


def step_recorder(trainer_box: dict, records: list, flops: dict):
    from transformers import TrainerCallback

    class StepTimer(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            trainer = trainer_box["trainer"]
            trainer.phase_times.clear()
            trainer.completion_tokens = 0
            flops["counter"].take()
            self.t0 = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            seconds = time.perf_counter() - self.t0
            trainer = trainer_box["trainer"]
            phases = dict(trainer.phase_times)
            phases["update"] = seconds - sum(phases.values())
            records.append(StepRecord(step=state.global_step, seconds=seconds, phases=phases,
                                      completion_tokens=trainer.completion_tokens,
                                      train_flops=flops["counter"].take()))
            print(f"trl step {state.global_step}: {seconds:.1f}s {phases}", flush=True)

    return StepTimer()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--result", required=True)
    parser.add_argument("--threads", type=int, default=0)
    parser.add_argument("--gradient-checkpointing", action="store_true")
    parser.add_argument("--bf16", action="store_true")
    parser.add_argument("--micro-batch", type=int, default=32, help="per_device_train_batch_size")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    from trl import GRPOConfig

    from covey.models.default import prepare_default_model
    from covey.rewards.rules import correctness_reward
    from covey.tasks.data import load_task_data
    cfg = workload_config(args.steps, args.threads)
    settings = {**trl_grpo_kwargs(cfg, micro_batch=args.micro_batch, autocast_bf16=args.bf16),
                "gradient_checkpointing": args.gradient_checkpointing}
    config = GRPOConfig(
        output_dir=tempfile.mkdtemp(prefix="bench-trl-"), max_steps=args.steps, use_cpu=True, **settings,
        logging_steps=1, report_to="none", save_strategy="no", disable_tqdm=True, dataloader_num_workers=0)
    records, flops, box = [], {}, {}
    train = load_task_data(cfg.task, WORKLOAD["seed"]).train
    trainer = make_trainer_class()(model=str(prepare_default_model()), reward_funcs=correctness_reward,
                                   args=config, train_dataset=trl_dataset(train, cfg.task.system_prompt),
                                   callbacks=[step_recorder(box, records, flops)])
    box["trainer"] = trainer
    flops["counter"] = LinearFlops(trainer.model)
    trainer.train()
    precision = "bfloat16 (autocast)" if args.bf16 else "float32"
    write_result(args.result, "trl", records, {"precision": precision, "micro_batch": args.micro_batch,
                                                "gradient_checkpointing": args.gradient_checkpointing})
    shutil.rmtree(config.output_dir, ignore_errors=True)  # save_strategy=no: an empty folder per run


if __name__ == "__main__":
    main()
