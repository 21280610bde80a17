"""Peak GPU memory per phase of a step (generate, log-probs, update, eval).

`torch.cuda.max_memory_allocated` counts tensors allocated by torch on the device, the
quantity that decides an out-of-memory error (the caching allocator's reserve is larger).
Each reading resets the peak, so a phase's figure is its own: memory/gpu_peak_mb/<phase>.
"""

from __future__ import annotations

import torch

MiB = 2**20


def on_gpu(device: str | torch.device) -> bool:
    return torch.device(device).type == "cuda"


def take_gpu_peak_mb(device: str | torch.device) -> float | None:
    """MiB allocated at the peak since the last call on `device`, then reset; None on a CPU."""
    if not on_gpu(device):
        return None
    peak = torch.cuda.max_memory_allocated(device) / MiB
    torch.cuda.reset_peak_memory_stats(device)
    return peak


def record_gpu_peak(metrics: dict, device: str | torch.device, phase: str) -> dict:
    """metrics["memory/gpu_peak_mb/<phase>"] = the phase's peak (on a GPU; nothing on a CPU)."""
    peak = take_gpu_peak_mb(device)
    if peak is not None:
        metrics[f"memory/gpu_peak_mb/{phase}"] = peak
    return metrics
