"""Fused kernels on CUDA (model.fused_kernels) and QLoRA's requirements (model.load_in_4bit).

- Liger's RMSNorm, rotary embedding and SwiGLU (Hsu et al. 2024, arXiv:2410.10989; liger-kernel),
  patched into the loaded model's modules before any adapter or copy is made, so the update, the
  reference (a copy, or the LoRA base with adapters off), the no-grad log-prob passes and the bf16
  sampling copy all run them. Liger's (fused linear) cross entropy stays off: covey computes log-probs
  and entropy itself.
- The fused head: a model registered with `use_fused_head` has its log-prob passes run its decoder to the
  last hidden states and compute log-probs and entropy block by block from the output layer
  (`covey.algos.linear_logprobs_and_entropy`): no micro-batch-wide (n, L, V) logits tensor exists.

On a CPU nothing changes (`auto` resolves to off). Options a machine cannot honour fail before the
model loads, in one line naming the key (`check_model_options`).
"""

from __future__ import annotations

import importlib.util
import weakref
from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from covey.models.errors import ModelError

KERNELS_EXTRA = "pip install 'covey[kernels]'"
QLORA_EXTRA = "pip install 'covey[qlora]'"
LIGER_SETTINGS = {"rope": True, "rms_norm": True, "swiglu": True, "cross_entropy": False,
                  "fused_linear_cross_entropy": False}
_FUSED_HEADS: weakref.WeakSet = weakref.WeakSet()


def has_package(name: str) -> bool:
    return importlib.util.find_spec(name) is not None


def resolve_fused_kernels(setting: str, device: torch.device | str) -> tuple[bool, str]:
    """(whether the kernels apply, the line the run prints): auto is on where CUDA and liger-kernel are
    present; `on` without either is a ModelError naming the key."""
    cuda, liger = torch.device(device).type == "cuda", has_package("liger_kernel")
    if setting == "off":
        return False, "off (model.fused_kernels=off)"
    if setting == "on":
        if not cuda:
            raise ModelError("model.fused_kernels=on needs a CUDA device (Liger's kernels are Triton): "
                             "use auto or off here")
        if not liger:
            raise ModelError(f"model.fused_kernels=on needs the optional package liger-kernel: {KERNELS_EXTRA}")
        return True, "on (model.fused_kernels=on)"
    if setting != "auto":
        raise ModelError(f"model.fused_kernels={setting!r}: one of auto, on, off")
    if not cuda:
        return False, "off (model.fused_kernels=auto: no CUDA device)"
    if not liger:
        return False, f"off (model.fused_kernels=auto: liger-kernel is not installed; {KERNELS_EXTRA})"
    return True, "on (model.fused_kernels=auto: CUDA and liger-kernel present)"


def check_model_options(fused_kernels: str, load_in_4bit: bool, device: torch.device | str) -> None:
    """One line naming the key, before any model loads, for a setting this machine cannot run (the config's
    checks have refused model.load_in_4bit without model.lora_rank)."""
    resolve_fused_kernels(fused_kernels, device)
    if not load_in_4bit:
        return
    if torch.device(device).type != "cuda":
        raise ModelError("model.load_in_4bit=true needs a CUDA device (bitsandbytes' NF4 kernels)")
    if not has_package("bitsandbytes"):
        raise ModelError(f"model.load_in_4bit=true needs the optional package bitsandbytes: {QLORA_EXTRA}")


def quantization_config():
    """bitsandbytes NF4 with double quantization, bf16 compute (Dettmers et al. 2023, arXiv:2305.14314)."""
    from transformers import BitsAndBytesConfig
    return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                              bnb_4bit_compute_dtype=torch.bfloat16)


def apply_liger_kernels(model: nn.Module) -> None:
    """Liger's RMSNorm, rotary and SwiGLU in this model instance (its class's model type must be one
    Liger patches); cross entropy untouched."""
    from liger_kernel.transformers.monkey_patch import MODEL_TYPE_TO_APPLY_LIGER_FN, _apply_liger_kernel_to_instance
    model_type = getattr(model.config, "model_type", None)
    if model_type not in MODEL_TYPE_TO_APPLY_LIGER_FN:
        raise ModelError(f"model.fused_kernels: liger-kernel has no kernels for model type {model_type!r}: "
                         "set model.fused_kernels=off")
    _apply_liger_kernel_to_instance(model=model, **LIGER_SETTINGS)


# --------------------------------------------------------------------------- the fused head


def use_fused_head(model: nn.Module) -> None:
    """The log-prob passes of `model` (and of a view over it, the LoRA reference) compute from hidden
    states and the output layer, a block of positions at a time."""
    _FUSED_HEADS.add(model)


@dataclass
class FusedHead:
    """How a pass reaches a model's last hidden states and its output layer."""
    decoder: Callable  # decoder(input_ids=..., attention_mask=..., position_ids=..., ...) -> .last_hidden_state
    weight: torch.Tensor
    bias: torch.Tensor | None


def fused_head(model: nn.Module) -> FusedHead | None:
    """The model's decoder and output layer where `use_fused_head` registered it (or the model a view
    reads, with its adapters off) and the output layer is a plain linear layer; None otherwise."""
    viewed = getattr(model, "viewed_model", None)
    target = viewed if viewed is not None else model
    if target not in _FUSED_HEADS:
        return None
    head = target.get_output_embeddings()
    if type(head) is not nn.Linear:  # e.g. an adapted output layer: the model's own forward applies it
        return None
    if getattr(getattr(target, "config", None), "final_logit_softcapping", None):  # Gemma's tanh cap on the logits
        return None
    decoder = target.get_decoder()
    if viewed is not None:
        def base_decoder(**kwargs):
            with viewed.disable_adapter():
                return decoder(**kwargs)
        return FusedHead(base_decoder, head.weight, head.bias)
    return FusedHead(decoder, head.weight, head.bias)
