"""train.gpu_memory_gib on emulated 24 GiB and 48 GiB cards (torch.cuda.set_per_process_memory_fraction; marked
`gpu`: skipped without CUDA).

A random 1.43B-parameter Llama (hidden 4096, 10 layers, MLP 8192, 32 query and 8 key-value heads, the tiny
tokenizer's 512 tokens) in fp32 with AdamW holds about 26.6 GiB before its first step (weights 5.7e9 bytes,
gradients 5.7e9, moments 11.4e9, a bf16 reference and sampling copy 2.9e9 each: covey/runtime/budget.py). On
the 24 GiB card (budget 21.6 GiB) it is refused before its first step, in one line naming LoRA and an 8-bit
optimizer; with model.lora_rank=16, as the line says, it trains within the budget; on the 48 GiB card (budget
43.2 GiB) it trains in fp32, its update micro-batches fitted to what the static memory leaves.
"""

import json

import pytest
import torch

from covey.cli.main import main
from covey.models.tiny import tiny_llama, tiny_tokenizer
from tests.helpers import tiny_overrides

pytestmark = pytest.mark.gpu

GiB = 2**30
KEYS = {"reward.functions": "tests.helpers:varied_reward", "train.device": "cuda", "rollout.prompts_per_step": 4,
        "rollout.group_size": 8, "rollout.max_new_tokens": 192, "algo.micro_batch_size": 32,
        "task.eval_size": 2, "rollout.eval_max_new_tokens": 4}


@pytest.fixture(scope="module")
def model_1_4b(tmp_path_factory):
    """The 1.43B random Llama as an HF folder (initialised on the GPU: seconds)."""
    out = tmp_path_factory.mktemp("llama1_4b") / "model"
    tokenizer = tiny_tokenizer()
    with torch.device("cuda"):
        model = tiny_llama(len(tokenizer), hidden_size=4096, num_layers=10, num_heads=32, num_kv_heads=8)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    del model
    torch.cuda.empty_cache()
    return str(out)


@pytest.fixture
def card():
    """emulate(gib): this process may allocate `gib` GiB of the GPU, as on a card of that size."""
    def emulate(gib: float) -> int:
        total = torch.cuda.get_device_properties(0).total_memory
        if gib * GiB > total:
            pytest.skip(f"a {gib} GiB card cannot be emulated on a {total / GiB:.0f} GiB one")
        torch.cuda.empty_cache()
        torch.cuda.set_per_process_memory_fraction(gib * GiB / total)
        return int(0.9 * gib * GiB)  # train.gpu_memory_gib=0: the card less 10%
    yield emulate
    torch.cuda.set_per_process_memory_fraction(1.0)
    torch.cuda.empty_cache()


def step_rows(run_dir) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []
    return [row for row in rows if "reward/mean" in row]


def assert_within(rows: list[dict], budget: int) -> None:
    """Two steps, every phase's peak under the budget, and no out-of-memory halving on the way."""
    assert [row["step"] for row in rows] == [1, 2]
    for row in rows:
        peaks = {k: v for k, v in row.items() if k.startswith("memory/gpu_peak_mb/")}
        assert peaks and max(peaks.values()) * 2**20 <= budget, (peaks, budget / 2**20)
        assert row["memory/oom_retries"] == 0


def test_a_24_gib_card_refuses_the_fp32_run_before_its_first_step_and_trains_it_with_lora(
        model_1_4b, card, tmp_path, capsys):
    budget = card(24)
    keys = {**KEYS, "train.run_name": "fp32"}
    assert main(["train", "grpo", *tiny_overrides(model_1_4b, tmp_path, **keys)]) != 0
    err = capsys.readouterr().err
    line = next(x for x in err.splitlines() if "GPU memory: the run needs at least" in x)
    assert "train.gpu_memory_gib allows 21.6 GiB; would fit: model.lora_rank=16" in line
    assert step_rows(tmp_path / "fp32") == []
    keys = {**KEYS, "train.run_name": "lora", "model.lora_rank": 16}
    assert main(["train", "grpo", *tiny_overrides(model_1_4b, tmp_path, **keys)]) == 0
    assert_within(step_rows(tmp_path / "lora"), budget)


def test_a_48_gib_card_trains_it_in_fp32_within_the_budget(model_1_4b, card, tmp_path, capsys):
    budget = card(48)
    keys = {**KEYS, "train.run_name": "fp32"}
    assert main(["train", "grpo", *tiny_overrides(model_1_4b, tmp_path, **keys)]) == 0
    assert "covey: GPU memory budget 43.2 GiB (train.gpu_memory_gib=0)" in capsys.readouterr().out
    rows = step_rows(tmp_path / "fp32")
    assert_within(rows, budget)
    assert all(1 <= row["memory/micro_batch/update"] <= 32 for row in rows)
