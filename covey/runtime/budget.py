"""The GPU memory budget of a run on one GPU (train.gpu_memory_gib): what a run holds before its first
step, the check that it fits, and the bytes one sequence takes in each phase.

Arithmetic on plain numbers only (parameter counts, bytes, a model config's sizes), so every figure is
tested on a CPU with made-up cards. covey/runtime/memory.py sizes the batches from these figures at run
time; covey/training/memory_fit.py reads a run's numbers off its models and config.

What a run holds on the GPU from its first step to its last (the static memory):
  - weights: the policy's parameters and buffers in their dtype (the critic's too);
  - gradients: one per trained parameter, in its dtype (with LoRA the adapters' only);
  - optimizer state: bytes per trained parameter by optim.name: AdamW's two moments in the parameter's
    dtype (8 bytes for fp32), 8-bit AdamW 2 (Dettmers et al. 2021, arXiv:2110.02861; bitsandbytes,
    torchao), 4-bit AdamW 1 (Li et al. 2023, arXiv:2309.01507; torchao), bf16 moments 4; none on the GPU
    with optim.offload (the quantisation scales, a few hundredths of a byte, are left out);
  - the reference model, unless LoRA makes it the base with its adapters off;
  - the bf16 copy the sampler reads (rollout.precision=bfloat16 of an fp32 policy);
  - vLLM's share of the card (rollout.vllm_gpu_memory_utilization).
On top of it a step needs at least one sequence's activations in the update and the KV cache of one
prompt's group of samples in the sampler: the least a run can do, which the fit check adds.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

GiB = 2**30
HEADROOM = 0.10
"""train.gpu_memory_gib=0: the budget is the memory this process may use less this share, left to the CUDA
context, the kernels' workspaces and the caching allocator's unused blocks (torch counts only tensors)."""

OPTIMIZER_BYTES = {"adamw_8bit": 2, "paged_adamw_8bit": 2, "adamw_4bit": 1, "adamw_bf16": 4}
"""Optimizer state bytes per trained parameter by optim.name; AdamW (and a name not listed) keeps two
moments in the parameter's own dtype."""

LORA_PROJECTIONS = ("q", "k", "v", "o", "gate", "up", "down")
SMALLEST_BUCKET = 8


def row_bucket(rows: int) -> int:
    """Rows the fast engine's static decoder holds for `rows` sequences: the smallest power of two >= rows,
    at least SMALLEST_BUCKET (covey/rollout/static_decode.py, whose buckets a test compares with these)."""
    size = SMALLEST_BUCKET
    while size < rows:
        size *= 2
    return size


class DoesNotFit(ValueError):
    """A run that cannot fit its GPU memory budget (one line: the numbers and what would fit)."""


@dataclass(frozen=True)
class RunShape:
    """What the estimate reads: bytes a run holds on one GPU, counts of what it trains."""
    weights: int
    """Bytes of the policy's (and the critic's) parameters and buffers in their dtypes."""
    trained: int
    """Trained parameters (the adapters with LoRA; the critic's included)."""
    trained_bytes: int
    """Their bytes (the gradients take as many)."""
    reference: int = 0
    """Bytes of the reference copy on the GPU (0: none, or LoRA's base with its adapters off)."""
    sampling_copy: int = 0
    """Bytes of the sampler's bf16 copy of the policy (0: it samples the policy itself)."""
    engine: int = 0
    """Bytes an engine of its own reserves (vLLM's share of the card)."""
    optimizer: str = "adamw"
    offload: bool = False
    """optim.offload: the optimizer state lives in CPU memory."""
    activations: int = 0
    """Bytes of one sequence's activations in the update (the least micro-batch)."""
    kv_cache: int = 0
    """Bytes of the sampler's KV cache for one prompt's group (the least generate call)."""


def optimizer_state_bytes(shape: RunShape) -> int:
    if shape.offload:
        return 0
    if shape.optimizer in OPTIMIZER_BYTES:
        return OPTIMIZER_BYTES[shape.optimizer] * shape.trained
    return 2 * shape.trained_bytes


def static_parts(shape: RunShape) -> dict[str, int]:
    """Bytes held from the first step to the last, by what holds them (zeros left out)."""
    parts = {"weights": shape.weights, "gradients": shape.trained_bytes,
             "optimizer state": optimizer_state_bytes(shape), "reference": shape.reference,
             "sampling copy": shape.sampling_copy, "vLLM": shape.engine}
    return {name: size for name, size in parts.items() if size}


def least_parts(shape: RunShape) -> dict[str, int]:
    """The static memory plus the least a step needs: one sequence in the update, one group's KV cache."""
    parts = {**static_parts(shape), "one sequence's activations": shape.activations,
             "one group's KV cache": shape.kv_cache}
    return {name: size for name, size in parts.items() if size}


def least_bytes(shape: RunShape) -> int:
    return sum(least_parts(shape).values())


def default_budget(allowed_bytes: int) -> int:
    """train.gpu_memory_gib=0: what this process may use on the card less HEADROOM."""
    return int(allowed_bytes * (1 - HEADROOM))


def budget_bytes(setting_gib: float, allowed_bytes: int) -> int:
    """train.gpu_memory_gib in bytes (0: the default); more than the card allows is one line."""
    if setting_gib <= 0:
        return default_budget(allowed_bytes)
    if setting_gib * GiB > allowed_bytes:
        raise DoesNotFit(f"train.gpu_memory_gib={setting_gib:g} is more than the {allowed_bytes / GiB:.1f} GiB "
                         "this process may use on its GPU: lower it, or 0 for "
                         f"{default_budget(allowed_bytes) / GiB:.1f} GiB")
    return int(setting_gib * GiB)


def gib(size: float) -> str:
    return f"{size / GiB:.1f}"


def check_fit(shape: RunShape, budget: int, alternatives: dict[str, RunShape]) -> None:
    """Nothing when the least the run needs fits `budget`; else DoesNotFit, one line with the parts and
    each alternative's total (`alternatives`: the setting that changes the run -> its shape)."""
    need = least_bytes(shape)
    if need <= budget:
        return
    parts = ", ".join(f"{name} {gib(size)}" for name, size in least_parts(shape).items())
    totals = {setting: least_bytes(other) for setting, other in alternatives.items()}
    listed = ", ".join(f"{setting} ({gib(total)} GiB)" for setting, total in totals.items())
    fits = [setting for setting, total in totals.items() if total <= budget]
    if fits:
        advice = "would fit: " + ", ".join(f"{s} ({gib(totals[s])} GiB)" for s in fits)
    elif totals:
        advice = f"none of these fits alone, combine them: {listed}"
    else:
        advice = "a larger card or a smaller model"
    raise DoesNotFit(f"GPU memory: the run needs at least {gib(need)} GiB ({parts}) and train.gpu_memory_gib "
                     f"allows {gib(budget)} GiB; {advice}")


# --------------------------------------------------------------------------- bytes per position


def text_config(config):
    """The decoder's config (a multimodal model's text part), whose sizes the estimates read."""
    return config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config


def attention_sizes(config) -> tuple[int, int, int]:
    """(query heads, key-value heads, head dimension)."""
    config = text_config(config)
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return heads, getattr(config, "num_key_value_heads", None) or heads, head_dim


def update_bytes_per_position(config, element_bytes: int) -> int:
    """Bytes one position keeps for the backward in the update, over every layer (a Llama / Qwen2 decoder
    layer, HF's modules, activations of `element_bytes`: 2 under bf16 autocast, 4 in fp32):
      - the two RMSNorms, which work in float32: their input and normalised output, 2 x 2 x 4 H = 16 H bytes;
      - the inputs of the q, k, v, o, gate and up projections (autocast casts each, 3 H + H + 2 H)
        and queries plus attention output (2 H): 8 H elements;
      - keys and values for the attention backward: 2 x kv_heads x head_dim elements;
      - the MLP: the gate before SiLU, SiLU's output, up, and down's input: 4 I elements.
    The logits are read in bounded blocks (covey/algos/logits.py) and not counted. On one H100 the
    1.5B benchmark's update grew by 3.3 MB a position from 8 to 32 sequences; this gives 3.4."""
    _, kv, head_dim = attention_sizes(config)
    config = text_config(config)
    hidden, inter = config.hidden_size, config.intermediate_size
    per_layer = 16 * hidden + element_bytes * (8 * hidden + 2 * kv * head_dim + 4 * inter)
    return config.num_hidden_layers * per_layer


def checkpointed_bytes_per_position(config, element_bytes: int, hidden_bytes: int) -> int:
    """The same with model.gradient_checkpointing: each layer keeps only its input (H elements of the
    residual stream, `hidden_bytes` each: the parameters' dtype), and one layer at a time is recomputed."""
    config = text_config(config)
    per_layer = update_bytes_per_position(config, element_bytes) // config.num_hidden_layers
    return config.num_hidden_layers * hidden_bytes * config.hidden_size + per_layer


def no_grad_bytes_per_position(config) -> int:
    """Bytes one position takes in a no-grad log-prob pass (old policy, reference, values): nothing is kept
    from layer to layer, so the peak is its logits (bf16, 2 V bytes; read in bounded blocks) and one layer's
    activations: the MLP's gate, up and product (3 x 2 I bytes) and about eight hidden-size vectors in
    float32 and bf16 (16 H bytes)."""
    config = text_config(config)
    return 2 * config.vocab_size + 6 * config.intermediate_size + 16 * config.hidden_size


def sampler_bytes_per_row(config, capacity: int, element_bytes: int) -> int:
    """Bytes one sampled sequence holds in the sampler: keys and values of every layer at each of `capacity`
    positions (2 x layers x kv_heads x head_dim elements a position, the sampler's precision), its uniforms
    and picked tokens (4 + 8 bytes a position), and a float32 row of logits and one of probabilities (8 V)."""
    _, kv, head_dim = attention_sizes(config)
    config = text_config(config)
    kv_position = 2 * config.num_hidden_layers * kv * head_dim * element_bytes
    return capacity * (kv_position + 12) + 8 * config.vocab_size


def lora_parameters(config, rank: int) -> int:
    """Adapter parameters of model.lora_rank=`rank` on every linear of every layer (all-linear): rank x
    (inputs + outputs) for q, k, v, o, gate, up and down."""
    heads, kv, head_dim = attention_sizes(config)
    config = text_config(config)
    hidden, inter = config.hidden_size, config.intermediate_size
    sides = {"q": hidden + heads * head_dim, "k": hidden + kv * head_dim, "v": hidden + kv * head_dim,
             "o": heads * head_dim + hidden, "gate": hidden + inter, "up": hidden + inter, "down": inter + hidden}
    return config.num_hidden_layers * rank * sum(sides[p] for p in LORA_PROJECTIONS)


def with_lora(shape: RunShape, adapters: int, element_bytes: int, critic: int = 0, critic_bytes: int = 0) -> RunShape:
    """The shape under LoRA: `adapters` parameters added and trained (with the critic's `critic` parameters of
    `critic_bytes`, trained as before), the reference gone (the base with its adapters off)."""
    return dataclasses.replace(shape, weights=shape.weights + adapters * element_bytes, trained=adapters + critic,
                               trained_bytes=adapters * element_bytes + critic_bytes, reference=0)
