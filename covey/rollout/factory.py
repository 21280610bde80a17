"""The engine factory: the sampling engine and the held-out evaluation engine a run's settings ask for.

hf and fast generate with the policy module of this process (fast from a bf16 copy where
rollout.precision resolves to it); vllm holds its own copy of the weights. Held-out evaluation
runs in the policy's own precision (what `covey eval` of the saved model measures): the
sampling engine itself, or, when that samples from a bf16 copy, a local engine on the policy
module (no second copy).
"""

from __future__ import annotations

from covey.config import ModelConfig, RolloutConfig
from covey.rollout.local import DecodeOptions, local_engine
from covey.rollout.precision import LowPrecisionEngine, resolve_precision
from covey.rollout.vllm import VLLMEngine


def sampling_precision(rollout: RolloutConfig, world_size: int, device: str, load_in_4bit: bool = False) -> str:
    """A local engine's sampling precision; under torchrun, and for a 4-bit (QLoRA) policy, the policy's own
    (no bf16 copy of a sharded policy nor of 4-bit weights is built: QLoRA samples through its own model)."""
    return resolve_precision(rollout.precision, device) if world_size == 1 and not load_in_4bit else "float32"


def decode_options(rollout: RolloutConfig, persistent: bool = True, load_in_4bit: bool = False) -> DecodeOptions:
    """The fast engine's static cache and CUDA graphs (rollout.decode); auto is plain for a 4-bit policy
    (bitsandbytes' kernels are not checked under CUDA graph capture)."""
    return DecodeOptions("plain" if load_in_4bit and rollout.decode == "auto" else rollout.decode, persistent)


def make_engine(rollout: RolloutConfig, model: ModelConfig, policy, tokenizer, *, world_size: int, device: str,
                seed: int):
    """The sampling engine of rollout.engine: vllm starts its own copy; hf / fast generate with `policy`."""
    if rollout.engine == "vllm":
        return VLLMEngine.from_config(rollout, model, policy, tokenizer, seed=seed)
    return local_engine(rollout.engine, policy, tokenizer, max_new_tokens=rollout.max_new_tokens,
                        temperature=rollout.temperature, top_p=rollout.top_p, top_k=rollout.top_k,
                        precision=sampling_precision(rollout, world_size, device, model.load_in_4bit),
                        decode=decode_options(rollout, load_in_4bit=model.load_in_4bit))


def make_eval_engine(rollout: RolloutConfig, policy, tokenizer, engine):
    """The held-out engine: None when the sampling engine serves (it samples from the policy's own
    weights), else a local engine on the policy module whose buffers and graphs are freed after each
    evaluation (it runs seldom and holds the fp32 policy's)."""
    inner = getattr(engine, "engine", engine)
    if not isinstance(inner, LowPrecisionEngine):
        return None
    return local_engine(rollout.engine, policy, tokenizer, max_new_tokens=rollout.max_new_tokens,
                        temperature=rollout.temperature, top_p=rollout.top_p, top_k=rollout.top_k,
                        decode=decode_options(rollout, persistent=False))
