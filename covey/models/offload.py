"""A frozen reference: weights on disk between its passes, and held in the precision they compute in.

A reference that never changes (no refresh, no EMA, not a LoRA view, one process) holds
exactly the weights of the model files it was loaded from. Its parameters are then read
from those safetensors files when a forward needs them (a pre-hook) and released after the
step's reference pass (`release_weights`), so its 0.5 GB (135M in fp32) is not resident
during the update. Offloading is refused unless every parameter equals its file tensor bit
for bit, so the reference's outputs do not change.

The weights are read into ordinary heap tensors, not memory-mapped: the update's
activations, freed by then, leave that much heap that glibc keeps (covey/runtime/cpu.py), and the
reads land in it, while the pages of a mapped file count in the resident set on top of the
heap. Mapped, the reference pass was where a step's RSS peaked: +0.5 GB over the update
(dev/LOG.md, 2026-11-25). Reading the 0.5 GB from the page cache into the
kept heap takes 75 ms; mapping it and touching every page took 45 ms.

Under bf16 autocast a frozen reference's Linear weights are held in bf16
(`hold_linear_weights_in`): autocast rounds an fp32 weight to bf16 at every call (135M
weights at each of the reference pass's five forwards, ~0.25 s a step on 2 cores) and uses a
bf16 one as it is, so the log-probs are the same bits and the weights half the memory.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import torch
from torch import nn

from covey.models.load import ModelOptions, resolve_model_path
from covey.runtime.precision import model_device, resolve_autocast

# safetensors dtype names (https://github.com/huggingface/safetensors, format spec)
_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
           "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
           "BOOL": torch.bool}


def read_safetensors(path: Path, names, dtypes: dict | None = None) -> dict[str, torch.Tensor]:
    """The tensors `names` of a safetensors file, read (not mapped) into fresh tensors.

    `dtypes`: name -> dtype to convert a tensor to as soon as it is read (one tensor's
    file-precision copy alive at a time).

    The format: an 8-byte little-endian header length, a JSON header giving each tensor's
    dtype, shape and byte range, then the data.
    """
    with open(path, "rb") as f:
        (header_len,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(header_len))
        out = {}
        for name in names:
            if name not in header:
                continue
            entry = header[name]
            if entry["dtype"] not in _DTYPES:
                raise OSError(f"{path}: {name}: dtype {entry['dtype']} is not one covey reads")
            begin, end = entry["data_offsets"]
            raw = torch.empty(end - begin, dtype=torch.uint8)
            f.seek(8 + header_len + begin)
            if f.readinto(raw.numpy()) != end - begin:
                raise OSError(f"{path}: {name}: file ends inside the tensor's data")
            tensor = raw.view(_DTYPES[entry["dtype"]]).view(entry["shape"])
            out[name] = tensor.to((dtypes or {}).get(name, tensor.dtype))
    return out


class _Offload:
    def __init__(self, module: nn.Module, files: list[Path]):
        self.files = files
        self.params = dict(module.named_parameters())  # tied weights appear once
        self.loaded = True

    def load(self) -> None:
        tensors, dtypes = {}, {name: param.dtype for name, param in self.params.items()}
        for file in self.files:
            tensors.update(read_safetensors(file, self.params, dtypes))
        for name, param in self.params.items():
            param.data = tensors[name]
        self.loaded = True

    def release(self) -> None:
        for param in self.params.values():
            param.data = torch.empty(0, dtype=param.dtype, device=param.device)
        self.loaded = False


def _matches_files(module: nn.Module, files: list[Path]) -> bool:
    """Every parameter has a file tensor of the same name, dtype, shape and values."""
    from safetensors import safe_open

    params = dict(module.named_parameters())
    found = 0
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                if name in params:
                    tensor = f.get_tensor(name)
                    if tensor.dtype != params[name].dtype or not torch.equal(tensor, params[name].detach()):
                        return False
                    found += 1
    return found == len(params)


def offload_reference(reference: nn.Module, folder: str | Path) -> bool:
    """Back `reference` by the safetensors files of `folder` when they hold exactly its weights."""
    files = sorted(Path(folder).glob("*.safetensors"))
    if not files or any(p.device.type != "cpu" for p in reference.parameters()):
        return False
    if not _matches_files(reference, files):
        return False
    state = _Offload(reference, files)
    reference._covey_offload = state
    reference.register_forward_pre_hook(lambda module, args: None if state.loaded else state.load())
    state.release()
    return True


def release_weights(model: nn.Module | None) -> None:
    """Drop an offloaded model's weights until its next forward; a no-op for any other model."""
    state = getattr(model, "_covey_offload", None)
    if state is not None and state.loaded:
        state.release()


def unchanging_reference(reference: nn.Module | None, model: ModelOptions, world_size: int, *,
                         reference_moves: bool) -> bool:
    """The reference is the start model of one process and stays it: no refresh, no EMA
    (`reference_moves`: algo.ref_refresh_every or algo.ref_ema), not a LoRA view."""
    return reference is not None and not model.lora_rank and not reference_moves and world_size == 1


def maybe_offload_reference(reference: nn.Module | None, model: ModelOptions, world_size: int, *,
                            reference_moves: bool) -> bool:
    """model.offload_reference, where the reference is the unchanging start model of one process on a CPU."""
    if not model.offload_reference or not unchanging_reference(reference, model, world_size,
                                                               reference_moves=reference_moves):
        return False
    if model_device(reference).type != "cpu":  # a GPU's copy stays resident: reading it back costs more than it saves
        return False
    return offload_reference(reference, resolve_model_path(model.path))


def hold_linear_weights_in(model: nn.Module, dtype: torch.dtype) -> int:
    """Convert, in place, every nn.Linear weight and bias that no other kind of module shares to `dtype`.

    A tied weight (SmolLM2's output layer is its input embedding) stays as it is: the
    embedding lookup reads it at full precision. Returns how many tensors were converted.
    """
    shared = {id(p) for m in model.modules() if not isinstance(m, nn.Linear) for p in m.parameters(recurse=False)}
    converted = 0
    for module in model.modules():
        if isinstance(module, nn.Linear):
            for param in module.parameters(recurse=False):
                if id(param) not in shared and param.dtype != dtype:
                    param.data = param.data.to(dtype)
                    converted += 1
    return converted


def maybe_hold_reference_in_bf16(reference: nn.Module | None, model: ModelOptions, world_size: int, *,
                                 reference_moves: bool) -> bool:
    """bf16 Linear weights for an unchanging reference of one process whose passes run under bf16 autocast.

    Not for a reference that is refreshed or mixed from the policy (its weights must stay
    exact copies), a LoRA view (its modules are the policy's), or FSDP shards.
    """
    if (not unchanging_reference(reference, model, world_size, reference_moves=reference_moves)
            or resolve_autocast(model.autocast, model_device(reference)) != "bfloat16"):
        return False
    return hold_linear_weights_in(reference, torch.bfloat16) > 0
