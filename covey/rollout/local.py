"""The engines that generate with the policy module of this process: hf (`model.generate`) and fast."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from covey.rollout.fast import FastEngine
from covey.rollout.hf import HFEngine
from covey.rollout.precision import LowPrecisionEngine

LOCAL_ENGINES = {"hf": HFEngine, "fast": FastEngine}
DECODE_MODES = ("auto", "plain", "static", "graphs", "compile")


@dataclass(frozen=True)
class DecodeOptions:
    """How the fast engine decodes (rollout.decode): plain (its own loop, finished rows dropped at once),
    static (a KV cache allocated once, rows in buckets: covey/rollout/static_decode.py), graphs (static,
    each step a CUDA graph replay), compile (graphs of torch.compile's kernels; on a CPU compiled, no
    graphs); auto = graphs on CUDA, plain elsewhere."""
    mode: str = "auto"
    persistent: bool = True  # keep buffers and graphs between calls (False for held-out evaluation)
    slots: int = 0
    """rollout.slots: rows through this many slots, refilled as rows end (covey/rollout/slots.py); 0: all at once."""
    speculate: int = 0
    """rollout.speculate: draft tokens per row, verified in the slot loop (covey/rollout/speculate.py); 0: off."""

    def resolve(self, device: torch.device | str) -> dict:
        """FastEngine keywords on `device`."""
        if self.mode not in DECODE_MODES:
            raise ValueError(f"rollout.decode={self.mode!r}: one of {', '.join(DECODE_MODES)}")
        cuda = torch.device(device).type == "cuda"
        if self.mode == "graphs" and not cuda:
            raise ValueError(f"rollout.decode=graphs captures CUDA graphs: the engine runs on {device}")
        loop = self.slots or self.speculate
        mode = ("graphs" if cuda and not loop else "plain") if self.mode == "auto" else self.mode
        return {"static_cache": mode != "plain", "cuda_graphs": mode == "graphs" or (mode == "compile" and cuda),
                "compile_decode": mode == "compile", "persistent": self.persistent, "slots": self.slots,
                "speculate": self.speculate}


def local_engine(name: str, model, tokenizer, *, precision: str = "float32", decode: DecodeOptions | None = None,
                 **sampling):
    """rollout.engine=hf | fast. In the policy's own precision the engine shares the policy module (no
    weight sync); with a lower `precision` (bfloat16) it samples from a copy that sync_weights refreshes.
    `decode`: the fast engine's decode loop (default: auto, graphs on CUDA); `sampling`: the engine's
    max_new_tokens (required), temperature, top_p and top_k."""
    if name not in LOCAL_ENGINES:
        raise ValueError(f"no local generation engine {name!r}; one of: {', '.join(LOCAL_ENGINES)}")
    kwargs = dict(sampling)
    if name == "fast":
        kwargs.update((decode or DecodeOptions()).resolve(next(model.parameters()).device))
    dtype = getattr(torch, precision)
    weights = next(model.parameters()).dtype
    # A copy only below the weights' precision: bf16 weights (model.dtype=bfloat16) are sampled from themselves.
    if dtype != weights and dtype.itemsize < weights.itemsize:
        return LowPrecisionEngine(LOCAL_ENGINES[name], model, tokenizer, dtype, **kwargs)
    return LOCAL_ENGINES[name](model, tokenizer, **kwargs)
