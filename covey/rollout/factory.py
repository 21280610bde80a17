"""The engine factory: the sampling engine and the held-out evaluation engine a run's settings ask for.

hf and fast generate with the policy module of this process (fast from a bf16 copy where
rollout.precision resolves to it); vllm holds its own copy of the weights, started here. Held-out
evaluation runs in the policy's own precision (what `covey eval` of the saved model measures): the
sampling engine itself, or, when that samples from a bf16 copy, a local engine on the policy
module (no second copy). `EngineOptions` is the plan's engine section (covey/training/plan_setup.py
builds it from rollout.*).
"""

from __future__ import annotations

from dataclasses import dataclass

from covey.models.load import ModelOptions, resolve_model_path
from covey.rollout.local import DecodeOptions, local_engine
from covey.rollout.precision import resolve_precision
from covey.rollout.vllm import VLLMEngine, lora_rank_for_vllm


@dataclass(frozen=True)
class EngineOptions:
    """How the run samples (rollout.*; each field is the key of its name): which engine, in which precision,
    with which decode loop and sampling settings, and vLLM's settings where rollout.engine=vllm."""
    engine: str
    """fast | hf | vllm."""
    precision: str
    """A local engine's sampling precision: auto | float32 | bfloat16."""
    decode: str
    """The fast engine's decode loop (covey.rollout.local.DecodeOptions)."""
    max_new_tokens: int
    temperature: float
    top_p: float
    top_k: int
    seed: int
    """train.seed: vLLM's seed (each rank adds its rank)."""
    vllm_gpu_memory_utilization: float
    vllm_sleep: bool
    vllm_max_model_len: int
    vllm_sync_bucket_mb: int
    vllm_sync_timeout_s: float
    slots: int = 0
    """The fast engine's slots (rollout.slots; 0: every row at once)."""
    speculate: int = 0
    """The fast engine's draft tokens per row (rollout.speculate; 0: off)."""


def sampling_precision(engine: EngineOptions, world_size: int, device: str, load_in_4bit: bool = False) -> str:
    """A local engine's sampling precision; under torchrun, and for a 4-bit (QLoRA) policy, the policy's own
    (no bf16 copy of a sharded policy nor of 4-bit weights is built: QLoRA samples through its own model)."""
    return resolve_precision(engine.precision, device) if world_size == 1 and not load_in_4bit else "float32"


def decode_options(engine: EngineOptions, persistent: bool = True, load_in_4bit: bool = False) -> DecodeOptions:
    """The fast engine's static cache and CUDA graphs (rollout.decode); auto is plain for a 4-bit policy
    (bitsandbytes' kernels are not checked under CUDA graph capture)."""
    return DecodeOptions("plain" if load_in_4bit and engine.decode == "auto" else engine.decode, persistent,
                         engine.slots, engine.speculate)


def make_engine(engine: EngineOptions, model: ModelOptions, policy, tokenizer, *, world_size: int, device: str):
    """The sampling engine of rollout.engine: vllm starts its own copy; hf / fast generate with `policy`."""
    if engine.engine == "vllm":
        return start_vllm(engine, model, policy, tokenizer)
    return local_engine(engine.engine, policy, tokenizer, max_new_tokens=engine.max_new_tokens,
                        temperature=engine.temperature, top_p=engine.top_p, top_k=engine.top_k,
                        precision=sampling_precision(engine, world_size, device, model.load_in_4bit),
                        decode=decode_options(engine, load_in_4bit=model.load_in_4bit))


def make_eval_engine(engine_options: EngineOptions, policy, tokenizer, engine):
    """The held-out engine: None when the sampling engine serves (it samples from the policy's own
    weights), else a local engine on the policy module whose buffers and graphs are freed after each
    evaluation (it runs seldom and holds the fp32 policy's)."""
    if not engine.samples_a_copy:
        return None
    e = engine_options
    return local_engine(e.engine, policy, tokenizer, max_new_tokens=e.max_new_tokens, temperature=e.temperature,
                        top_p=e.top_p, top_k=e.top_k, decode=decode_options(e, persistent=False))


def start_vllm(engine: EngineOptions, model: ModelOptions, policy, tokenizer) -> VLLMEngine:
    """Start vLLM on this process's GPU with the policy's initial weights (read from its folder)."""
    try:
        from vllm import LLM
    except ImportError:
        raise RuntimeError("rollout.engine=vllm needs vLLM on a CUDA machine: pip install 'covey[vllm]'") from None
    import torch.distributed as dist

    e, m = engine, model
    rank = dist.get_rank() if dist.is_initialized() else 0
    kwargs = dict(model=resolve_model_path(m.path), dtype=m.dtype, tensor_parallel_size=1,
                  gpu_memory_utilization=e.vllm_gpu_memory_utilization, enable_sleep_mode=e.vllm_sleep,
                  max_model_len=e.vllm_max_model_len or None, seed=e.seed + rank, logprobs_mode="processed_logprobs")
    if dist.is_initialized() and dist.get_world_size() > 1:
        kwargs["distributed_executor_backend"] = "external_launcher"  # joins torchrun's processes
    if m.lora_rank:
        kwargs.update(enable_lora=True, max_lora_rank=lora_rank_for_vllm(m.lora_rank))
    return VLLMEngine(LLM(**kwargs), policy, tokenizer, max_new_tokens=e.max_new_tokens, temperature=e.temperature,
                      top_p=e.top_p, top_k=e.top_k, sleep=e.vllm_sleep, bucket_mb=e.vllm_sync_bucket_mb,
                      timeout_s=e.vllm_sync_timeout_s, lora=bool(m.lora_rank))
