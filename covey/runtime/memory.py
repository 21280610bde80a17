"""Memory: peak GPU memory per phase of a step, no-grad passes sized to the free GPU memory, and
out-of-memory that halves the micro-batch.

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


def text_config(config):
    """The decoder's config (a multimodal model's text part), whose sizes the estimates below read."""
    return config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config


def rows_that_fit(per_position: int, positions: int, budget_bytes: float, least: int, most: int) -> int:
    """Sequences of `positions` positions at `per_position` bytes each that fit in `budget_bytes`,
    kept between `least` and `most`."""
    fit = int(max(0.0, budget_bytes) // max(1, per_position * positions))
    return max(least, min(most, fit))


def rows_per_no_grad_pass(config, positions: int, free_bytes: int, least: int, most: int,
                          share: float = 0.25) -> int:
    """Sequences per no-grad log-prob pass (old policy, reference, values) that fit in `share` of
    `free_bytes`, between `least` (algo.micro_batch_size) and `most` (the rollout's sequences).

    Without gradients nothing is kept from layer to layer, so a pass's peak is its logits (bf16,
    2 V bytes a position; covey/algos/logits.py reads them in bounded blocks) and one layer's
    activations: the MLP's gate, up and product (3 x 2 I bytes) and about eight hidden-size vectors
    in float32 and bf16 (16 H bytes), at every one of `positions` (prompt + response) per sequence.
    """
    config = text_config(config)
    per_position = 2 * config.vocab_size + 6 * config.intermediate_size + 16 * config.hidden_size
    return rows_that_fit(per_position, positions, share * free_bytes, least, most)


def rows_per_update_pass(config, positions: int, available_bytes: int, least: int, most: int,
                         element_bytes: int, share: float) -> int:
    """Sequences per gradient micro-batch of the update that fit in `share` of `available_bytes` (the
    free GPU memory less the gradients and optimizer state still to be allocated), between `least`
    (algo.micro_batch_size) and `most` (the sequences of one optimizer step).

    With gradients, every layer keeps what its backward reads, at each of `positions` per sequence
    (a Llama / Qwen2 decoder layer, HF's modules, activations of `element_bytes` each: 2 under bf16
    autocast, 4 in fp32):
      - the two RMSNorms, which work in float32: their input and normalised output, 2 x 2 x 4 H = 16 H bytes;
      - the inputs of the q, k, v, o, gate and up projections (autocast casts each, 3 H + H + 2 H)
        and queries plus attention output (2 H): 8 H elements;
      - keys and values for the attention backward: 2 x kv_heads x head_dim elements;
      - the MLP: the gate before SiLU, SiLU's output, up, and down's input: 4 I elements.
    The logits are read in bounded blocks (covey/algos/logits.py) and not counted. On one H100 the
    1.5B benchmark's update grew by 3.3 MB a position from 8 to 32 sequences; this gives 3.4.
    """
    config = text_config(config)
    hidden, inter = config.hidden_size, config.intermediate_size
    head_dim = getattr(config, "head_dim", None) or hidden // config.num_attention_heads
    kv = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    per_layer = 16 * hidden + element_bytes * (8 * hidden + 2 * kv * head_dim + 4 * inter)
    return rows_that_fit(config.num_hidden_layers * per_layer, positions, share * available_bytes, least, most)


def size_no_grad_passes(sizes: "MicroBatchSizes", config, positions: int, rows: int, device: str) -> None:
    """On one GPU the no-grad log-prob passes (old policy, reference, values) take as many sequences as
    fit in a quarter of the free memory, at least their configured size (algo.micro_batch_size):
    fewer, larger passes. Halved on out-of-memory like any phase. The caller decides where this
    applies (not under torchrun, where every rank keeps the configured size: their passes pair up)."""
    free, _ = torch.cuda.mem_get_info(torch.device(device))
    sizes.sizes["logprobs"] = rows_per_no_grad_pass(config, positions, free, sizes.sizes["logprobs"], rows)


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


def size_update_pass(sizes: "MicroBatchSizes", config, trained: list, positions: int, rows: int, device: str,
                     element_bytes: int, share: float) -> None:
    """Before the first update on one GPU: its micro-batches take as many sequences as fit in `share`
    (algo.update_memory_share) of the free GPU memory, less the gradients and optimizer state not yet
    allocated, at least algo.micro_batch_size; fewer, larger micro-batches launch fewer kernels, and
    the gradient does not change. Once per process, and never after an out-of-memory halved a size
    (a resumed run keeps its checkpointed sizes then). `trained`: (model, optimizer) pairs."""
    if share <= 0 or sizes.oom_retries or sizes.update_sized:
        return
    sizes.update_sized = True
    cuda = torch.device(device)
    free, _ = torch.cuda.mem_get_info(cuda)
    cached = torch.cuda.memory_reserved(cuda) - torch.cuda.memory_allocated(cuda)
    least = sizes.sizes["update"]
    sizes.sizes["update"] = rows_per_update_pass(config, positions, free + cached - pending_training_bytes(trained),
                                                 least, rows, element_bytes, share)
    if sizes.sizes["update"] > least:  # the memory this takes is the user's to know (and to refuse)
        print(f"covey: update micro-batches of {sizes.sizes['update']} sequences, sized to "
              f"algo.update_memory_share={share:g} of {free / 2**30:.1f} GiB free GPU memory "
              f"(algo.update_memory_share=0 keeps {least})")


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
