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

# 32 positions x 49152 vocabulary entries in float32 is 6 MiB: a block's several passes
# (max, exp, sums; in the backward exp, scale, scatter) then run from the L2/L3 caches instead
# of memory. On a 2-core Zen 4 the forward + backward over 1900 positions of SmolLM2's
# vocabulary took 189 ms with blocks of 256 and 130 ms with 32 (595 / 195 ms without covey's
# malloc settings); the results are bit-identical (tests/algos/test_logits.py).
DEFAULT_CHUNK = 32


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


def _scaled(block: Tensor, dtype: torch.dtype, temperature: float) -> Tensor:
    """A fresh float copy of block / temperature (callers work on it in place; no division at 1)."""
    z = block.to(dtype, copy=True)
    return z if temperature == 1.0 else z.div_(temperature)


class _LogProbEntropy(torch.autograd.Function):
    """Chosen-token log-prob and, optionally, entropy from one pass over each block.

    With t = z - max(z), s = sum_j exp(t_j) and p = exp(t) / s:
      log p[token] = t[token] - log s          d/dz_j = [j == token] - p_j
      H = log s - sum_j p_j t_j                dH/dz_j = -p_j (z_j - sum_k p_k z_k)
    Sharing t and exp(t) between the two saves a vocabulary-wide logsumexp pass; the
    backward recomputes p once per block and adds only the terms whose output is used.
    """

    @staticmethod
    def forward(ctx, logits, tokens, temperature, chunk_size, with_entropy):
        ctx.set_materialize_grads(False)  # an unused output's gradient arrives as None: its term is skipped
        tok = tokens.reshape(-1, 1).long()
        logp = _new(logits, tok.shape[0])
        lse = torch.empty_like(logp)
        mean_z = torch.empty_like(logp) if with_entropy else logp.new_empty(0)
        entropy = torch.empty_like(logp) if with_entropy else logp.new_empty(0)
        for s, e, block in _blocks(logits, chunk_size):
            t = _scaled(block, logp.dtype, temperature)
            top = t.amax(-1, keepdim=True)
            t.sub_(top)
            chosen = t.gather(-1, tok[s:e]).squeeze(-1)
            if with_entropy:
                exp_t = torch.exp(t)
                total = exp_t.sum(-1)
                mean_t = torch.linalg.vecdot(exp_t, t) / total
                entropy[s:e] = total.log() - mean_t
                mean_z[s:e] = top.squeeze(-1) + mean_t
            else:
                total = t.exp_().sum(-1)
            log_total = total.log()
            lse[s:e] = top.squeeze(-1) + log_total
            logp[s:e] = chosen - log_total
        ctx.save_for_backward(logits, tok, lse, mean_z)
        ctx.temperature, ctx.chunk_size = temperature, chunk_size
        if not with_entropy:
            ctx.mark_non_differentiable(entropy)  # an empty placeholder: autograd needs a tensor per output
            return logp.view(tokens.shape), entropy
        return logp.view(tokens.shape), entropy.view(tokens.shape)

    @staticmethod
    def backward(ctx, grad_logp, grad_entropy):
        logits, tok, lse, mean_z = ctx.saved_tensors
        g_lp = grad_logp.reshape(-1, 1).to(lse.dtype) if grad_logp is not None else None
        g_h = grad_entropy.reshape(-1, 1).to(lse.dtype) if grad_entropy is not None and mean_z.numel() else None
        if g_lp is None and g_h is None:
            return None, None, None, None, None
        grad = torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)
        flat_grad = grad.view(-1, logits.shape[-1])
        for s, e, block in _blocks(logits, ctx.chunk_size):
            p = _scaled(block, lse.dtype, ctx.temperature)
            if g_h is not None:
                coef = (p - mean_z[s:e, None]).mul_(g_h[s:e])        # g_H (z_j - E_p[z])
                if g_lp is not None:
                    coef.add_(g_lp[s:e])
            p.sub_(lse[s:e, None]).exp_()
            if g_h is not None:
                p.mul_(coef).neg_()
            else:
                p.mul_(-g_lp[s:e])
            if g_lp is not None:
                p.scatter_add_(-1, tok[s:e], g_lp[s:e])
            flat_grad[s:e] = p if ctx.temperature == 1.0 else p.div_(ctx.temperature)
        return grad, None, None, None, None


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
    return logprobs_and_entropy(logits, tokens, temperature, chunk_size, with_entropy=False)[0]


def entropy_from_logits(logits: Tensor, temperature: float = 1.0, chunk_size: int = DEFAULT_CHUNK) -> Tensor:
    """(N, L, V) -> (N, L) entropy of softmax(logits / temperature), in nats. Gradient flows."""
    tokens = torch.zeros(logits.shape[:-1], dtype=torch.long, device=logits.device)
    return logprobs_and_entropy(logits, tokens, temperature, chunk_size)[1]


def logprobs_and_entropy(logits: Tensor, tokens: Tensor, temperature: float = 1.0, chunk_size: int = DEFAULT_CHUNK,
                         with_entropy: bool = True) -> tuple[Tensor, Tensor | None]:
    """`selective_log_softmax` and `entropy_from_logits` in one pass over the vocabulary.

    Gradient flows to logits from both; entropy is None when not asked for.
    """
    _check(temperature, chunk_size)
    if tokens.shape != logits.shape[:-1]:
        raise ValueError(f"tokens {tuple(tokens.shape)} must match logits {tuple(logits.shape)} without V")
    logp, entropy = _LogProbEntropy.apply(logits, tokens, float(temperature), int(chunk_size), bool(with_entropy))
    return logp, entropy if with_entropy else None


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
