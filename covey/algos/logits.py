"""Memory-lean functions of (N, L, V) logits: chosen-token log-probs, entropy, exact KL.

Each runs over blocks of at most ``chunk_size`` positions, upcasting one block at a
time to float32, and has a hand-written backward that recomputes the softmax of
one block at a time. No (N, L, V) log-softmax or probability tensor is ever held,
and a non-contiguous view such as ``logits[:, :-1]`` is walked sequence by sequence
instead of being copied: the only full-size tensor created is the gradient w.r.t.
the logits. Output is float32 (float64 for float64 logits). z = logits / temperature.
"""

from __future__ import annotations

import torch
from torch import Tensor

DEFAULT_CHUNK = 256


def _blocks(x: Tensor, chunk: int):
    """Yield (start, end, block): block is a (rows, V) view of positions start..end-1 (row-major) of x (..., V)."""
    v = x.shape[-1]
    try:
        flat = x.view(-1, v)
    except RuntimeError:           # not viewable as (rows, V) without a copy: walk the leading dimension
        flat = None
    if flat is not None:
        for s in range(0, flat.shape[0], chunk):
            yield s, min(s + chunk, flat.shape[0]), flat[s:s + chunk]
        return
    seqs = x if x.dim() == 3 else x.reshape(-1, *x.shape[-2:])
    rows = seqs.shape[1]
    for i, seq in enumerate(seqs):
        for s in range(0, rows, chunk):
            e = min(s + chunk, rows)
            yield i * rows + s, i * rows + e, seq[s:e]


def _cdtype(x: Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _new(x: Tensor, rows: int) -> Tensor:
    return torch.empty(rows, dtype=_cdtype(x), device=x.device)


def _positions(x: Tensor) -> int:
    return x.numel() // x.shape[-1] if x.shape[-1] else 0


def _check(temperature: float, chunk_size: int) -> None:
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")


class _ChosenLogProb(torch.autograd.Function):
    """log softmax(z)[token] = z[token] - logsumexp(z); d/dz_j = [j == token] - p_j."""

    @staticmethod
    def forward(ctx, logits, tokens, temperature, chunk_size):
        tok = tokens.reshape(-1, 1).long()
        out = _new(logits, tok.shape[0])
        lse = torch.empty_like(out)
        for s, e, block in _blocks(logits, chunk_size):
            z = block.to(out.dtype) / temperature
            lse[s:e] = torch.logsumexp(z, -1)
            out[s:e] = z.gather(-1, tok[s:e]).squeeze(-1) - lse[s:e]
        ctx.save_for_backward(logits, tok, lse)
        ctx.temperature, ctx.chunk_size = temperature, chunk_size
        return out.view(tokens.shape)

    @staticmethod
    def backward(ctx, grad_out):
        logits, tok, lse = ctx.saved_tensors
        grad = torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)
        flat_grad = grad.view(-1, logits.shape[-1])
        g = grad_out.reshape(-1, 1).to(lse.dtype)
        for s, e, block in _blocks(logits, ctx.chunk_size):
            p = torch.exp(block.to(lse.dtype) / ctx.temperature - lse[s:e, None])
            gz = (-p * g[s:e]).scatter_add_(-1, tok[s:e], g[s:e])
            flat_grad[s:e] = gz / ctx.temperature
        return grad, None, None, None


class _Entropy(torch.autograd.Function):
    """H = logsumexp(z) - sum_j p_j z_j; dH/dz_j = -p_j (z_j - sum_k p_k z_k)."""

    @staticmethod
    def forward(ctx, logits, temperature, chunk_size):
        lse = _new(logits, _positions(logits))
        mean_z = torch.empty_like(lse)
        for s, e, block in _blocks(logits, chunk_size):
            z = block.to(lse.dtype) / temperature
            lse[s:e] = torch.logsumexp(z, -1)
            mean_z[s:e] = (torch.exp(z - lse[s:e, None]) * z).sum(-1)
        ctx.save_for_backward(logits, lse, mean_z)
        ctx.temperature, ctx.chunk_size = temperature, chunk_size
        return (lse - mean_z).view(logits.shape[:-1])

    @staticmethod
    def backward(ctx, grad_out):
        logits, lse, mean_z = ctx.saved_tensors
        grad = torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)
        flat_grad = grad.view(-1, logits.shape[-1])
        g = grad_out.reshape(-1, 1).to(lse.dtype)
        for s, e, block in _blocks(logits, ctx.chunk_size):
            z = block.to(lse.dtype) / ctx.temperature
            p = torch.exp(z - lse[s:e, None])
            flat_grad[s:e] = -p * (z - mean_z[s:e, None]) * g[s:e] / ctx.temperature
        return grad, None, None


def _log_softmaxes(block, ref_block, dtype, temperature):
    return (torch.log_softmax(block.to(dtype) / temperature, -1),
            torch.log_softmax(ref_block.to(dtype) / temperature, -1))


class _FullKL(torch.autograd.Function):
    """KL(p || q) = sum_j p_j (log p_j - log q_j); dKL/dz_j = p_j (log p_j - log q_j - KL); dKL/dy_j = q_j - p_j."""

    @staticmethod
    def forward(ctx, logits, ref_logits, temperature, chunk_size):
        kl = _new(logits, _positions(logits))
        for (s, e, block), (_, _, ref_block) in zip(_blocks(logits, chunk_size), _blocks(ref_logits, chunk_size)):
            lp, lq = _log_softmaxes(block, ref_block, kl.dtype, temperature)
            kl[s:e] = (lp.exp() * (lp - lq)).sum(-1)
        ctx.save_for_backward(logits, ref_logits, kl)
        ctx.temperature, ctx.chunk_size = temperature, chunk_size
        return kl.view(logits.shape[:-1])

    @staticmethod
    def backward(ctx, grad_out):
        logits, ref_logits, kl = ctx.saved_tensors
        need_z, need_y = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        gz = torch.empty(logits.shape, dtype=logits.dtype, device=logits.device) if need_z else None
        gy = torch.empty(ref_logits.shape, dtype=ref_logits.dtype, device=ref_logits.device) if need_y else None
        g = grad_out.reshape(-1, 1).to(kl.dtype)
        t, chunk = ctx.temperature, ctx.chunk_size
        for (s, e, block), (_, _, ref_block) in zip(_blocks(logits, chunk), _blocks(ref_logits, chunk)):
            lp, lq = _log_softmaxes(block, ref_block, kl.dtype, t)
            p = lp.exp()
            if need_z:
                gz.view(-1, logits.shape[-1])[s:e] = p * (lp - lq - kl[s:e, None]) * g[s:e] / t
            if need_y:
                gy.view(-1, ref_logits.shape[-1])[s:e] = (lq.exp() - p) * g[s:e] / t
        return gz, gy, None, None


def selective_log_softmax(logits: Tensor, tokens: Tensor, temperature: float = 1.0,
                          chunk_size: int = DEFAULT_CHUNK) -> Tensor:
    """(N, L, V), (N, L) -> (N, L) log softmax(logits / temperature) of the chosen tokens.

    Gradient flows to logits. tokens must be valid ids (pad masked positions with any valid id).
    """
    _check(temperature, chunk_size)
    if tokens.shape != logits.shape[:-1]:
        raise ValueError(f"tokens {tuple(tokens.shape)} must match logits {tuple(logits.shape)} without V")
    return _ChosenLogProb.apply(logits, tokens, float(temperature), int(chunk_size))


def entropy_from_logits(logits: Tensor, temperature: float = 1.0, chunk_size: int = DEFAULT_CHUNK) -> Tensor:
    """(N, L, V) -> (N, L) entropy of softmax(logits / temperature), in nats. Gradient flows."""
    _check(temperature, chunk_size)
    return _Entropy.apply(logits, float(temperature), int(chunk_size))


def full_kl(logits: Tensor, ref_logits: Tensor, mask: Tensor | None = None, chunk_size: int = DEFAULT_CHUNK,
            temperature: float = 1.0) -> Tensor:
    """(N, L, V) x2 -> (N, L) exact KL(pi_theta || pi_ref) per position over the whole vocabulary.

    Zero where mask is 0. Gradient flows to both logit tensors (when they require it).
    """
    _check(temperature, chunk_size)
    if logits.shape != ref_logits.shape:
        raise ValueError(f"logits {tuple(logits.shape)} and ref_logits {tuple(ref_logits.shape)} differ")
    kl = _FullKL.apply(logits, ref_logits, float(temperature), int(chunk_size))
    if mask is not None:
        kl = torch.where(mask if mask.dtype == torch.bool else mask != 0, kl, torch.zeros_like(kl))
    return kl
