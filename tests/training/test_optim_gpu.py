"""Low-memory optimizers on a CUDA GPU (marked `gpu`: skipped without one; run by scripts/gpu_check.sh):
bitsandbytes' paged 8-bit AdamW, optim.offload (torchao's CPUOffloadOptimizer, stepping on the clipped
gradients), torchao's optimizers on CUDA, each against fp32 AdamW on the tiny model."""

from __future__ import annotations

import importlib.util
import io

import pytest
import torch

from covey.cli.main import main
from covey.config import OptimConfig
from covey.models.tiny import tiny_llama
from covey.runtime.metrics import read_metrics
from covey.training.optim import make_optimizer
from covey.training.plan_setup import OptimizerOptions, optimizer_options
from tests.helpers import tiny_overrides


def optim_options(**keys) -> OptimizerOptions:
    """The plan's optimizer section of optim.* with `keys` (the rest at their defaults)."""
    return optimizer_options(OptimConfig(**keys))


pytestmark = pytest.mark.gpu
needs = {package: pytest.mark.skipif(importlib.util.find_spec(package) is None,
                                     reason=f"{package} is not installed (pip install 'covey[lowmem]')")
         for package in ("torchao", "bitsandbytes")}


def loss_curve(optim: OptimizerOptions, dtype=torch.float32, steps: int = 20, lr: float = 3e-3,
               max_norm: float = 0.0) -> list[float]:
    """The tiny Llama fitting one fixed batch of random tokens on cuda (as tests/training/test_optim.py on the CPU);
    max_norm > 0 clips the gradient as covey's update does before each step."""
    torch.manual_seed(0)
    model = tiny_llama(512).to(device="cuda", dtype=dtype)
    opt = make_optimizer(model.parameters(), lr, optim)
    ids = torch.randint(3, 512, (8, 24), generator=torch.Generator().manual_seed(1)).cuda()
    losses = []
    for _ in range(steps):
        loss = model(ids, labels=ids).loss
        loss.backward()
        if max_norm:
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


@pytest.fixture(scope="module")
def adamw_curve():
    return loss_curve(optim_options())


@pytest.mark.parametrize("optim, dtype, share", [
    pytest.param(optim_options(name="paged_adamw_8bit"), torch.float32, 0.99, marks=needs["bitsandbytes"]),
    pytest.param(optim_options(name="adamw_8bit"), torch.float32, 0.99, marks=needs["torchao"]),
    pytest.param(optim_options(name="adamw_bf16"), torch.bfloat16, 0.99, marks=needs["torchao"]),
    pytest.param(optim_options(name="adamw_8bit", offload=True), torch.float32, 0.99, marks=needs["torchao"]),
], ids=["paged_adamw_8bit", "adamw_8bit", "adamw_bf16", "adamw_8bit-offload"])
def test_low_memory_optimizers_learn_like_fp32_adamw_on_cuda(adamw_curve, optim, dtype, share):
    """The tolerances of the CPU test (tests/training/test_optim.py): at least 99% of fp32 AdamW's loss decrease,
    never more than 1% of it behind at any step (adamw_4bit is left to the CPU test: its compile is the
    longest, and its update the same torchao code)."""
    curve = loss_curve(optim, dtype)
    decrease = adamw_curve[0] - adamw_curve[-1]
    assert decrease > 3.0
    assert curve[0] - curve[-1] >= share * decrease
    if share > 0.9:
        assert max(c - a for c, a in zip(curve, adamw_curve)) < 0.01 * decrease


@needs["torchao"]
def test_offloaded_adamw_steps_on_the_clipped_gradients():
    """optim.offload=true with torch's AdamW (fused, on the CPU) against AdamW on the GPU, the gradient clipped
    to a norm of 0.01 (far below the tiny model's, so every step is clipped): the same curve up to float
    rounding. Without the copy of the clipped gradients the offloaded steps would see the unclipped ones,
    whose Adam steps differ (at step 1 Adam's update is lr * sign(g) either way, so from step 2 on)."""
    on_gpu = loss_curve(optim_options(), max_norm=0.01)
    offloaded = loss_curve(optim_options(offload=True), max_norm=0.01)
    torch.testing.assert_close(offloaded, on_gpu, rtol=1e-4, atol=1e-4)
    assert on_gpu[0] - on_gpu[-1] > 0.5, "the clipped run learns: the test can fail"


@needs["torchao"]
def test_offloaded_state_saves_and_restores_exactly():
    """Two steps, state_dict through torch.save / torch.load (as a checkpoint), two more: the weights of four
    uninterrupted steps, bit for bit."""
    def run(split: bool):
        torch.manual_seed(0)
        model = tiny_llama(512).cuda()
        opt = make_optimizer(model.parameters(), 1e-3, optim_options(name="adamw_8bit", offload=True))
        ids = torch.randint(3, 512, (4, 16), generator=torch.Generator().manual_seed(1)).cuda()
        for i in range(4):
            if split and i == 2:
                buffer = io.BytesIO()
                torch.save(opt.state_dict(), buffer)
                buffer.seek(0)
                opt = make_optimizer(model.parameters(), 1e-3, optim_options(name="adamw_8bit", offload=True))
                opt.load_state_dict(torch.load(buffer, weights_only=False, map_location="cpu"))
            model(ids, labels=ids).loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        return [p.detach().cpu() for p in model.parameters()]

    for a, b in zip(run(False), run(True)):
        assert torch.equal(a, b)


@needs["bitsandbytes"]
def test_paged_adamw_8bit_state_saves_and_restores_exactly():
    def run(split: bool):
        torch.manual_seed(0)
        model = tiny_llama(512).cuda()
        opt = make_optimizer(model.parameters(), 1e-3, optim_options(name="paged_adamw_8bit"))
        ids = torch.randint(3, 512, (4, 16), generator=torch.Generator().manual_seed(1)).cuda()
        for i in range(4):
            if split and i == 2:
                buffer = io.BytesIO()
                torch.save(opt.state_dict(), buffer)
                buffer.seek(0)
                opt = make_optimizer(model.parameters(), 1e-3, optim_options(name="paged_adamw_8bit"))
                opt.load_state_dict(torch.load(buffer, weights_only=False, map_location="cpu"))
            model(ids, labels=ids).loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        return [p.detach().cpu() for p in model.parameters()]

    for a, b in zip(run(False), run(True)):
        assert torch.equal(a, b)


@pytest.mark.parametrize("extra", [
    pytest.param({"optim.name": "adamw_8bit", "optim.offload": "true"}, marks=needs["torchao"]),
    pytest.param({"optim.name": "adamw_bf16", "model.dtype": "bfloat16"}, marks=needs["torchao"]),
    pytest.param({"optim.name": "paged_adamw_8bit"}, marks=needs["bitsandbytes"]),
], ids=["adamw_8bit-offload", "adamw_bf16", "paged_adamw_8bit"])
def test_a_cuda_run_checkpoints_and_resumes(tiny_model_dir, tmp_path, extra):
    """covey train on cuda, 2 steps then resumed to 3: the checkpoint restores the optimizer (offloaded, the
    bf16 weights' torchao AdamW, bitsandbytes' paged state) and the run goes on."""
    base = {"train.device": "cuda", "optim.lr": 1e-3, "reward.functions": "tests.helpers:varied_reward", **extra}
    assert main(["train", *tiny_overrides(tiny_model_dir, tmp_path, **{**base, "train.steps": 2})]) == 0
    assert main(["train", *tiny_overrides(tiny_model_dir, tmp_path, **{**base, "train.steps": 3,
                                                                        "train.resume": "auto"})]) == 0
    assert [r["step"] for r in read_metrics(tmp_path / "t")][-2:] == [3, 3]
