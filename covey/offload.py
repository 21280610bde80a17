"""A frozen reference whose weights stay on disk between its passes (peak memory, docs/benchmark.md).

A reference that never changes (no refresh, no EMA, not a LoRA view, one process) holds
exactly the weights of the model files it was loaded from. Its parameters are then read
from those safetensors files when a forward needs them (a pre-hook) and released after the
step's reference pass (`release_weights`), so its 0.5 GB (135M in fp32) is not resident
during the update. Offloading is refused unless every parameter equals its file tensor bit
for bit, so the reference's outputs do not change.

The weights are read into ordinary heap tensors, not memory-mapped: the update's
activations, freed by then, leave that much heap that glibc keeps (covey/cpu.py), and the
reads land in it, while the pages of a mapped file count in the resident set on top of the
heap. Mapped, the reference pass was where a step's RSS peaked: +0.5 GB over the update
(LOG.md, 2026-11-25, sixteenth session). Reading the 0.5 GB from the page cache into the
kept heap takes 75 ms; mapping it and touching every page took 45 ms.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import torch
from torch import nn

# safetensors dtype names (https://github.com/huggingface/safetensors, format spec)
_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
           "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
           "BOOL": torch.bool}


def read_safetensors(path: Path, names) -> dict[str, torch.Tensor]:
    """The tensors `names` of a safetensors file, read (not mapped) into fresh tensors.

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
            out[name] = raw.view(_DTYPES[entry["dtype"]]).view(entry["shape"])
    return out


class _Offload:
    def __init__(self, module: nn.Module, files: list[Path]):
        self.files = files
        self.params = dict(module.named_parameters())  # tied weights appear once
        self.loaded = True

    def load(self) -> None:
        tensors = {}
        for file in self.files:
            tensors.update(read_safetensors(file, self.params))
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


def maybe_offload_reference(reference: nn.Module | None, cfg, world_size: int) -> bool:
    """model.offload_reference, where the reference is the unchanging start model of one process."""
    a = cfg.algo
    if (reference is None or not cfg.model.offload_reference or cfg.model.lora_rank or a.ref_refresh_every
            or a.ref_ema or world_size != 1):
        return False
    from covey.models import resolve_model_path
    return offload_reference(reference, resolve_model_path(cfg.model.path))
