"""The routers of a mixture of experts: which modules they are, their logits during a pass, their loss weight.

transformers (5.x) names a model's router modules in its `_can_record_outputs["router_logits"]` (the
modules whose output `output_router_logits=True` collects). `router_modules` finds them from that entry;
`RouterTap` hooks them and the decoder, so a pass that covey's passes run (padded or packed) leaves,
per decoder forward, its inputs' attention mask and positions and every router's logits, without the
passes passing `output_router_logits` (whose own loss would read a packed pass's 4-D mask as a 2-D one).
What rows of those logits are which tokens is the trainer's business (covey/training/router_aux.py).

`router_aux_coef` resolves `model.router_aux_coef` against the model's config, read before the model
loads: unset, the model's own setting (its `router_aux_loss_coef` when its config turns
`output_router_logits` on, as transformers adds it to a training forward; else off); a positive value
for a model without experts is refused in one line.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

from torch import Tensor, nn

from covey.config import ConfigError
from covey.models.errors import ModelError
from covey.models.families import family_of, text_config
from covey.models.load import load_pretrained, resolve_model_path

EXPERT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts")
"""Config keys that count a mixture's experts (the ones covey.models.families reads)."""


def own_router_aux_coef(config) -> float:
    """The coefficient transformers' own training forward applies: router_aux_loss_coef when the config
    sets output_router_logits, else 0."""
    text = text_config(config)
    return float(getattr(text, "router_aux_loss_coef", 0.0) or 0.0) if getattr(text, "output_router_logits",
                                                                                False) else 0.0


def router_aux_coef(config, setting: float | None, model_path: str = "") -> float:
    """model.router_aux_coef resolved for a model of `config`: `setting`, or the model's own when None."""
    family = family_of(config)
    if setting is not None and setting > 0 and not family.moe:
        raise ConfigError(f"model.router_aux_coef={setting:g} weighs a router's load-balancing loss, but "
                          f"model.path={model_path or family.model_type} ({family.model_type}) has no experts: "
                          "leave it unset")
    if not family.moe:
        return 0.0
    return float(setting) if setting is not None else own_router_aux_coef(config)


def model_router_aux(spec: str, setting: float | None) -> tuple[float, str]:
    """(model.router_aux_coef resolved, a start-up line; '' for a model without experts) for the model
    `spec` (model.path), from its config alone: before any weight loads."""
    from transformers import AutoConfig

    config = load_pretrained(AutoConfig, resolve_model_path(spec))
    coef = router_aux_coef(config, setting, spec)
    if not family_of(config).moe:
        return coef, ""
    source = "model.router_aux_coef" if setting is not None else "the model config's own: model.router_aux_coef unset"
    return coef, f"router load-balancing loss {f'x {coef:g}' if coef else 'off'} ({source})"


def num_experts(config) -> int:
    """Experts per MoE layer of a transformers config (0 without experts or config)."""
    text = text_config(config) if config is not None else None
    return int(next((getattr(text, key) for key in EXPERT_KEYS if getattr(text, key, None)), 0) or 0)


def router_recorder(model: nn.Module):
    """transformers' OutputRecorder of the router logits of `model` (or of a module inside it), else None."""
    for module in model.modules():
        recorder = (getattr(module, "_can_record_outputs", None) or {}).get("router_logits")
        if recorder is not None:
            return recorder
    return None


def router_modules(model: nn.Module) -> list[tuple[nn.Module, int]]:
    """(module, output index) of every router, matched as transformers matches its OutputRecorder; a router
    wrapped by PEFT (a LoRA layer around it) is taken at its outermost wrapper, whose output holds the
    adapted logits."""
    recorder = router_recorder(model)
    if recorder is None:
        return []
    names = dict(model.named_modules())
    found = []
    for name, module in names.items():
        by_class = recorder.target_class is not None and isinstance(module, recorder.target_class)
        by_name = recorder.class_name is not None and name.endswith(recorder.class_name)
        layer = recorder.layer_name
        if not (by_class or by_name) or (layer and f".{layer.strip('.')}." not in f"{name}."):
            continue
        while "." in name and getattr(names[name.rsplit(".", 1)[0]], "base_layer", None) is names[name]:
            name = name.rsplit(".", 1)[0]  # the PEFT wrapper whose base_layer this is
        if all(names[name] is not other for other, _ in found):
            found.append((names[name], recorder.index))
    return found


def decoder_of(model: nn.Module) -> nn.Module:
    """The module that runs the decoder layers (a PEFT policy's base model's, an FSDP-wrapped one's)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return base.get_decoder() if hasattr(base, "get_decoder") else base


@dataclass
class RoutedForward:
    """One decoder forward while recording: its attention mask (2-D, 4-D, or one per layer kind), its
    position ids, and each router's (rows, E) logits in layer order."""
    attention_mask: object
    position_ids: Tensor | None
    logits: list[Tensor] = field(default_factory=list)


class RouterTap:
    """Forward hooks on the routers and the decoder of `model`; `recording()` collects `RoutedForward`s.

    Outside `recording` the hooks do nothing: no-grad passes, sampling and a gradient-checkpointing
    recomputation in the backward are not recorded. `close` removes the hooks.
    """

    def __init__(self, model: nn.Module):
        routers = router_modules(model)
        if not routers:
            raise ModelError(f"{type(model).__name__}: no router module found (its transformers class names "
                             "none in _can_record_outputs['router_logits']): model.router_aux_coef cannot apply")
        self.top_k = top_k_of(model, routers[0][0])
        self.forwards: list[RoutedForward] = []
        self.on = False
        self.handles = [decoder_of(model).register_forward_pre_hook(self._decoder_called, with_kwargs=True)]
        self.handles += [module.register_forward_hook(self._router_called(index)) for module, index in routers]

    def _decoder_called(self, module, args, kwargs):
        if self.on:
            self.forwards.append(RoutedForward(kwargs.get("attention_mask"), kwargs.get("position_ids")))

    def _router_called(self, index: int):
        def hook(module, args, output):
            if self.on and self.forwards:
                self.forwards[-1].logits.append(output[index] if isinstance(output, (tuple, list)) else output)
        return hook

    @contextlib.contextmanager
    def recording(self):
        """Within the block, every decoder forward is recorded into a fresh `self.forwards`."""
        self.forwards, self.on = [], True
        try:
            yield self.forwards
        finally:
            self.on = False

    def close(self) -> None:
        for handle in self.handles:
            handle.remove()


def top_k_of(model: nn.Module, router: nn.Module) -> int:
    """Experts per token: the router's own `top_k`, else the config's num_experts_per_tok."""
    inner = getattr(router, "base_layer", router)
    while hasattr(inner, "base_layer"):
        inner = inner.base_layer
    k = getattr(inner, "top_k", None) or getattr(text_config(model.config), "num_experts_per_tok", None)
    if not k:
        raise ModelError(f"{type(model).__name__}: experts per token unknown (no top_k, no num_experts_per_tok)")
    return int(k)
