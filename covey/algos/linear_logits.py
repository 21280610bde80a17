"""Log-probs and entropy straight from hidden states and the output layer, a block of positions at a time:
the (N, L, V) logits of a micro-batch never exist, only one block's (chunk_size, V).

The fused-linear idea of Liger's cross entropy (Hsu et al. 2024, arXiv:2410.10989) applied to per-token
log-probs and entropy, whose upstream gradient is only known in the backward pass. For a block of
positions, z = (h W^T + b) / T and the chosen-token log-prob and entropy are `logprobs_and_entropy`'s
(covey/algos/logits.py, the same formulas and the same float32 reading of bf16 logits). The backward
recomputes each block's logits and back-propagates through that one block:

    dL/dh_block = g_block W        dL/dW = sum over blocks of g_block^T h_block        dL/db = sum g_block

with g_block the gradient w.r.t. the block's logits. The output matrix product runs twice in the
forward-and-backward (once more than unfused); memory holds one block of logits instead of N x L.
Under autocast the backward recomputes in the forward's autocast precision.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from covey.algos.logits import DEFAULT_CHUNK, logprobs_and_entropy


def _autocast_dtype(device_type: str) -> torch.dtype | None:
    return torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else None


class _LinearLogProbEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, tokens, temperature, chunk_size, with_entropy):
        ctx.set_materialize_grads(False)
        h, tok = hidden.reshape(-1, hidden.shape[-1]), tokens.reshape(-1)
        out_dtype = torch.float64 if hidden.dtype == torch.float64 else torch.float32
        logp = torch.empty(tok.shape[0], dtype=out_dtype, device=hidden.device)
        entropy = torch.empty_like(logp) if with_entropy else logp.new_empty(0)
        for s in range(0, tok.shape[0], chunk_size):
            block_logp, block_entropy = logprobs_and_entropy(F.linear(h[s:s + chunk_size], weight, bias),
                                                             tok[s:s + chunk_size], temperature, chunk_size,
                                                             with_entropy=with_entropy)
            logp[s:s + chunk_size] = block_logp
            if with_entropy:
                entropy[s:s + chunk_size] = block_entropy
        ctx.save_for_backward(hidden, weight, bias, tokens)
        ctx.temperature, ctx.chunk_size, ctx.with_entropy = temperature, chunk_size, with_entropy
        ctx.autocast = _autocast_dtype(hidden.device.type)
        if not with_entropy:
            ctx.mark_non_differentiable(entropy)
            return logp.view(tokens.shape), entropy
        return logp.view(tokens.shape), entropy.view(tokens.shape)

    @staticmethod
    def backward(ctx, grad_logp, grad_entropy):
        hidden, weight, bias, tokens = ctx.saved_tensors
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        grad_entropy = grad_entropy if ctx.with_entropy else None
        if (grad_logp is None and grad_entropy is None) or not (need_h or need_w or need_b):
            return None, None, None, None, None, None, None
        h, tok, chunk = hidden.reshape(-1, hidden.shape[-1]), tokens.reshape(-1), ctx.chunk_size
        grad_h = torch.empty_like(h) if need_h else None
        w = weight.detach().requires_grad_(need_w)  # a leaf: autocast casts it once, its .grad sums the blocks
        b = bias.detach().requires_grad_(need_b) if bias is not None else None
        device = hidden.device.type
        with torch.enable_grad(), torch.autocast(device, dtype=ctx.autocast or torch.bfloat16,
                                                 enabled=ctx.autocast is not None):
            for s in range(0, tok.shape[0], chunk):
                hb = h[s:s + chunk].detach().requires_grad_(need_h)
                logp, entropy = logprobs_and_entropy(F.linear(hb, w, b), tok[s:s + chunk], ctx.temperature, chunk,
                                                     with_entropy=grad_entropy is not None)
                outs = [(logp, grad_logp), (entropy, grad_entropy)]
                outs = [(o, g.reshape(-1)[s:s + chunk].to(o.dtype)) for o, g in outs if g is not None]
                torch.autograd.backward([o for o, _ in outs], [g for _, g in outs])
                if need_h:
                    grad_h[s:s + chunk] = hb.grad
        return (grad_h.view(hidden.shape) if need_h else None, w.grad if need_w else None,
                b.grad if need_b else None, None, None, None, None)


def linear_logprobs_and_entropy(hidden: Tensor, weight: Tensor, bias: Tensor | None, tokens: Tensor,
                                temperature: float = 1.0, chunk_size: int = DEFAULT_CHUNK,
                                with_entropy: bool = True) -> tuple[Tensor, Tensor | None]:
    """(..., D) hidden states, (V, D) output weights, optional (V,) bias, (...) chosen tokens ->
    log softmax((h W^T + b) / temperature) of the chosen tokens and, optionally, the entropy (nats),
    both float32 of `tokens`' shape; equal to `logprobs_and_entropy(F.linear(hidden, weight, bias), ...)`.
    Gradients flow to hidden, weight and bias; `chunk_size` positions' logits exist at a time."""
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    if tokens.shape != hidden.shape[:-1]:
        raise ValueError(f"tokens {tuple(tokens.shape)} must match hidden {tuple(hidden.shape)} without D")
    logp, entropy = _LinearLogProbEntropy.apply(hidden, weight, bias, tokens, float(temperature), int(chunk_size),
                                                bool(with_entropy))
    return logp, entropy if with_entropy else None
