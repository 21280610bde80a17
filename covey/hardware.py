"""Where bfloat16 pays: the hardware that computes it natively (rollout.precision, model.autocast=auto).

On an x86 CPU without AMX-BF16 or AVX512-BF16, torch emulates bf16 matrix products
(about 1 GFLOP/s on a Zen 3 where fp32 runs at 180); with them, bf16 runs 2.3-4x faster than
fp32 (424 against 184 GFLOP/s on a 2-core Zen 4, 818 against 193 on a Zen 5: LOG.md, 2026-11-25).
"""

from __future__ import annotations

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
