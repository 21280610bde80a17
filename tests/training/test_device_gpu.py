"""covey on a CUDA GPU (marked `gpu`: skipped without one; run by scripts/gpu_check.sh).

End to end through the CLI on the tiny model: GRPO and PPO steps on cuda with per-phase GPU memory
in the metrics, a checkpoint moving GPU -> CPU and CPU -> GPU, LoRA, gradient checkpointing, a
reward model trained and scored on the GPU; one optimizer step's loss and gradients on CPU and
GPU (fp32 on both) within float tolerance; a real CUDA out-of-memory halved away.
"""

import json
from pathlib import Path

import pytest
import torch

from covey.cli.main import main
from covey.config import load_config
from covey.models.load import load_policy
from covey.rm.data import PreferencePair, save_rm_data
from covey.runtime.memory import MicroBatchSizes, OutOfMemoryAtOneRow, halving_on_oom
from covey.training.global_batch import global_normalizer
from covey.training.plan import make_plan
from covey.training.update import MetricAverager, policy_gradient
from tests.helpers import grouped_rollout, tiny_overrides

pytestmark = pytest.mark.gpu

VARIED = {"reward.functions": "tests.helpers:varied_reward", "optim.lr": 1e-3}


def run_cli(*args) -> int:
    return main(["train", *args])


def step_rows(run_dir: Path) -> list[dict]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [row for row in rows if "reward/mean" in row]


@pytest.mark.parametrize("preset", ["grpo", "ppo"])
def test_two_steps_on_cuda_through_the_cli(preset, tiny_model_dir, tmp_path, capsys):
    assert run_cli(preset, *tiny_overrides(tiny_model_dir, tmp_path, **VARIED, **{"train.device": "cuda"})) == 0
    assert "covey: device cuda:0 (" in capsys.readouterr().out
    rows = step_rows(tmp_path / "t")
    assert [row["step"] for row in rows] == [1, 2]
    for row in rows:
        assert all(row[f"memory/gpu_peak_mb/{phase}"] > 0 for phase in ("generate", "logprobs", "update"))
        assert torch.isfinite(torch.tensor(row["optim/grad_norm"])) and row["optim/grad_norm"] > 0
    assert (tmp_path / "t" / "final" / "config.json").is_file()


def test_the_update_micro_batch_grows_into_the_memory_budget(tiny_model_dir, tmp_path):
    """The tiny model needs a few kB a position, so the budget (train.gpu_memory_gib=0: the card less 10%) holds
    all 2 x 4 sequences of a step in one micro-batch, whatever algo.micro_batch_size says (that the micro-batch
    leaves the gradient as it is, tests/algos/test_aggregation.py and tests/passes/test_prompt_cache.py check on
    the CPU). The budgets on emulated 24 and 48 GiB cards: tests/training/test_memory_budget_gpu.py."""
    keys = {**VARIED, "train.device": "cuda", "algo.micro_batch_size": 2}
    assert run_cli("grpo", *tiny_overrides(tiny_model_dir, tmp_path, **keys)) == 0
    assert [row["memory/micro_batch/update"] for row in step_rows(tmp_path / "t")] == [8, 8]


@pytest.mark.parametrize("first,then", [("cuda", "cpu"), ("cpu", "cuda")])
def test_a_checkpoint_resumes_on_the_other_device(first, then, tiny_model_dir, tmp_path):
    keys = {**VARIED, "train.save_every": 1, "model.autocast": "none", "rollout.precision": "float32"}
    assert run_cli("ppo", *tiny_overrides(tiny_model_dir, tmp_path, **keys, **{"train.device": first})) == 0
    assert run_cli("ppo", *tiny_overrides(tiny_model_dir, tmp_path, **keys, **{
        "train.device": then, "train.steps": 3, "train.resume": "auto"})) == 0
    assert [row["step"] for row in step_rows(tmp_path / "t")] == [1, 2, 3]


def test_the_same_loss_and_gradients_on_cpu_and_gpu(tiny_model_dir):
    """One optimizer step's summed micro-batch gradient, fp32 on both devices (no autocast)."""
    cfg = load_config(None, ["model.autocast=none", "algo.micro_batch_size=2"])
    opts = make_plan(cfg).update
    grads, losses = [], []
    for device in ("cpu", "cuda"):
        model, tok = load_policy(tiny_model_dir, device=device)
        rollout = grouped_rollout(tok)
        rollout.old_logp = torch.zeros(rollout.response_ids.shape)
        rollout.advantages = torch.randn(rollout.response_ids.shape, generator=torch.Generator().manual_seed(3))
        norm = global_normalizer("token_mean", rollout.response_mask, rollout.response_ids.shape[1])
        finite, loss = policy_gradient(model, rollout, torch.arange(len(rollout)), norm, opts, 0.0, MetricAverager())
        assert finite
        losses.append(loss)
        grads.append(torch.cat([p.grad.flatten().cpu() for p in model.parameters() if p.grad is not None]))
    assert losses[1] == pytest.approx(losses[0], rel=1e-4)
    torch.testing.assert_close(grads[1], grads[0], rtol=1e-3, atol=1e-5)


def test_lora_and_gradient_checkpointing_on_cuda(tiny_model_dir, tmp_path):
    extra = {**VARIED, "train.device": "cuda", "model.lora_rank": 4, "model.gradient_checkpointing": "true"}
    assert run_cli("grpo", *tiny_overrides(tiny_model_dir, tmp_path, **extra)) == 0
    assert (tmp_path / "t" / "final" / "adapter_config.json").is_file()
    assert all(row["optim/grad_norm"] > 0 for row in step_rows(tmp_path / "t"))


def test_a_reward_model_trains_and_scores_on_cuda(tiny_model_dir, tmp_path, capsys):
    rm_dir, pairs = tmp_path / "rm", tmp_path / "pairs.jsonl"
    save_rm_data(pairs, [PreferencePair(f"What is {a} * 3?", f"The answer is {3 * a}.", f"I think ?? {a}")
                         for a in range(10, 30)])
    assert main(["train-rm", f"rm.base_model={tiny_model_dir}", f"rm.data={pairs}", f"rm.output={rm_dir}",
                 "rm.train_epochs=1", "train.device=cuda"]) == 0
    assert "held-out examples, on cuda" in capsys.readouterr().out
    assert run_cli("grpo", *tiny_overrides(tiny_model_dir, tmp_path / "policy", **{
        "train.device": "cuda", "reward.model_path": str(rm_dir), "reward.correctness": 0.0})) == 0
    rows = step_rows(tmp_path / "policy" / "t")
    assert rows and all(row["reward/mean"] == pytest.approx(row["reward/rm"]) for row in rows)  # the RM alone


def test_a_real_cuda_out_of_memory_is_halved_away_and_a_row_that_never_fits_ends_in_one_line():
    """Attempts that allocate `size` blocks of a third of the free memory: 8 and 4 fail for real, 2 fits."""
    free, _ = torch.cuda.mem_get_info()
    block = free // 3
    sizes = MicroBatchSizes(8)

    def attempt(size):
        rows = torch.empty(size * block, dtype=torch.uint8, device="cuda")
        return size, rows.numel()

    assert halving_on_oom("update", sizes, attempt, "cuda")[0] == 2 and sizes.oom_retries == 2
    torch.cuda.empty_cache()
    with pytest.raises(OutOfMemoryAtOneRow, match="out of memory in the logprobs phase with one sequence"):
        halving_on_oom("logprobs", MicroBatchSizes(2), lambda size: torch.empty(2 * free, dtype=torch.uint8,
                                                                                 device="cuda"), "cuda")


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="torchrun with nccl needs two GPUs")
def test_torchrun_with_nccl_on_two_gpus(tiny_model_dir, tmp_path):
    import subprocess
    import sys
    torchrun = str(Path(sys.executable).with_name("torchrun"))
    done = subprocess.run([torchrun, "--standalone", "--nproc_per_node", "2", "-m", "covey.cli", "train", "grpo",
                           *tiny_overrides(tiny_model_dir, tmp_path, **VARIED, **{"train.device": "cuda"})],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    assert [row["step"] for row in step_rows(tmp_path / "t")] == [1, 2]
