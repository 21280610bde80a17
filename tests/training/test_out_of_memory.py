"""A pass that runs out of memory is redone at half the micro-batch: the step's metrics and the
trained weights equal those of a run that started at the smaller size, and the size is kept,
logged and checkpointed, for PPO (policy and critic) and for iterative DPO. The out-of-memory
error is injected for micro-batches above 2 rows."""

import json

import torch
from safetensors.torch import load_file

from covey import train
from covey.config import load_config
from covey.passes import logprobs
from covey.rollout.fast import FastEngine
from covey.training import dpo, update
from tests.helpers import tiny_overrides

ROWS_THAT_FIT = 2


def failing_above(limit, real):
    def wrapped(model, part, *args, **kwargs):
        if len(part) > limit:
            raise torch.OutOfMemoryError(f"CUDA out of memory (injected: {len(part)} rows)")
        return real(model, part, *args, **kwargs)
    return wrapped


def run_preset(preset, tiny_model_dir, out_dir, micro_batch_size):
    cfg = load_config(preset, tiny_overrides(tiny_model_dir, out_dir, **{
        "model.autocast": "none", "rollout.precision": "float32", "optim.lr": 1e-3, "train.save_every": 1,
        "reward.functions": "tests.helpers:varied_reward", "algo.micro_batch_size": micro_batch_size}))
    result = train(cfg)
    rows = [json.loads(line) for line in (result.run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [row for row in rows if "reward/mean" in row]
    weights = load_file(str(next((result.final_model).glob("*.safetensors"))))
    return steps, weights, result


def comparable(row):
    # sampler/*: the sampler's own log-probs, whose last bits depend on how many rows a call decodes
    return {k: v for k, v in row.items() if not k.startswith(("time/", "memory/", "throughput/", "sampler/"))}


def test_halving_gives_the_run_that_started_small(tiny_model_dir, tmp_path, monkeypatch):
    small_steps, small_weights, _ = run_preset("ppo", tiny_model_dir, tmp_path / "small", ROWS_THAT_FIT)
    with monkeypatch.context() as patch:
        for module in (logprobs, update):
            patch.setattr(module, "policy_logprobs", failing_above(ROWS_THAT_FIT, module.policy_logprobs))
            patch.setattr(module, "critic_values", failing_above(ROWS_THAT_FIT, module.critic_values))
        steps, weights, result = run_preset("ppo", tiny_model_dir, tmp_path / "halved", 4 * ROWS_THAT_FIT)
    assert [comparable(row) for row in steps] == [comparable(row) for row in small_steps]
    assert weights.keys() == small_weights.keys()
    assert all(torch.equal(weights[k], small_weights[k]) for k in weights)
    # 8 -> 4 -> 2 in each phase, on the first step only; the sizes are logged and checkpointed
    assert [row["memory/oom_retries"] for row in steps] == [4, 4]
    assert steps[-1]["memory/micro_batch/update"] == steps[-1]["memory/micro_batch/logprobs"] == ROWS_THAT_FIT
    state = torch.load(result.run_dir / "checkpoints" / "step-000002" / "trainer_state.pt", weights_only=False)
    assert state["extra"]["micro_batches"] == {"sizes": {"generate": 2, "logprobs": 2, "update": 2},
                                               "oom_retries": 4}


def test_dpo_halving_gives_the_run_that_started_small(tiny_model_dir, tmp_path, monkeypatch):
    small_steps, small_weights, _ = run_preset("dpo_iterative", tiny_model_dir, tmp_path / "small", ROWS_THAT_FIT)
    with monkeypatch.context() as patch:
        for module in (logprobs, dpo):  # the reference's pass, and the policy's in the DPO steps
            patch.setattr(module, "policy_logprobs", failing_above(ROWS_THAT_FIT, module.policy_logprobs))
        steps, weights, result = run_preset("dpo_iterative", tiny_model_dir, tmp_path / "halved", 4 * ROWS_THAT_FIT)
    assert all(row["dpo/pairs"] >= 1 for row in steps)  # there was an update to redo
    assert [comparable(row) for row in steps] == [comparable(row) for row in small_steps]
    assert all(torch.equal(weights[k], small_weights[k]) for k in small_weights)
    # the reference pass 8 -> 4 -> 2 rows; a DPO micro-batch 8 -> 4 -> 2 rows (4 -> 2 -> 1 pairs);
    # on the first step only, kept for the run and checkpointed
    assert [row["memory/oom_retries"] for row in steps] == [4, 4]
    assert steps[-1]["memory/micro_batch/update"] == steps[-1]["memory/micro_batch/logprobs"] == ROWS_THAT_FIT
    state = torch.load(result.run_dir / "checkpoints" / "step-000002" / "trainer_state.pt", weights_only=False)
    assert state["extra"]["micro_batches"]["sizes"] == {"generate": 2, "logprobs": 2, "update": 2}


def test_a_row_that_does_not_fit_ends_the_run_with_one_line(tiny_model_dir, tmp_path, monkeypatch, capsys):
    from covey.cli.main import main
    monkeypatch.setattr(update, "policy_logprobs", failing_above(0, update.policy_logprobs))
    code = main(["train", "grpo", *tiny_overrides(tiny_model_dir, tmp_path, **{"algo.micro_batch_size": 2})])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    assert err[-1].startswith("covey train: error: out of memory in the update phase with one sequence per "
                              "micro-batch (sizes now: generate 2, logprobs 2, update 1;")
    assert "covey: out of memory in the update phase at micro-batch 2: redone at 1" in err


def test_sampling_in_fewer_prompts_per_call_gives_the_same_samples_with_per_prompt_seeds(
        tiny_model_dir, tmp_path, monkeypatch):
    """rollout.seeding=per_prompt: each group has its own seed, so generating one prompt per call
    after an out-of-memory gives the very samples of one call for all."""
    def run(out_dir):
        cfg = load_config("grpo", tiny_overrides(tiny_model_dir, out_dir, **{
            "rollout.seeding": "per_prompt", "model.autocast": "none", "rollout.precision": "float32",
            "reward.functions": "tests.helpers:varied_reward"}))
        result = train(cfg)
        rows = [json.loads(line) for line in (result.run_dir / "metrics.jsonl").read_text().splitlines()]
        return [row for row in rows if "reward/mean" in row]

    whole = run(tmp_path / "whole")
    real = FastEngine.generate

    def one_prompt_at_a_time(self, prompts, group_size, *args, **kwargs):
        if len(prompts) > 1 and group_size > 1:  # the training samples (held-out evaluation is greedy, G = 1)
            raise torch.OutOfMemoryError("CUDA out of memory (injected)")
        return real(self, prompts, group_size, *args, **kwargs)

    monkeypatch.setattr(FastEngine, "generate", one_prompt_at_a_time)
    split = run(tmp_path / "split")
    assert [comparable(row) for row in split] == [comparable(row) for row in whole]
    assert split[-1]["memory/micro_batch/generate"] == 1 and split[-1]["memory/oom_retries"] == 1
