"""Memory-lean functions of (N, L, V) logits: chosen-token log-probs, entropy, exact KL.

Each runs over chunks of ``chunk_size`` rows (positions), upcasting one chunk at a
time to float32, and has a hand-written backward that recomputes the softmax of
one chunk at a time. No (N, L, V) log-softmax or probability tensor is ever held:
the only full-size tensor in the backward is the gradient w.r.t. the logits.
Output is float32 (float64 for float64 logits). z = logits / temperature below.
"""

from __future__ import annotations

import torch
from torch import Tensor

DEFAULT_CHUNK = 256


def _chunks(rows: int, size: int):
    for start in range(0, rows, size):
        yield start, min(start + size, rows)


def _cdtype(x: Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _check(temperature: float, chunk_size: int) -> None:
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")


class _ChosenLogProb(torch.autograd.Function):
    """log softmax(z)[token] = z[token] - logsumexp(z); d/dz_j = [j == token] - p_j."""

    @staticmethod
    def forward(ctx, logits, tokens, temperature, chunk_size):
        flat, tok = logits.reshape(-1, logits.shape[-1]), tokens.reshape(-1, 1).long()
        out = torch.empty(flat.shape[0], dtype=_cdtype(logits), device=logits.device)
        lse = torch.empty_like(out)
        for s, e in _chunks(flat.shape[0], chunk_size):
            z = flat[s:e].to(out.dtype) / temperature
            lse[s:e] = torch.logsumexp(z, -1)
            out[s:e] = z.gather(-1, tok[s:e]).squeeze(-1) - lse[s:e]
        ctx.save_for_backward(logits, tok, lse)
        ctx.temperature, ctx.chunk_size = temperature, chunk_size
        return out.view(tokens.shape)

    @staticmethod
    def backward(ctx, grad_out):
        logits, tok, lse = ctx.saved_tensors
        flat = logits.reshape(-1, logits.shape[-1])
        grad = torch.empty_like(flat)
        g = grad_out.reshape(-1, 1).to(lse.dtype)
        for s, e in _chunks(flat.shape[0], ctx.chunk_size):
            p = torch.exp(flat[s:e].to(lse.dtype) / ctx.temperature - lse[s:e, None])
            gz = (-p * g[s:e]).scatter_add_(-1, tok[s:e], g[s:e])
            grad[s:e] = (gz / ctx.temperature).to(grad.dtype)
        return grad.view_as(logits), None, None, None


class _Entropy(torch.autograd.Function):
    """H = logsumexp(z) - sum_j p_j z_j; dH/dz_j = -p_j (z_j - sum_k p_k z_k)."""

    @staticmethod
    def forward(ctx, logits, temperature, chunk_size):
        flat = logits.reshape(-1, logits.shape[-1])
        lse = torch.empty(flat.shape[0], dtype=_cdtype(logits), device=logits.device)
        mean_z = torch.empty_like(lse)
        for s, e in _chunks(flat.shape[0], chunk_size):
            z = flat[s:e].to(lse.dtype) / temperature
            lse[s:e] = torch.logsumexp(z, -1)
            mean_z[s:e] = (torch.exp(z - lse[s:e, None]) * z).sum(-1)
        ctx.save_for_backward(logits, lse, mean_z)
        ctx.temperature, ctx.chunk_size = temperature, chunk_size
        return (lse - mean_z).view(logits.shape[:-1])

    @staticmethod
    def backward(ctx, grad_out):
        logits, lse, mean_z = ctx.saved_tensors
        flat = logits.reshape(-1, logits.shape[-1])
        grad = torch.empty_like(flat)
        g = grad_out.reshape(-1, 1).to(lse.dtype)
        for s, e in _chunks(flat.shape[0], ctx.chunk_size):
            z = flat[s:e].to(lse.dtype) / ctx.temperature
            p = torch.exp(z - lse[s:e, None])
            grad[s:e] = (-p * (z - mean_z[s:e, None]) * g[s:e] / ctx.temperature).to(grad.dtype)
        return grad.view_as(logits), None, None


class _FullKL(torch.autograd.Function):
    """KL(p || q) = sum_j p_j (log p_j - log q_j); dKL/dz_j = p_j (log p_j - log q_j - KL); dKL/dy_j = q_j - p_j."""

    @staticmethod
    def forward(ctx, logits, ref_logits, temperature, chunk_size):
        flat, rflat = logits.reshape(-1, logits.shape[-1]), ref_logits.reshape(-1, ref_logits.shape[-1])
        kl = torch.empty(flat.shape[0], dtype=_cdtype(logits), device=logits.device)
        for s, e in _chunks(flat.shape[0], chunk_size):
            lp = torch.log_softmax(flat[s:e].to(kl.dtype) / temperature, -1)
            lq = torch.log_softmax(rflat[s:e].to(kl.dtype) / temperature, -1)
            kl[s:e] = (lp.exp() * (lp - lq)).sum(-1)
        ctx.save_for_backward(logits, ref_logits, kl)
        ctx.temperature, ctx.chunk_size = temperature, chunk_size
        return kl.view(logits.shape[:-1])

    @staticmethod
    def backward(ctx, grad_out):
        logits, ref_logits, kl = ctx.saved_tensors
        need_z, need_y = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        flat, rflat = logits.reshape(-1, logits.shape[-1]), ref_logits.reshape(-1, ref_logits.shape[-1])
        gz = torch.empty_like(flat) if need_z else None
        gy = torch.empty_like(rflat) if need_y else None
        g = grad_out.reshape(-1, 1).to(kl.dtype)
        t = ctx.temperature
        for s, e in _chunks(flat.shape[0], ctx.chunk_size):
            lp = torch.log_softmax(flat[s:e].to(kl.dtype) / t, -1)
            lq = torch.log_softmax(rflat[s:e].to(kl.dtype) / t, -1)
            p = lp.exp()
            if need_z:
                gz[s:e] = (p * (lp - lq - kl[s:e, None]) * g[s:e] / t).to(gz.dtype)
            if need_y:
                gy[s:e] = ((lq.exp() - p) * g[s:e] / t).to(gy.dtype)
        return (gz.view_as(logits) if need_z else None, gy.view_as(ref_logits) if need_y else None, None, None)


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
        kl = torch.where(mask.bool() if mask.dtype != torch.bool else mask, kl, torch.zeros_like(kl))
    return kl
