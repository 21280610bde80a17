"""The router's load-balancing loss in the policy update (`model.router_aux_coef`): its tokens and weight.

Each micro-batch's policy pass runs inside `RouterAux.recording()` (covey/models/routers.py hooks the
routers), and `term` turns what the routers saw into

    coef * step_share(T_m, T) * aux_m        (covey/algos/router.py)

added to the micro-batch's loss before its backward; `loss/router_aux` logs aux_m, token-weighted.

Tokens: the response positions whose outputs score the next response token, i.e. every attended
response token of a row but its last (`routed_tokens`). These are the positions both training passes
feed: the padded pass feeds the whole sequence (its prompt columns and each row's last token are left
out here), the packed pass feeds exactly these on top of the prompts' KV cache (its padding, at
position 0, left out). Prompt tokens are left out: a prompt's G samples share it, and the packed pass
encodes it once per step in a pass whose backward runs after the last micro-batch. So the loss covers
the same tokens whichever pass runs and however the step is split; T is the count over the optimizer
step's rows on every process.
"""

from __future__ import annotations

import contextlib
import dataclasses

import torch
from torch import Tensor

from covey import algos
from covey.batch import Rollout
from covey.models.routers import RoutedForward, RouterTap, model_router_aux
from covey.passes.logprobs import trim
from covey.runtime.dist import all_reduce, world_size
from covey.training.plan import Plan


def routed_tokens(attended: Tensor) -> Tensor:
    """(n, L) bool: the attended response positions but each row's last (those whose output scores a
    later response token)."""
    keep = attended.bool().clone()
    width = keep.shape[1]
    if width == 0:
        return keep
    last = width - 1 - keep.flip(1).int().argmax(dim=1)
    rows = keep.any(dim=1).nonzero().squeeze(1)
    keep[rows, last[rows]] = False
    return keep


def forward_rows(forward: RoutedForward, part: Rollout) -> Tensor | None:
    """Indices into a recorded forward's (rows, E) router logits of `part`'s routed tokens; None for a
    forward that carries none (a prompt pass)."""
    mask, positions = forward.attention_mask, forward.position_ids
    if isinstance(mask, dict) or (isinstance(mask, Tensor) and mask.dim() == 4):
        # the packed responses (a block mask, one per layer kind) on their prompts' cache; padding at position 0
        return None if positions is None else (positions.reshape(-1) > 0).nonzero().squeeze(1).cpu()
    ids, _, resp_len = trim(part)
    if not (isinstance(mask, Tensor) and mask.dim() == 2 and tuple(mask.shape) == tuple(ids.shape)):
        return None  # a pass over the prompts alone
    keep = torch.zeros(ids.shape, dtype=torch.bool)
    keep[:, -resp_len:] = routed_tokens(part.response_attended[:, :resp_len])
    return keep.reshape(-1).nonzero().squeeze(1)


class RouterAux:
    """One optimizer step's router loss: its coefficient, the step's routed tokens, the router hooks."""

    def __init__(self, tap: RouterTap, coef: float, step_tokens: int, num_processes: int = 1):
        self.tap, self.coef, self.step_tokens, self.num_processes = tap, coef, step_tokens, num_processes

    def recording(self):
        return self.tap.recording()

    def term(self, part: Rollout, avg) -> Tensor | None:
        """The micro-batch's weighted aux loss (None without routed tokens) from the forwards recorded for
        `part`; adds `loss/router_aux` (aux_m) to the MetricAverager `avg`, weighted by its tokens."""
        logits, count = [], 0
        for forward in self.tap.forwards:
            rows = forward_rows(forward, part)
            if rows is not None:
                logits += [layer.reshape(-1, layer.shape[-1])[rows.to(layer.device)] for layer in forward.logits]
                count += len(rows)
        expected = int(routed_tokens(part.response_attended).sum())
        if count != expected:  # the passes fed other tokens than covey/passes/logprobs.py documents
            raise RuntimeError(f"router loss: the training pass routed {count} response tokens, {expected} expected")
        if count == 0 or not logits:
            return None
        aux = algos.load_balancing_loss(logits, self.tap.top_k)
        avg.add({"loss/router_aux": float(aux.detach())}, float(count))
        return self.coef * algos.step_share(count, self.step_tokens, self.num_processes) * aux


@contextlib.contextmanager
def router_aux(policy, rollout: Rollout, batch: Tensor, coef: float | None):
    """A RouterAux for the optimizer step over `batch` (rows of `rollout`), its hooks removed on exit;
    None when `coef` is 0 or None (no router loss)."""
    if not coef:
        yield None
        return
    step = all_reduce(routed_tokens(rollout.response_attended[batch]).sum().float())
    tap = RouterTap(policy)
    try:
        yield RouterAux(tap, coef, int(step), world_size())
    finally:
        tap.close()


def with_router_aux(plan: Plan, path: str, setting: float | None) -> Plan:
    """The plan with model.router_aux_coef resolved from the config of the model at `path`, read before it
    loads (covey/models/routers.py: a weight for a model without experts is refused there); printed for a
    model with experts."""
    coef, line = model_router_aux(path, setting)
    if line:
        print(f"covey: {line}")
    return dataclasses.replace(plan, update=dataclasses.replace(plan.update, router_aux_coef=coef))
