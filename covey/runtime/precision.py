"""Where bfloat16 pays: the hardware that computes it natively (rollout.precision, model.autocast=auto).

On an x86 CPU without AMX-BF16 or AVX512-BF16, torch emulates bf16 matrix products
(about 1 GFLOP/s on a Zen 3 where fp32 runs at 180); with them, bf16 runs 2.3-4x faster than
fp32 (424 against 184 GFLOP/s on a 2-core Zen 4, 818 against 193 on a Zen 5: dev/LOG.md, 2026-11-25).
"""

from __future__ import annotations

import contextlib
import functools
from pathlib import Path

import torch


@functools.lru_cache(maxsize=1)
def cpu_has_native_bf16(cpuinfo: str = "/proc/cpuinfo") -> bool:
    """True on x86 CPUs with AMX-BF16 or AVX512-BF16 (Linux flags); elsewhere bf16 may be emulated (~40x slower)."""
    try:
        text = Path(cpuinfo).read_text()
    except OSError:
        return False
    flags = next((line.split(":", 1)[1].split() for line in text.splitlines() if line.startswith("flags")), [])
    return "amx_bf16" in flags or "avx512_bf16" in flags


def native_bf16(device: torch.device | str = "cpu") -> bool:
    """True where bf16 matrix products run natively on `device` (a CUDA GPU that supports it, or such a CPU)."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported()
    return device.type == "cpu" and cpu_has_native_bf16()


def resolve_auto(key: str, setting: str, choices: tuple[str, ...], off: str, device: torch.device | str) -> str:
    """A precision setting (`key` names it in errors) as given, or for `auto`: bfloat16 where `device`
    computes it natively, `off` elsewhere."""
    if setting not in choices:
        raise ValueError(f"{key}={setting!r}: one of {', '.join(choices)}")
    if setting != "auto":
        return setting
    return "bfloat16" if native_bf16(device) else off


def model_device(model) -> torch.device:
    """Where the model computes (a DTensor parameter of FSDP2 reports its device too).

    A module without parameters of its own (the LoRA reference view) names its device.
    """
    param = next(model.parameters(), None)
    return param.device if param is not None else torch.device(getattr(model, "device", "cpu"))


AUTOCAST = ("none", "bfloat16", "auto")


def resolve_autocast(setting: str, device: torch.device | str = "cpu") -> str:
    """model.autocast -> none | bfloat16. auto: bfloat16 only where the device computes it natively."""
    return resolve_auto("model.autocast", setting, AUTOCAST, "none", device)


def autocast_context(precision: str, device: torch.device | str = "cpu"):
    """Autocast on the device the inputs are on (torch.autocast("cpu") would leave CUDA passes in fp32)."""
    device = torch.device(device)
    if resolve_autocast(precision, device) == "bfloat16":
        return torch.autocast(device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def shared_weight_casts(precision: str, device: torch.device | str = "cpu"):
    """Around the passes and backwards of one optimizer step: autocast casts each weight to bf16 once.

    autocast caches the bf16 copy of a weight that requires grad until the outermost autocast
    region exits, so each micro-batch's `autocast_context` made its own copies, and the step's
    prompt pass (covey/passes/prompt_cache.py), whose backward comes after the last micro-batch, kept a
    second set alive. An enclosing region with autocast off keeps one set for the whole step
    and leaves the backwards inside it outside autocast. Exit before the optimizer steps (the
    copies would go stale), and run no no-grad pass of the same weights inside: autocast would
    cache a copy without a gradient path and reuse it.
    """
    device = torch.device(device)
    if resolve_autocast(precision, device) != "bfloat16":
        return contextlib.nullcontext()
    return torch.autocast(device.type, enabled=False)
