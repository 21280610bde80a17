"""FSDP2 sharding (`fully_shard`) and whole-tensor views of sharded models, with no RL in them.

Under torchrun the policy, the critic and the reference are sharded block by block;
one process leaves every model as it is. Models are only unsharded (all-gathered) for
generation with a local engine, where ranks run different numbers of decoding steps and
so cannot take part in per-layer collectives. Checkpoints are written from, and resumed
into, full state dicts (`FullStateModel`, `FullStateOptimizer`).
"""

from __future__ import annotations

import contextlib

import torch
from torch import Tensor, nn

from covey.runtime.dist import world_size


def block_classes(model: nn.Module) -> set[str]:
    """Class names of the transformer blocks, from Hugging Face's `_no_split_modules`."""
    names: set[str] = set()
    for module in model.modules():
        names.update(getattr(module, "_no_split_modules", None) or ())
    return names


def shard_model(model: nn.Module | None, device: str) -> nn.Module | None:
    """Move to the training device; under torchrun, `fully_shard` each block and the root.

    Blocks are sharded one by one so only one block is all-gathered at a time; the
    root group holds the rest (embeddings, tied output layer, norms, value head).
    None, or a view without parameters of its own (the LoRA reference), is returned as is.
    """
    if model is None or next(model.parameters(), None) is None:
        return model
    model.to(device)
    if world_size() == 1:
        return model
    from torch.distributed.fsdp import fully_shard

    blocks = block_classes(model)
    for module in list(model.modules()):
        if type(module).__name__ in blocks:
            fully_shard(module)
    fully_shard(fsdp_root(model))
    return model


def fsdp_root(model: nn.Module) -> nn.Module:
    """The module every forward enters: a PEFT wrapper's base model (its `generate` calls that, not the wrapper)."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def fsdp_modules(model: nn.Module) -> list:
    """The FSDP-sharded modules of `model` (none without FSDP)."""
    from torch.distributed.fsdp import FSDPModule
    return [m for m in model.modules() if isinstance(m, FSDPModule)]


@contextlib.contextmanager
def unsharded(model: nn.Module):
    """Whole parameters on every rank for the duration (no collectives inside); re-entrant.

    HF generation runs as many forward passes as its longest sample needs, which
    differs between ranks; sharded layers would all-gather in each and deadlock.
    """
    modules, root = fsdp_modules(model), fsdp_root(model)
    depth = getattr(model, "_covey_unsharded", 0)
    if not modules or depth:  # nothing sharded, or an enclosing block already holds whole parameters
        model._covey_unsharded = depth + 1
        try:
            yield model
        finally:
            model._covey_unsharded = depth
        return
    with torch.inference_mode(False):  # FSDP's buffers must not become inference tensors
        for module in modules:
            module.unshard()
            module.set_reshard_after_forward(False, recurse=False)
    model._covey_unsharded = 1
    try:
        yield model
    finally:
        model._covey_unsharded = 0
        with torch.inference_mode(False):
            for module in modules:  # fully_shard's default: blocks reshard after forward, the root not
                module.set_reshard_after_forward(module is not root, recurse=False)
                module.reshard()


def full_options(strict: bool = True, cpu_offload: bool = True):
    """State-dict options of whole (unsharded) tensors."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions
    return StateDictOptions(full_state_dict=True, cpu_offload=cpu_offload, strict=strict)


def full_state_dict(model: nn.Module, on_every_rank: bool = False) -> dict[str, Tensor]:
    """Complete CPU state dict on rank 0 (empty on the others, unless `on_every_rank`); a collective under FSDP."""
    if not fsdp_modules(model):
        return model.state_dict()
    from torch.distributed.checkpoint.state_dict import get_model_state_dict
    state = get_model_state_dict(model, options=full_options(cpu_offload=not on_every_rank))
    return {k: v.cpu() for k, v in state.items()} if on_every_rank else state


class FullStateModel:
    """A sharded model seen through whole tensors, for checkpoint code written for one process.

    state_dict / save_pretrained use the full state gathered on rank 0; load_state_dict
    takes a full state (read by every rank) and keeps each rank's shard of it.
    """

    def __init__(self, model: nn.Module, full: dict | None):
        self.model, self.full = model, full

    def __getattr__(self, name):
        return getattr(self.model, name)

    def state_dict(self) -> dict:
        """The full state when gathered; when loading, the model's own (its keys are what loaders match)."""
        return self.full if self.full is not None else self.model.state_dict()

    def save_pretrained(self, folder, **kwargs):
        """HF folder; a tied weight (lm_head = embeddings) is stored once, as save_pretrained does."""
        own = {n for n, _ in self.model.named_parameters()} | {n for n, _ in self.model.named_buffers()}
        state = {k: v for k, v in self.full.items() if k in own}
        return self.model.save_pretrained(folder, state_dict=state, **kwargs)

    def load_state_dict(self, state: dict, strict: bool = True):
        from torch.distributed.checkpoint.state_dict import set_model_state_dict
        return set_model_state_dict(self.model, state, options=full_options(strict))


class FullStateOptimizer:
    """An optimizer over sharded parameters seen through full, name-keyed states (see FullStateModel)."""

    def __init__(self, model: nn.Module, optimizer, full: dict | None):
        self.model, self.optimizer, self.full = model, optimizer, full
        self.state = (full or {}).get("state", {})
        self.param_groups = (full or {}).get("param_groups", [])

    def state_dict(self) -> dict:
        return self.full

    def load_state_dict(self, state: dict) -> None:
        from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict
        set_optimizer_state_dict(self.model, self.optimizer, self.keyed_by_name(state), options=full_options())

    def keyed_by_name(self, state: dict) -> dict:
        """A one-process checkpoint keys parameters by position: rename them by parameter name."""
        if all(isinstance(k, str) for k in state["state"]):
            return state
        names = {id(p): n for n, p in self.model.named_parameters()}
        order = [names[id(p)] for group in self.optimizer.param_groups for p in group["params"]]
        groups = [{**g, "params": [order[i] for i in g["params"]]} for g in state["param_groups"]]
        return {"state": {order[i]: s for i, s in state["state"].items()}, "param_groups": groups}


def full_optimizer_state(model: nn.Module, optimizer) -> dict:
    """The optimizer's whole, name-keyed state on rank 0 (a collective under FSDP)."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict
    return get_optimizer_state_dict(model, optimizer, options=full_options())


def plain_norm(norm: Tensor) -> Tensor:
    """clip_grad_norm_ returns a replicated DTensor under FSDP2: the plain tensor of its value."""
    return norm.full_tensor() if hasattr(norm, "full_tensor") else norm
