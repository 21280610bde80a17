"""The GPU memory budget's arithmetic (covey/runtime/budget.py) on made-up cards, every figure derived by hand.

The model throughout is Qwen2.5-1.5B's shape: hidden H = 1536, MLP I = 8960, 28 layers, 12 query and 2
key-value heads of 128, vocabulary V = 151936; its parameters rounded to 1.5e9.
"""

import dataclasses
from types import SimpleNamespace

import pytest

from covey.rollout import static_decode
from covey.runtime import budget

QWEN_1_5B = SimpleNamespace(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                            num_key_value_heads=2, head_dim=128, vocab_size=151936)
GiB = 2**30


def shape_1_5b() -> budget.RunShape:
    """fp32 weights 1.5e9 x 4 = 6e9 bytes, all trained (gradients 6e9), a reference held in bf16 and the
    sampler's bf16 copy (1.5e9 x 2 = 3e9 each); one sequence of 290 positions under bf16 autocast takes
    3411968 x 290 = 989470720 bytes (test_update_bytes_per_position), one group of 8 samples 8 x 9533848 =
    76270784 bytes of KV cache (test_sampler_row)."""
    return budget.RunShape(weights=6_000_000_000, trained=1_500_000_000, trained_bytes=6_000_000_000,
                      reference=3_000_000_000, sampling_copy=3_000_000_000, activations=989_470_720,
                      kv_cache=76_270_784)


def test_update_bytes_per_position():
    """Per layer 16 H = 24576 float32 norm bytes, plus under bf16 2 x (8 H + 2 x 2 x 128 + 4 I) =
    2 x (12288 + 512 + 35840) = 97280: 121856 a layer, x 28 = 3411968 a position; in fp32 the elements take 4:
    24576 + 194560 = 219136 a layer, x 28 = 6135808."""
    assert budget.update_bytes_per_position(QWEN_1_5B, 2) == 3_411_968
    assert budget.update_bytes_per_position(QWEN_1_5B, 4) == 6_135_808


def test_gradient_checkpointing_keeps_one_hidden_vector_a_layer_and_one_whole_layer():
    """fp32 residual stream: 28 x 4 x 1536 = 172032, plus one layer recomputed (121856 under bf16): 293888."""
    assert budget.checkpointed_bytes_per_position(QWEN_1_5B, 2, 4) == 293_888


def test_no_grad_bytes_per_position():
    """2 V (bf16 logits) + 6 I + 16 H = 303872 + 53760 + 24576 = 382208."""
    assert budget.no_grad_bytes_per_position(QWEN_1_5B) == 382_208


def test_sampler_row():
    """Keys and values in bf16: 2 x 28 layers x 2 heads x 128 x 2 bytes = 28672 a position, + 12 (uniform and
    token) = 28684; x 290 = 8318360; + 8 V = 1215488 of logits and probabilities: 9533848."""
    assert budget.sampler_bytes_per_row(QWEN_1_5B, 290, 2) == 9_533_848


def test_lora_parameters_on_every_linear():
    """Inputs + outputs a layer: q 1536 + 1536, k and v 1536 + 256 each, o 1536 + 1536, gate and up
    1536 + 8960 each, down 8960 + 1536: 3072 + 3584 + 3072 + 20992 + 10496 = 41216; x rank 16 x 28 layers
    = 18464768 (PEFT reports 18,464,768 trainable for this model at r=16, all-linear)."""
    assert budget.lora_parameters(QWEN_1_5B, 16) == 18_464_768


def test_optimizer_state_by_name():
    """AdamW: two moments in the parameters' dtype (2 x 6e9 bytes for 1.5e9 fp32); 8-bit 2 bytes a parameter,
    4-bit 1, bf16 moments 4; offloaded, none on the GPU."""
    shape = shape_1_5b()
    assert budget.optimizer_state_bytes(shape) == 12_000_000_000
    for name, size in (("adamw_8bit", 3e9), ("paged_adamw_8bit", 3e9), ("adamw_4bit", 1.5e9), ("adamw_bf16", 6e9)):
        assert budget.optimizer_state_bytes(dataclasses.replace(shape, optimizer=name)) == size
    assert budget.optimizer_state_bytes(dataclasses.replace(shape, offload=True)) == 0


def test_the_least_a_1_5b_fp32_run_needs():
    """6e9 weights + 6e9 gradients + 12e9 moments + 3e9 reference + 3e9 sampling copy = 30e9 static bytes;
    + 989470720 + 76270784 = 31065741504 bytes = 28.93 GiB."""
    shape = shape_1_5b()
    assert sum(budget.static_parts(shape).values()) == 30_000_000_000
    assert budget.least_bytes(shape) == 31_065_741_504
    assert list(budget.least_parts(shape)) == ["weights", "gradients", "optimizer state", "reference", "sampling copy",
                                          "one sequence's activations", "one group's KV cache"]


def test_the_budget_is_the_card_less_a_tenth_or_what_the_user_sets():
    """A 24 GiB card (25769803776 bytes): 0 gives 0.9 x 25769803776 = 23192823398 bytes (21.6 GiB)."""
    card = 24 * GiB
    assert budget.budget_bytes(0, card) == 23_192_823_398
    assert budget.budget_bytes(20, card) == 20 * GiB
    with pytest.raises(budget.DoesNotFit, match=r"^train.gpu_memory_gib=30 is more than the 24.0 GiB this process"):
        budget.budget_bytes(30, card)


def alternatives_1_5b(shape: budget.RunShape) -> dict:
    """LoRA r=16: 18464768 adapters in fp32 (73859072 bytes) trained, the reference gone: 6073859072 weights +
    73859072 gradients + 147718144 moments + 3e9 copy + 989470720 + 76270784 = 10361177792 bytes (9.65 GiB).
    8-bit AdamW: moments 3e9 instead of 12e9: 31065741504 - 9e9 = 22065741504 (20.55 GiB).
    Gradient checkpointing: a sequence takes max(293888, 382208 no-grad) x 290 = 110840320 bytes:
    30e9 + 110840320 + 76270784 = 30187111104 (28.11 GiB)."""
    return {"model.lora_rank=16": budget.with_lora(shape, 18_464_768, 4),
            "optim.name=adamw_8bit": dataclasses.replace(shape, optimizer="adamw_8bit"),
            "model.gradient_checkpointing=true": dataclasses.replace(shape, activations=110_840_320)}


def test_a_24_gib_card_refuses_the_1_5b_run_in_one_line_naming_what_would_fit():
    shape = shape_1_5b()
    options = alternatives_1_5b(shape)
    assert [budget.least_bytes(s) for s in options.values()] == [10_361_177_792, 22_065_741_504, 30_187_111_104]
    with pytest.raises(budget.DoesNotFit) as err:
        budget.check_fit(shape, budget.budget_bytes(0, 24 * GiB), options)
    line = str(err.value)
    assert "\n" not in line
    assert line == ("GPU memory: the run needs at least 28.9 GiB (weights 5.6, gradients 5.6, optimizer state 11.2, "
                    "reference 2.8, sampling copy 2.8, one sequence's activations 0.9, one group's KV cache 0.1) "
                    "and train.gpu_memory_gib allows 21.6 GiB; would fit: model.lora_rank=16 (9.6 GiB), "
                    "optim.name=adamw_8bit (20.6 GiB)")


def test_a_48_gib_card_holds_it_and_a_tiny_budget_says_that_nothing_alone_fits():
    shape = shape_1_5b()
    budget.check_fit(shape, budget.budget_bytes(0, 48 * GiB), alternatives_1_5b(shape))  # 43.2 GiB: fits
    with pytest.raises(budget.DoesNotFit, match="allows 8.0 GiB; none of these fits alone, combine them: "
                                           r"model.lora_rank=16 \(9.6 GiB\), optim"):
        budget.check_fit(shape, 8 * GiB, alternatives_1_5b(shape))


def test_rows_are_held_in_the_static_decoders_buckets():
    for rows in (1, 8, 9, 48, 64, 65, 200):
        assert budget.row_bucket(rows) == static_decode.row_bucket(rows)
