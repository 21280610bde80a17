"""The optimizers of a run and their state: AdamW (fused where the parameters allow) or a low-memory
AdamW from torchao or bitsandbytes (optim.name), its state optionally on the CPU (optim.offload); the
learning-rate schedule and the KL controller.

Bytes per trained parameter, weights + gradient + optimizer state (measured: dev/LOG.md, 2026-11-27):
adamw 4 + 4 + 8 = 16; adamw_8bit 4 + 4 + ~2; adamw_4bit 4 + 4 + ~1; adamw_bf16 2 + 2 + 4 = 8;
with model.dtype=bfloat16 the low-bit ones keep 2-byte weights and gradients too.
"""

from __future__ import annotations

import functools
import importlib.util
import warnings
from dataclasses import dataclass
from typing import Callable

import torch

from covey import algos
from covey.config import ConfigError
from covey.training.plan import KLOptions
from covey.training.plan_setup import OptimizerOptions


@dataclass(frozen=True)
class OptimizerKind:
    """One value of optim.name: the library that implements it and what it needs."""
    load: Callable[[], tuple[type, dict]]
    """Imports the library: (optimizer class, keyword arguments beside lr, betas and weight_decay)."""
    package: str = ""
    """The optional package it needs ('' = torch alone)."""
    cuda_only: bool = False
    """Refused on a CPU run."""


def _torchao(name: str) -> Callable[[], tuple[type, dict]]:
    def load():
        # torch's note that torchao's state tensors have no stable hash for its compile cache: nothing to act on
        warnings.filterwarnings("ignore", message=".*_stable_hash_for_caching", category=UserWarning)
        import torchao.optim
        # bf16 weights are rounded stochastically (unbiased, Gupta et al. 2015, arXiv:1502.02551); fp32 ones as usual.
        return getattr(torchao.optim, name), {"bf16_stochastic_round": True}
    return load


def _paged_adamw_8bit():
    import bitsandbytes as bnb
    return bnb.optim.PagedAdamW8bit, {}


OPTIMIZERS = {
    "adamw": OptimizerKind(lambda: (torch.optim.AdamW, {})),
    "adamw_8bit": OptimizerKind(_torchao("AdamW8bit"), "torchao"),  # Dettmers et al. 2021, arXiv:2110.02861
    "adamw_4bit": OptimizerKind(_torchao("AdamW4bit"), "torchao"),  # Li et al. 2023, arXiv:2309.01507
    "adamw_bf16": OptimizerKind(_torchao("_AdamW"), "torchao"),  # in torchao.optim's __all__ (0.18): full-width state
    "paged_adamw_8bit": OptimizerKind(_paged_adamw_8bit, "bitsandbytes", cuda_only=True),
}
LOWMEM_EXTRA = {"torchao": "lowmem", "bitsandbytes": "lowmem-cuda"}
"""The pip extra that installs each optional optimizer package (pyproject.toml): torchao alone is CPU-safe."""


def check_optimizer(optim: OptimizerOptions, device: str) -> None:
    """Before any model loads: optim.name's package is installed and optim.name / optim.offload can run on
    `device` (the resolved train.device), else one line naming the key; then a line saying which optimizer
    runs where it is not the default."""
    kind = OPTIMIZERS[optim.name]
    on_cuda = torch.device(device).type == "cuda"
    if kind.cuda_only and not on_cuda:
        raise ConfigError(f"optim.name={optim.name} pages its state between GPU and CPU memory: it needs CUDA "
                          f"(train.device is {device}); on a CPU use optim.name=adamw_8bit")
    if optim.offload and not on_cuda:
        raise ConfigError(f"optim.offload=true moves the optimizer state off a GPU: it needs CUDA (train.device is "
                          f"{device}); on a CPU the state already lives in CPU memory")
    needed = [kind.package] + ["torchao"] * optim.offload
    for package in filter(None, needed):
        if importlib.util.find_spec(package) is None:
            key = f"optim.name={optim.name}" if package == kind.package else "optim.offload=true"
            raise ConfigError(f"{key} needs the optional package {package}: "
                              f"pip install 'covey[{LOWMEM_EXTRA[package]}]'")
    if optim.name != "adamw" or optim.offload:
        compiles = "; its first step compiles the update for each parameter shape" if kind.package == "torchao" else ""
        print(f"covey: optimizer {optim.name} ({kind.package or 'torch'})"
              + (", its state in CPU memory (optim.offload)" if optim.offload else "") + compiles)


def make_optimizer(params, lr: float, optim: OptimizerOptions) -> torch.optim.Optimizer:
    """optim.name at `lr` with optim.betas and optim.weight_decay; with optim.offload, its state and its
    step on the CPU. torch's AdamW has its moments allocated now; the others allocate at their first step."""
    params = [p for p in params if p.requires_grad]
    cls, extra = OPTIMIZERS[optim.name].load()
    kwargs = dict(lr=lr, betas=optim.betas, weight_decay=optim.weight_decay, **extra)
    if optim.offload:
        return offloaded_optimizer_class()(params, optimizer_class=cls, **kwargs)
    if cls is not torch.optim.AdamW:
        return cls(params, **kwargs)
    # Fused: one pass over each tensor instead of ~10 (0.7 s -> 0.2 s per step for 135M on one core);
    # the same update up to float rounding. Plain tensors only (not FSDP2's DTensors).
    fused = all(type(p.data) is torch.Tensor and p.device.type in ("cpu", "cuda") for p in params)
    optimizer = torch.optim.AdamW(params, fused=fused or None, **kwargs)
    allocate_adamw_state(optimizer)
    return optimizer


@functools.cache
def offloaded_optimizer_class() -> type:
    """torchao's CPUOffloadOptimizer, stepping on the gradients as clipped (defined on first use: torchao is
    optional).

    It copies each gradient to the CPU as the backward pass makes it, before optim.max_grad_norm clips it on
    the GPU; `step` copies the clipped gradients once more (one more device-to-host copy of the gradients
    per step) so that the offloaded update is the one the run computes on the GPU.
    """
    from torchao.optim import CPUOffloadOptimizer

    class ClippedCPUOffloadOptimizer(CPUOffloadOptimizer):
        @torch.no_grad()
        def step(self, closure=None):
            self.stream.synchronize()  # the backward hooks' copies are done
            for p_device in [p for p in self.queue if p.grad is None]:  # queued before a skipped step, no gradient now
                del self.queue[p_device]
            for p_device, p_host in self.param_d2h_map.items():
                if p_device.grad is not None:
                    p_host.grad.copy_(p_device.grad)
            return super().step(closure)

        @property
        def state(self) -> dict:
            """Every parameter's state, offloaded or not (covey/runtime/memory.py reads it)."""
            inner = [*self.optim_dict.values(), *([self.d_opt] if self.d_opt is not None else [])]
            return {p: s for optimizer in inner for p, s in optimizer.state.items()}

    return ClippedCPUOffloadOptimizer


def allocate_adamw_state(optimizer: torch.optim.AdamW) -> None:
    """Allocate the moments of a fused AdamW now, as its first step would (zeros, step 0).

    Left to the first step, the moments (1 GiB for 135M parameters) land in the heap that the
    first update's activations have just freed, so the second update grows the heap by about
    as much again and faults its pages in: 0.37M page faults, 9.4 s against ~6 s for later
    updates on a 2-core CPU (dev/LOG.md, 2026-11-25). Allocated before any pass, they sit below
    the activations. The steps are bit-identical (tests/training/test_update.py).
    """
    for group in optimizer.param_groups:
        if not group["fused"]:  # torch's own lazy path for the rest (FSDP2's DTensors)
            continue
        for p in group["params"]:
            state = optimizer.state[p]
            if state:
                continue
            state["step"] = torch.zeros((), dtype=torch.float32, device=p.device)  # fused: a float32 tensor
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            if group["amsgrad"]:
                state["max_exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)


def state_tensors(state, name: str = ""):
    """(name, plain tensor) of an optimizer's state_dict() in any layout: torch's, an offloaded one's (a list of
    per-parameter state dicts), and torchao's quantized moments as the tensors they hold (codes and scales)."""
    if isinstance(state, dict):
        for key, value in state.items():
            if key == "param_groups":  # lr and betas, not state
                continue
            yield from state_tensors(value, f"{name}.{key}" if name else str(key))
    elif isinstance(state, (list, tuple)):
        for index, value in enumerate(state):
            yield from state_tensors(value, f"{name}.{index}")
    elif torch.is_tensor(state) and type(state) is not torch.Tensor and hasattr(state, "__tensor_flatten__"):
        inner, _ = state.__tensor_flatten__()
        for attr in inner:
            yield from state_tensors(getattr(state, attr), f"{name}.{attr}")
    elif torch.is_tensor(state):
        yield name, state


def state_bytes(optimizer) -> int:
    """Bytes the optimizer's state takes (moments, quantization scales and maps, step counters)."""
    return sum(t.numel() * t.element_size() for _, t in state_tensors(optimizer.state_dict()))


class WarmupSchedule(torch.optim.lr_scheduler.LambdaLR):
    """LambdaLR whose get_last_lr() is plain floats (torchao's optimizers hold lr as a tensor)."""

    def get_last_lr(self) -> list[float]:
        return [float(lr) for lr in super().get_last_lr()]


def make_scheduler(optimizer, warmup_steps: int):
    """Linear warm-up to the configured lr, constant after."""
    return WarmupSchedule(optimizer, lambda s: min(1.0, (s + 1) / warmup_steps) if warmup_steps > 0 else 1.0)


def make_kl_controller(kl: KLOptions):
    """The adaptive controller (Ziegler et al. 2019, arXiv:1909.08593) when a target is set, else a fixed beta."""
    if kl.target > 0:
        return algos.AdaptiveKLController(kl.beta, kl.target, kl.horizon)
    return algos.FixedKLController(kl.beta)
