"""LoRA through PEFT: only low-rank adapters train; the reference is the same model with them off.

`add_adapters` wraps the policy with PEFT (`model.lora_rank > 0`); the base weights are
frozen, so the optimizer holds the adapters only. `frozen_reference` then returns a
`BaseModelView`: a module whose forward runs the policy inside PEFT's
`disable_adapter()`. It holds no parameters, so the KL anchor costs no memory and is
exactly the base model (the test compares its log-probs with the base model's).

Adapter dropout is fixed at 0: with dropout the first epoch's importance ratio would
not be 1 and the old / reference log-prob passes would not be reproducible.

Saved policies (checkpoints, `final/`) are PEFT adapter folders: `adapter_config.json`
names the base model; `load_adapted` (or PEFT's `AutoPeftModelForCausalLM`) loads them.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from covey.models.load import ModelError, load_policy, load_reference
from covey.models.routers import num_experts, router_modules


def _peft():
    try:
        import peft
    except ImportError:
        raise ModelError("model.lora_rank > 0 needs PEFT: pip install 'covey[lora]'") from None
    return peft


def target_modules(targets: str):
    """'all-linear' (PEFT: every linear layer but the output head) or a list of names."""
    names = [t.strip() for t in targets.split(",") if t.strip()]
    if not names:
        raise ModelError("model.lora_targets is empty: use all-linear or names such as q_proj,v_proj")
    return "all-linear" if names == ["all-linear"] else names


def expert_parameters(model: nn.Module) -> list[str]:
    """PEFT `target_parameters` for the weights of a mixture of experts that are no nn.Linear: every
    (experts, out, in) parameter (transformers 5 fuses each projection of the experts into one), and the
    weight of each router module that is no nn.Linear (covey/models/routers.py), by their last two name
    parts (experts.gate_up_proj, experts.down_proj, gate.weight ...); [] for a model without experts."""
    experts = num_experts(getattr(model, "config", None))
    if not experts:
        return []
    names = [".".join(name.split(".")[-2:]) for name, p in model.named_parameters()
             if p.ndim == 3 and p.shape[0] == experts]
    for router, _ in router_modules(model):
        if not isinstance(router, nn.Linear) and isinstance(getattr(router, "weight", None), nn.Parameter):
            module = next(name for name, m in model.named_modules() if m is router)
            names.append(f"{module.rsplit('.', 1)[-1]}.weight")
    return list(dict.fromkeys(names))


def lora_targets(model: nn.Module, targets: str) -> tuple[str | list[str], list[str]]:
    """(target_modules, target_parameters) of `model.lora_targets`: all-linear adds `expert_parameters`;
    a listed name that is no module's but ends a parameter's name is a target parameter."""
    named = target_modules(targets)
    if named == "all-linear":
        return named, expert_parameters(model)
    modules = [name for name, _ in model.named_modules()]
    params = [name for name, _ in model.named_parameters()]
    is_param = {name: not any(m == name or m.endswith(f".{name}") for m in modules)
                and any(p.endswith(f".{name}") for p in params) for name in named}
    return [n for n in named if not is_param[n]], [n for n in named if is_param[n]]


def add_adapters(model: nn.Module, rank: int, alpha: int, targets: str = "all-linear") -> nn.Module:
    """The model with trainable LoRA adapters (B = 0 at start, so it still computes the base model).

    With experts, all-linear also adapts each expert's fused weights and the routers through PEFT's
    `target_parameters` (one A, B pair per expert: rank x experts rows); PEFT gives the fused
    gate_up_proj of a Qwen-MoE-style model rank 2r and alpha 2 alpha, as the two projections it fuses."""
    peft = _peft()
    modules, params = lora_targets(model, targets)
    config = peft.LoraConfig(r=rank, lora_alpha=alpha, lora_dropout=0.0, target_modules=modules,
                             target_parameters=params or None, task_type="CAUSAL_LM")
    try:
        return peft.get_peft_model(model, config)
    except ValueError as err:  # e.g. a target name that no module has
        raise ModelError(f"LoRA: {str(err).splitlines()[0]}") from None


def is_adapted(model: nn.Module) -> bool:
    """True for a PEFT-wrapped model (also once FSDP2 has wrapped it)."""
    peft = _peft() if hasattr(model, "peft_config") else None
    return peft is not None and isinstance(model, peft.PeftModel)


class BaseModelView(nn.Module):
    """The base model of a PEFT policy, read through the policy with its adapters disabled.

    The policy is kept outside the module tree (in a list), so this view has no
    parameters, buffers or state dict of its own: nothing is copied or saved twice.
    """

    def __init__(self, policy: nn.Module):
        super().__init__()
        self._policy = [policy]
        self.requires_grad_(False)

    @property
    def policy(self) -> nn.Module:
        return self._policy[0]

    @property
    def viewed_model(self) -> nn.Module:
        """The model whose modules this view runs (for checks that walk modules, e.g. checkpointing)."""
        return self.policy

    @property
    def config(self):
        return self.policy.config

    @property
    def device(self) -> torch.device:
        return next(self.policy.parameters()).device

    def forward(self, *args, **kwargs):
        with self.policy.disable_adapter():
            return self.policy(*args, **kwargs)


def frozen_reference(policy: nn.Module) -> nn.Module:
    """The KL anchor: the base model itself for a LoRA policy, else a frozen copy of the policy."""
    return BaseModelView(policy) if is_adapted(policy) else load_reference(policy)


def trainable_names(model: nn.Module) -> list[str]:
    return [name for name, p in model.named_parameters() if p.requires_grad]


def load_adapter_weights(model: nn.Module, folder: str | Path) -> None:
    """Load a saved adapter folder's weights into an adapted model (checkpoint resume)."""
    from safetensors.torch import load_file

    peft = _peft()
    path = Path(folder) / "adapter_model.safetensors"
    if not path.is_file():
        raise ModelError(f"{folder}: no adapter_model.safetensors (not a LoRA checkpoint)")
    result = peft.set_peft_model_state_dict(model, load_file(str(path)))
    if result.unexpected_keys:
        raise ModelError(f"{folder}: adapter weights do not match the model ({len(result.unexpected_keys)} unexpected)")


def load_adapted(folder: str | Path, dtype=torch.float32):
    """(model, tokenizer) from an adapter folder: its base model with the adapters loaded."""
    peft = _peft()
    config = json.loads((Path(folder) / "adapter_config.json").read_text())
    base, tokenizer = load_policy(config["base_model_name_or_path"], dtype=dtype)
    return peft.PeftModel.from_pretrained(base, str(folder)), tokenizer
