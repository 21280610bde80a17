"""Which attention kernel a pass runs: eager for bf16 on a CPU, the model's own (SDPA) elsewhere.

torch's CPU flash-attention kernel (what SDPA picks there) is slow in bf16 at covey's
sizes: a decode step's attention over a 70-position cache took 0.9 ms per layer, 43% of a
bf16 rollout, and the packed training pass with its block mask ran 15% slower than with
eager attention (bf16 products, float32 softmax). In float32 SDPA is the faster one
(dev/LOG.md, 2026-11-25), and GPUs keep their fused kernels.
"""

from __future__ import annotations

import contextlib

import torch


def half_precision(model) -> bool:
    """True for a model whose weights are bf16 or fp16 (model.dtype), which computes in that precision."""
    try:
        return model.dtype in (torch.bfloat16, torch.float16)
    except (AttributeError, StopIteration):  # no dtype, or no parameters of its own
        return False


def fastest_attention(model, low_precision: bool, device: torch.device | str) -> str:
    """eager for a low-precision pass on a CPU, else the model's configured implementation."""
    if low_precision and torch.device(device).type == "cpu":
        return "eager"
    return model.config._attn_implementation


@contextlib.contextmanager
def attention_implementation(model, name: str):
    """Run the model's attention layers with `name` (they read the config at every call), then restore it."""
    config = model.config
    before = config._attn_implementation
    config._attn_implementation = name
    try:
        yield
    finally:
        config._attn_implementation = before


def sampling_attention(model):
    """`attention_implementation` with the fastest kernel for passes in the model's own precision (generation)."""
    device = next(model.parameters()).device
    return attention_implementation(model, fastest_attention(model, half_precision(model), device))
