"""Memory: peak GPU memory per phase of a step, batch sizes fitted to the GPU memory budget
(train.gpu_memory_gib; the figures are in covey/runtime/budget.py), and out-of-memory that halves
the micro-batch.

`torch.cuda.max_memory_allocated` counts tensors allocated by torch on the device, the
quantity that decides an out-of-memory error (the caching allocator's reserve is larger).
Each reading resets the peak, so a phase's figure is its own: memory/gpu_peak_mb/<phase>.

Out of memory: covey's losses are normalised over the whole optimizer step, so the micro-batch
size never changes a result. A log-prob pass or an optimizer step's gradient that runs out of
memory is therefore undone and redone at half the micro-batch (`halving_on_oom`), and sampling at
half the prompts per generate call; the size is kept for the rest of the run, logged
(memory/oom_retries, memory/micro_batch/<phase>) and checkpointed. Evaluation batches are not
halved yet.
"""

from __future__ import annotations

import gc
import sys
from typing import Callable, TypeVar

import torch
import torch.distributed as dist

from covey.runtime.budget import GiB, budget_bytes, row_bucket

T = TypeVar("T")

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


def gpu_allowed_bytes(device: str | torch.device) -> int:
    """Bytes this process may allocate on its GPU: the card's total times the share
    torch.cuda.set_per_process_memory_fraction left it (1 unless set)."""
    cuda = torch.device(device)
    fraction = torch.cuda.get_per_process_memory_fraction(cuda)
    return int(torch.cuda.get_device_properties(cuda).total_memory * fraction)


def gpu_budget(setting_gib: float, device: str | torch.device) -> int:
    """train.gpu_memory_gib in bytes on `device` (0: what this process may use less budget.HEADROOM)."""
    return budget_bytes(setting_gib, gpu_allowed_bytes(device))


def rows_that_fit(per_row: int, budget: float, least: int, most: int) -> int:
    """Sequences of `per_row` bytes each that fit in `budget` bytes, kept between `least` and `most`."""
    fit = int(max(0.0, budget) // max(1, per_row))
    return max(least, min(most, fit))


def prompts_that_fit(per_row: int, group_size: int, budget: float, most: int) -> int:
    """Prompts per generate call whose G samples each fit in `budget` bytes at `per_row` bytes a sample,
    rows counted as the static decoder holds them (a power of two, at least 8: covey/rollout/static_decode.py);
    between 1 and `most`."""
    for prompts in range(most, 1, -1):
        if row_bucket(prompts * group_size) * per_row <= budget:
            return prompts
    return 1


def pending_training_bytes(trained: list) -> int:
    """Bytes the first optimizer step will still allocate for (model, optimizer) pairs: the gradients
    not yet made and AdamW's two moments where the optimizer holds no state yet."""
    pending = 0
    for model, optimizer in trained:
        params = [p for p in model.parameters() if p.requires_grad]
        pending += sum(p.numel() * p.element_size() for p in params if p.grad is None)
        if not optimizer.state:
            pending += 2 * sum(p.numel() * p.element_size() for p in params)
    return pending


def budget_left(budget: int, trained: list, device: str | torch.device) -> int:
    """Bytes of `budget` not yet taken on `device`: less what torch holds now (weights, optimizer state, the
    sampler's cache, the rollout) and the gradients and state the first step will allocate; never more than
    the card has free (another process may hold some), torch's unused cached blocks counted as free."""
    cuda = torch.device(device)
    free, _ = torch.cuda.mem_get_info(cuda)
    allocated = torch.cuda.memory_allocated(cuda)
    cached = torch.cuda.memory_reserved(cuda) - allocated
    return min(budget - allocated, free + cached) - pending_training_bytes(trained)


def size_update_pass(sizes: "MicroBatchSizes", per_position: int, trained: list, positions: int, rows: int,
                     device: str, budget: int) -> None:
    """Before the first update on one GPU: its micro-batches take as many sequences (of `per_position` bytes
    at each of `positions`) as fit in what is left of the budget (train.gpu_memory_gib), between 1 and the
    sequences of one optimizer step; fewer, larger micro-batches launch fewer kernels, and the gradient does
    not change. Once per process, and never after an out-of-memory halved a size (a resumed run keeps its
    checkpointed sizes then). `trained`: (model, optimizer) pairs."""
    if budget <= 0 or sizes.oom_retries or sizes.update_sized:
        return
    sizes.update_sized = True
    configured, left = sizes.sizes["update"], budget_left(budget, trained, device)
    sizes.sizes["update"] = rows_that_fit(per_position * positions, left, 1, rows)
    if sizes.sizes["update"] != configured:  # the memory this takes is the user's to know (and to refuse)
        print(f"covey: update micro-batches of {sizes.sizes['update']} sequences (algo.micro_batch_size="
              f"{configured}), sized to the {left / GiB:.1f} GiB left of train.gpu_memory_gib="
              f"{budget / GiB:.1f} GiB")


# --------------------------------------------------------------------------- out of memory


class OutOfMemoryAtOneRow(RuntimeError):
    """A pass ran out of memory with one sequence per micro-batch: nothing left to halve."""


def is_out_of_memory(err: BaseException) -> bool:
    """torch's out-of-memory error (CUDA), or the CPU allocator's failure, which torch raises as a
    plain RuntimeError."""
    if isinstance(err, torch.OutOfMemoryError):
        return True
    return isinstance(err, RuntimeError) and "can't allocate memory" in str(err)


def release_cached_memory(device: str | torch.device) -> None:
    """Give the failed attempt's blocks back before the retry (on a GPU, torch's cache holds them)."""
    gc.collect()
    if on_gpu(device):
        torch.cuda.empty_cache()


class MicroBatchSizes:
    """The batch size of each phase that halves on out-of-memory (checkpointed with the run):
    prompts per generate call (`generate`), sequences per log-prob pass (`logprobs`) and per
    gradient micro-batch (`update`).

    Losses are normalised over the whole optimizer step, so a smaller micro-batch gives the same
    result (tests/algos); a halved size is kept for the rest of the run.
    """

    PHASES = ("generate", "logprobs", "update")

    def __init__(self, size: int, prompts_per_call: int | None = None):
        self.sizes = dict.fromkeys(self.PHASES, size)
        self.sizes["generate"] = prompts_per_call or size
        self.oom_retries = 0
        self.update_sized = False  # the update's size was fitted to the GPU's memory in this process (not saved)

    def halve(self, phase: str) -> int:
        self.sizes[phase] = max(1, self.sizes[phase] // 2)
        self.oom_retries += 1
        return self.sizes[phase]

    def metrics(self) -> dict:
        return {"memory/oom_retries": self.oom_retries,
                **{f"memory/micro_batch/{phase}": size for phase, size in self.sizes.items()}}

    def state_dict(self) -> dict:
        return {"sizes": dict(self.sizes), "oom_retries": self.oom_retries}

    def load_state_dict(self, state: dict) -> None:
        self.sizes.update(state["sizes"])
        self.oom_retries = int(state["oom_retries"])


def halving_on_oom(phase: str, sizes: MicroBatchSizes, attempt: Callable[[int], T], device: str | torch.device,
                   cleanup: Callable[[], None] | None = None) -> T:
    """attempt(micro_batch_size) at the phase's size; on out-of-memory, undo (`cleanup`), halve the
    size and try again. At one sequence per micro-batch the run ends with one line naming the
    phase, the sizes and the knobs left."""
    while True:
        size = sizes.sizes[phase]
        try:
            return attempt(size)
        except (RuntimeError, torch.OutOfMemoryError) as err:
            if not is_out_of_memory(err):
                raise
            if cleanup is not None:
                cleanup()
            release_cached_memory(device)
            if dist.is_initialized() and dist.get_world_size() > 1:  # one rank alone cannot change its passes
                raise OutOfMemoryAtOneRow(
                    f"out of memory in the {phase} phase at batch size {size} on one of the torchrun "
                    f"processes, which cannot halve alone (their collectives must match): restart with a "
                    f"smaller size (algo.micro_batch_size, rollout.prompts_per_step)") from None
            if size == 1:
                raise OutOfMemoryAtOneRow(
                    f"out of memory in the {phase} phase with one sequence per micro-batch (sizes now: "
                    + ", ".join(f"{p} {s}" for p, s in sizes.sizes.items())
                    + f"; {sizes.oom_retries} halvings so far): lower rollout.max_new_tokens, set "
                    "model.gradient_checkpointing=true or model.lora_rank; saved checkpoints are kept") from None
            print(f"covey: out of memory in the {phase} phase at micro-batch {size}: redone at "
                  f"{sizes.halve(phase)}", file=sys.stderr)
