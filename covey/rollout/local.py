"""The engines that generate with the policy module of this process: hf (`model.generate`) and fast."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from covey.rollout.fast import FastEngine
from covey.rollout.hf import HFEngine
from covey.rollout.precision import LowPrecisionEngine

LOCAL_ENGINES = {"hf": HFEngine, "fast": FastEngine}
SWITCHES = ("auto", "on", "off")


@dataclass(frozen=True)
class DecodeOptions:
    """How the fast engine decodes (rollout.static_cache, rollout.cuda_graphs, rollout.compile_decode)."""
    static_cache: str = "auto"
    cuda_graphs: str = "auto"
    compile_decode: bool = False
    persistent: bool = True  # keep buffers and graphs between calls (False for held-out evaluation)

    def resolve(self, device: torch.device | str) -> dict:
        """FastEngine keywords on `device`: auto = on for CUDA, off elsewhere (the CPU keeps its plain
        loop, which drops finished rows at once); cuda_graphs=on needs CUDA and a static cache."""
        for key, value in (("rollout.static_cache", self.static_cache), ("rollout.cuda_graphs", self.cuda_graphs)):
            if value not in SWITCHES:
                raise ValueError(f"{key}={value!r}: one of {', '.join(SWITCHES)}")
        cuda = torch.device(device).type == "cuda"
        static = self.static_cache == "on" or (self.static_cache == "auto" and cuda)
        graphs = self.cuda_graphs == "on" or (self.cuda_graphs == "auto" and cuda and static)
        if graphs and not cuda:
            raise ValueError(f"rollout.cuda_graphs=on captures CUDA graphs: the engine runs on {device}")
        if graphs and not static:
            raise ValueError("rollout.cuda_graphs=on replays steps on a static cache: "
                             "it needs rollout.static_cache=on or auto")
        return {"static_cache": static, "cuda_graphs": graphs, "compile_decode": self.compile_decode and static,
                "persistent": self.persistent}


def local_engine(name: str, model, tokenizer, *, max_new_tokens: int, temperature: float = 1.0,
                 top_p: float = 1.0, top_k: int = 0, precision: str = "float32",
                 decode: DecodeOptions | None = None):
    """rollout.engine=hf | fast. In the policy's own precision the engine shares the policy module (no
    weight sync); with a lower `precision` (bfloat16) it samples from a copy that sync_weights refreshes.
    `decode`: the fast engine's static cache and CUDA graphs (default: auto, on for CUDA)."""
    if name not in LOCAL_ENGINES:
        raise ValueError(f"no local generation engine {name!r}; one of: {', '.join(LOCAL_ENGINES)}")
    kwargs = dict(max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, top_k=top_k)
    if name == "fast":
        kwargs.update((decode or DecodeOptions()).resolve(next(model.parameters()).device))
    dtype = getattr(torch, precision)
    if dtype != next(model.parameters()).dtype:
        return LowPrecisionEngine(LOCAL_ENGINES[name], model, tokenizer, dtype, **kwargs)
    return LOCAL_ENGINES[name](model, tokenizer, **kwargs)
