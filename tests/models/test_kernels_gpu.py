"""Fused kernels and QLoRA on a CUDA GPU (marked `gpu`: skipped without one; run by scripts/gpu_capacity.sh).

Liger's kernels with the fused head keep the tiny model's greedy tokens (fp32) and its log-probs under
bf16 autocast within bf16 rounding of the unfused model's; a GRPO run with model.fused_kernels=on; a 4-bit
(NF4) LoRA run; the 4-bit model's log-probs close to the bf16 model's.
"""

import copy
import json

import pytest
import torch

from covey.cli.main import main
from covey.models.kernels import apply_liger_kernels, use_fused_head
from covey.models.load import load_policy
from covey.passes.logprobs import batched_logprobs
from tests.helpers import grouped_rollout, tiny_overrides

pytestmark = pytest.mark.gpu

VARIED = {"reward.functions": "tests.helpers:varied_reward", "optim.lr": 1e-3, "train.device": "cuda"}


def steps_of(run_dir) -> list[dict]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [row for row in rows if "reward/mean" in row]


def test_liger_kernels_keep_greedy_tokens_and_log_probs(tiny_model_dir):
    pytest.importorskip("liger_kernel")
    plain, tokenizer = load_policy(tiny_model_dir, device="cuda")
    fused = copy.deepcopy(plain)
    apply_liger_kernels(fused)
    use_fused_head(fused)
    prompts = tokenizer(["What is 12 * 7?", "What is 3 + 45?"], return_tensors="pt", padding=True).to("cuda")
    with torch.no_grad():
        tokens = [m.eval().generate(**prompts, max_new_tokens=12, do_sample=False) for m in (plain, fused)]
    assert torch.equal(tokens[0], tokens[1])
    part = grouped_rollout(tokenizer)
    want = batched_logprobs(plain, part, 1.0, 4, precision="bfloat16")
    got = batched_logprobs(fused, part, 1.0, 4, precision="bfloat16")
    torch.testing.assert_close(got, want, atol=3e-2, rtol=1e-2)  # bf16: ~3 significant digits of ~6.2


def test_a_grpo_run_with_fused_kernels(tiny_model_dir, tmp_path, capsys):
    pytest.importorskip("liger_kernel")
    assert main(["train", "grpo", *tiny_overrides(tiny_model_dir, tmp_path, **VARIED,
                                                  **{"model.fused_kernels": "on"})]) == 0
    assert "covey: fused kernels on (model.fused_kernels=on)" in capsys.readouterr().out
    assert all(torch.isfinite(torch.tensor(r["optim/grad_norm"])) for r in steps_of(tmp_path / "t"))


def test_a_4bit_lora_step(tiny_model_dir, tmp_path, capsys):
    pytest.importorskip("bitsandbytes")
    keys = {**VARIED, "model.load_in_4bit": "true", "model.lora_rank": 8, "model.lora_alpha": 16}
    assert main(["train", "grpo", *tiny_overrides(tiny_model_dir, tmp_path, **keys)]) == 0
    assert "model weights 4-bit NF4 (QLoRA)" in capsys.readouterr().out
    rows = steps_of(tmp_path / "t")
    assert [r["step"] for r in rows] == [1, 2]
    assert all(r["optim/grad_norm"] > 0 and torch.isfinite(torch.tensor(r["optim/grad_norm"])) for r in rows)
    assert (tmp_path / "t" / "final" / "adapter_config.json").is_file()


def test_4bit_log_probs_are_close_to_the_bf16_models(tiny_model_dir):
    pytest.importorskip("bitsandbytes")
    bf16, tokenizer = load_policy(tiny_model_dir, dtype=torch.bfloat16, device="cuda")
    nf4, _ = load_policy(tiny_model_dir, device="cuda", load_in_4bit=True)
    assert any(type(m).__name__ == "Linear4bit" for m in nf4.modules())
    part = grouped_rollout(tokenizer)
    want = batched_logprobs(bf16, part, 1.0, 4, precision="bfloat16")
    got = batched_logprobs(nf4, part, 1.0, 4, precision="bfloat16")
    mask = part.response_mask.bool()
    # NF4 rounds each weight to one of 16 levels of its block's absmax: the log-probs (~ -ln 512 = -6.2 for the
    # random tiny model) move by a few hundredths, not by whole nats
    assert (got - want)[mask].abs().mean() < 0.05
    assert (got - want)[mask].abs().max() < 0.3
