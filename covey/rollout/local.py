"""The engines that generate with the policy module of this process: hf (`model.generate`) and fast."""

from __future__ import annotations

from covey.rollout.fast import FastEngine
from covey.rollout.hf import HFEngine

LOCAL_ENGINES = {"hf": HFEngine, "fast": FastEngine}


def local_engine(name: str, model, tokenizer, *, max_new_tokens: int, temperature: float = 1.0,
                 top_p: float = 1.0, top_k: int = 0):
    """rollout.engine=hf | fast; both share the policy module, so no weight sync is needed."""
    if name not in LOCAL_ENGINES:
        raise ValueError(f"no local generation engine {name!r}; one of: {', '.join(LOCAL_ENGINES)}")
    return LOCAL_ENGINES[name](model, tokenizer, max_new_tokens=max_new_tokens, temperature=temperature,
                               top_p=top_p, top_k=top_k)
