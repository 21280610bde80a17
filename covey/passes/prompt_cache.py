"""The distinct prompts of an optimizer step (or of a no-grad pass) encoded once for all its micro-batches.

The packed pass (covey/passes/logprobs.py) runs a micro-batch's responses on top of the KV cache
of its prompts. Encoding the prompts inside every micro-batch is a pass over a few dozen
tokens per micro-batch: its matrix products are too small to run fast, yet it has as many
operations as the packed pass, and it took about 0.4 s of a 3.6 s bf16 update (dev/LOG.md,
2026-11-25). Here all the prompts run in one pass. Each micro-batch reads its prompts'
slice of that cache, and of their last-position logits, through fresh leaf tensors, so its
backward stops there; the gradients reaching the leaves are summed, and one backward
through the prompt pass after the last micro-batch carries them into the weights. The
gradient is the same sum as before; only float rounding differs (the prompt pass runs at
another batch size), which tests/passes/test_prompt_cache.py checks in float64.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from covey.models.hf_compat import (
    cache_from,
    cache_of,
    cache_tensors,
    last_positions,
    position_ids,
    whole_cache,
    with_cache,
)


def run_prompts(model, prompt_ids: Tensor, prompt_mask: Tensor):
    """The prompt pass: (KV cache, (U, 1, V) logits at each prompt's last position) of left-padded prompts.

    The cache keeps every prompt position in every layer, a sliding-window layer's too (a model's own
    cache keeps only its last window - 1 there): the packed pass masks each layer to its window itself."""
    out = model(input_ids=prompt_ids, attention_mask=prompt_mask, position_ids=position_ids(prompt_mask),
                use_cache=True, logits_to_keep=last_positions(1, prompt_ids.shape[1], prompt_ids.device),
                **with_cache(whole_cache()))
    return cache_of(out), out.logits[:, -1:]


@dataclass
class PromptView:
    """One micro-batch's prompts: a KV cache of its distinct prompts and their last logits."""
    cache: object            # transformers Cache over the view's U distinct prompts, `width` columns
    head: Tensor             # (U, 1, V) logits at each prompt's last position
    prompt_mask: Tensor      # (U, width)
    inverse: Tensor          # (n,) which of the U prompts each micro-batch row continues
    leaves: list[Tensor] = field(default_factory=list)  # the tensors whose .grad goes back to the encoding
    prompts: Tensor | None = None  # (U,) their index among the encoded prompts


class EncodedPrompts:
    """One forward pass over distinct prompts; `view` hands micro-batches their part of it.

    Built under grad mode, it records the gradient every view's leaves receive
    (`collect`), and `backward` runs the prompt pass's backward once with their sum.
    """

    def __init__(self, model, prompt_ids: Tensor, prompt_mask: Tensor, autocast, attention):
        """`prompt_ids`/`prompt_mask` (U, P) are distinct and left-padded; `autocast` and `attention`
        are the contexts the passes run under (covey/passes/logprobs.py picks them)."""
        self.model, self.mask, self.width = model, prompt_mask, prompt_ids.shape[1]
        with autocast, attention:
            cache, last = run_prompts(model, prompt_ids, prompt_mask)
        self.tensors = [t for pair in cache_tensors(cache) for t in pair] + [last]
        self.differentiable = self.tensors[-1].requires_grad
        self.grads: list[Tensor | None] = [None] * len(self.tensors)
        self.pending: list[PromptView] = []  # views handed out since the last `collect`

    def view(self, prompts_of_rows: Tensor, width: int) -> PromptView:
        """The slice for a micro-batch whose rows continue `prompts_of_rows` (n,), trimmed to `width` columns."""
        prompts, inverse = torch.unique(prompts_of_rows, return_inverse=True)
        parts = [t[prompts][:, :, self.width - width:] for t in self.tensors[:-1]] + [self.tensors[-1][prompts]]
        if self.differentiable:
            parts = [t.detach().requires_grad_() for t in parts]
        pairs = list(zip(parts[:-1:2], parts[1:-1:2]))
        view = PromptView(cache_from(pairs), parts[-1], self.mask[prompts, self.width - width:], inverse,
                          parts if self.differentiable else [], prompts)
        if self.differentiable:
            self.pending.append(view)
        return view

    def collect(self) -> None:
        """Add the gradients that reached the leaves of the views handed out since the last call
        (call it after each micro-batch's backward)."""
        for view in self.pending:
            width = view.prompt_mask.shape[1]
            for i, leaf in enumerate(view.leaves):
                if leaf.grad is None:
                    continue
                if self.grads[i] is None:
                    self.grads[i] = torch.zeros_like(self.tensors[i])
                target = self.grads[i]
                if i < len(self.tensors) - 1:  # keys/values: the view holds the last `width` columns
                    target = target[:, :, self.width - width:]
                target.index_add_(0, view.prompts, leaf.grad)
        self.pending = []

    def backward(self) -> None:
        """One backward through the prompt pass with the summed gradients of every view."""
        pairs = [(t, g) for t, g in zip(self.tensors, self.grads) if g is not None]
        if pairs:
            torch.autograd.backward([t for t, _ in pairs], [g for _, g in pairs])
        self.tensors, self.grads, self.pending = [], [], []
