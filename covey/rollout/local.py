"""The engines that generate with the policy module of this process: hf (`model.generate`) and fast."""

from __future__ import annotations

import torch

from covey.rollout.fast import FastEngine
from covey.rollout.hf import HFEngine
from covey.rollout.precision import LowPrecisionEngine

LOCAL_ENGINES = {"hf": HFEngine, "fast": FastEngine}


def local_engine(name: str, model, tokenizer, *, max_new_tokens: int, temperature: float = 1.0,
                 top_p: float = 1.0, top_k: int = 0, precision: str = "float32"):
    """rollout.engine=hf | fast. In the policy's own precision the engine shares the policy module (no
    weight sync); with a lower `precision` (bfloat16) it samples from a copy that sync_weights refreshes."""
    if name not in LOCAL_ENGINES:
        raise ValueError(f"no local generation engine {name!r}; one of: {', '.join(LOCAL_ENGINES)}")
    kwargs = dict(max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, top_k=top_k)
    dtype = getattr(torch, precision)
    if dtype != next(model.parameters()).dtype:
        return LowPrecisionEngine(LOCAL_ENGINES[name], model, tokenizer, dtype, **kwargs)
    return LOCAL_ENGINES[name](model, tokenizer, **kwargs)
