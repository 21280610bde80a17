"""Processes and collectives on torch.distributed, with no RL in them.

There is no launcher or communication layer of covey's own: `torchrun` sets RANK,
WORLD_SIZE, LOCAL_RANK and MASTER_ADDR/PORT; `init_distributed` reads them and opens
one process group (nccl on GPUs, gloo on CPU, which is how CI tests this path).
Here: the `World` of a process, collectives that are a no-op in one process
(all-reduce, gathers of per-row tensors, broadcast of an object, agreement on a flag),
each rank's share of a list, and how rank metrics and held-out results are pooled.
FSDP2 sharding lives in `covey.runtime.fsdp`; what makes W ranks compute one global
batch in `covey.training.global_batch`.
"""

from __future__ import annotations

import datetime
import os
import sys
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor, nn

# Metrics combined across ranks by sum or max; every other number is averaged.
SUMMED_METRICS = ("reward/errors", "reward/dropped", "reward/judge_unparsed", "groups/resampled", "eval/n",
                  "throughput/tokens_per_s")
MAXED_SUFFIXES = ("_max", "max_abs", "/len_max")
MAXED_PREFIXES = ("time/", "memory/")


@dataclass(frozen=True)
class World:
    """Where this process stands: rank among `size` processes, and the device it trains on."""
    rank: int = 0
    size: int = 1
    local_rank: int = 0
    device: str = "cpu"

    @property
    def is_main(self) -> bool:
        """Rank 0 alone logs, prints and writes files."""
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.size > 1


class DeviceError(ValueError):
    """A device was asked for that this machine does not have (a one-line user error, exit 2)."""


def resolve_device(setting: str, local_rank: int = 0) -> str:
    """train.device -> "cpu" | "cuda:LOCAL_RANK". auto: CUDA when torch sees a GPU, else the CPU."""
    if setting not in ("auto", "cpu", "cuda"):
        raise DeviceError(f"train.device={setting!r} is not one of: auto, cpu, cuda")
    if setting == "cpu" or (setting == "auto" and not torch.cuda.is_available()):
        return "cpu"
    if not torch.cuda.is_available():
        raise DeviceError("train.device=cuda, but torch sees no CUDA GPU (torch "
                          f"{torch.__version__}, CUDA build: {torch.version.cuda or 'none'}); use train.device=cpu")
    if local_rank >= torch.cuda.device_count():
        raise DeviceError(f"process LOCAL_RANK={local_rank} needs cuda:{local_rank}, but torch sees "
                          f"{torch.cuda.device_count()} GPU(s)")
    return f"cuda:{local_rank}"


def describe_device(device: str) -> str:
    """One line for the start of a run: the device, its name and its memory."""
    if not device.startswith("cuda"):
        return f"cpu ({torch.get_num_threads()} threads)"
    props = torch.cuda.get_device_properties(torch.device(device))
    return f"{device} ({props.name}, {props.total_memory / 2**30:.1f} GiB)"


def init_distributed(device_setting: str = "auto", timeout_s: float = 1800.0) -> World:
    """World of this process on its device (train.device); opens the process group when torchrun
    started several: nccl on GPUs, gloo on CPUs.

    `timeout_s` bounds every collective: a rank that dies makes the others raise
    instead of waiting forever.
    """
    size = int(os.environ.get("WORLD_SIZE", "1"))
    rank, local_rank = int(os.environ.get("RANK", "0")), int(os.environ.get("LOCAL_RANK", "0"))
    device = resolve_device(device_setting, local_rank)
    on_gpu = device.startswith("cuda")
    if on_gpu:
        torch.cuda.set_device(local_rank)
    if size > 1 and not dist.is_initialized():
        dist.init_process_group("nccl" if on_gpu else "gloo", rank=rank, world_size=size,
                                timeout=datetime.timedelta(seconds=timeout_s),
                                device_id=torch.device(device) if on_gpu else None)
    return World(rank=rank, size=size, local_rank=local_rank, device=device)


def close_distributed() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def world_size() -> int:
    """Processes in the default group (1 when torch.distributed is not initialised)."""
    return dist.get_world_size() if dist.is_initialized() else 1


def is_main_process() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


def barrier() -> None:
    if world_size() > 1:
        dist.barrier()


def _collective_device() -> torch.device:
    """nccl reduces CUDA tensors, gloo CPU tensors."""
    if dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


# --------------------------------------------------------------------------- data split


def rank_share(items: list, world: World) -> list:
    """This rank's contiguous share of a global list (prompt ids): rank r gets block r of W."""
    if len(items) % world.size:
        raise ValueError(f"{len(items)} prompts cannot be split evenly over {world.size} processes")
    per_rank = len(items) // world.size
    return items[world.rank * per_rank:(world.rank + 1) * per_rank]


def uneven_share(items: list, world: World) -> list:
    """Rank r's strided share of a list that need not divide evenly (held-out prompts)."""
    return items[world.rank::world.size]


# --------------------------------------------------------------------------- collectives


def all_reduce(tensor: Tensor, op=dist.ReduceOp.SUM) -> Tensor:
    """Reduced copy of `tensor` over all ranks (the tensor itself when not distributed)."""
    if world_size() == 1:
        return tensor
    work = tensor.detach().to(_collective_device(), copy=True)
    dist.all_reduce(work, op=op)
    return work.to(tensor.device)


def gather_rows(tensors: dict[str, Tensor | None]) -> dict[str, Tensor | None]:
    """Concatenate per-sequence tensors of all ranks in rank order; (n, L) ones right-padded with 0.

    A name that is None on this rank must be None on every rank.
    """
    if world_size() == 1:
        return dict(tensors)
    local = {k: (v.detach().cpu() if v is not None else None) for k, v in tensors.items()}
    everyone: list = [None] * world_size()
    dist.all_gather_object(everyone, local)
    out = {}
    for name, value in local.items():
        if value is None:
            out[name] = None
            continue
        parts = [part[name] for part in everyone]
        if value.dim() == 2:
            width = max(p.shape[1] for p in parts)
            parts = [nn.functional.pad(p, (0, width - p.shape[1])) for p in parts]
        out[name] = torch.cat(parts)
    return out


def reduce_metrics(metrics: dict) -> dict:
    """Combine each rank's step metrics: counts summed, maxima and timings maxed, the rest averaged."""
    size = world_size()
    if size == 1:
        return metrics
    keys = sorted(k for k, v in metrics.items() if isinstance(v, (int, float)))
    everyone: list = [None] * size
    dist.all_gather_object(everyone, {k: float(metrics[k]) for k in keys})
    out = dict(metrics)
    for key in keys:
        values = [part[key] for part in everyone if key in part]
        if key in SUMMED_METRICS:
            out[key] = sum(values)
        elif key.endswith(MAXED_SUFFIXES) or key.startswith(MAXED_PREFIXES):
            out[key] = max(values)
        else:
            out[key] = sum(values) / len(values)
    return out


def reduce_eval(result: dict) -> dict:
    """Held-out results evaluated on strided shares: rates weighted by each rank's eval/n."""
    if world_size() == 1:
        return result
    everyone: list = [None] * world_size()
    dist.all_gather_object(everyone, result)
    total = sum(part["eval/n"] for part in everyone)
    out = dict(result)
    for key, value in result.items():
        if key == "eval/n":
            out[key] = total
        elif key.startswith("eval/") and isinstance(value, (int, float)):
            out[key] = sum(part[key] * part["eval/n"] for part in everyone) / max(total, 1)
    return out


# --------------------------------------------------------------------------- rank 0 speaks, every rank agrees


class SilentLogger:
    """Stands in for MetricsLogger on ranks other than 0: every method does nothing."""

    def __getattr__(self, name):
        return lambda *args, **kwargs: None


def quiet_unless_main(world: World) -> None:
    """Rank 0 alone prints: the others' stdout goes to /dev/null (stderr, with errors, stays)."""
    if not world.is_main:
        sys.stdout = open(os.devnull, "w")


def broadcast_object(value):
    """Rank 0's value on every rank (e.g. a run name made from the clock)."""
    if world_size() == 1:
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def all_finite(loss: Tensor) -> bool:
    """True when the loss is finite on every rank: all skip the update together, or none does."""
    return on_all_ranks(bool(torch.isfinite(loss.detach()).all()))


def on_all_ranks(flag: bool) -> bool:
    """True when `flag` holds on every rank: a code path with collectives is taken by all or by none."""
    if world_size() == 1:
        return flag
    return bool(all_reduce(torch.tensor([float(flag)]), dist.ReduceOp.MIN)[0] > 0)
