"""One decode step of a Llama model in plain tensor ops, for the fast engine's bf16 CPU sampling.

A step of `FastEngine` feeds one new token per row through the model. HF's forward does
that through ~30 modules of Python per layer, builds a 4-D mask from the 2-D one, and
copies each layer's keys and values three times over for grouped-query attention
(`repeat_kv`). On a 2-core CPU that overhead is about a fifth of a SmolLM2-135M step
at 32 rows (75 -> 60 ms, dev/LOG.md, 2026-11-25), and more as rows finish.

`lean_step` runs the same operations in the same order and precision as HF's eager Llama
forward: float32 RMSNorm, bf16 rotary tables, scores scaled then masked by adding the
dtype's minimum, float32 softmax cast back. The only change: the queries of one key/value
head are multiplied by its keys together, (T, d) x (d, G), instead of against G copies of
them. The logits are the model's own (tests compare them bit for bit), so `FastEngine`'s
tokens do not change. The norms, rotary tables and MLP are op-for-op copies of the modules
rather than calls to them: calling the modules gave the same bits but ran 71.5 -> 73.7 ms a
step at 32 rows (their per-call overhead); the bit-for-bit test catches a copy that drifts
from a future transformers release.

It is used only where the engine's attention is eager (a bf16 or fp16 model on a CPU,
covey/models/attention.py) and the model is a plain Llama (no biases, SiLU MLP, rotary
embeddings without dynamic updates); anything else takes HF's forward.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from covey.models.attention import fastest_attention, half_precision
from covey.models.families import family_of


def supports_lean_step(model) -> bool:
    """A plain `LlamaForCausalLM` (full attention in every layer: the step masks no window and keeps no
    recurrent state) whose decode steps run eager attention."""
    if type(model).__name__ != "LlamaForCausalLM":
        return False
    if set(family_of(model.config).layer_types) != {"full_attention"}:
        return False
    config = model.config
    # rotary tables from the module's inv_freq hold for every rope type fixed at load time;
    # only "default" is accepted (dynamic types rescale inv_freq as sequences grow)
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    device = next(model.parameters()).device
    return (config.hidden_act == "silu" and not config.attention_bias and not config.mlp_bias
            and getattr(config, "pretraining_tp", 1) == 1 and rope.get("rope_type", "default") == "default"
            and fastest_attention(model, half_precision(model), device) == "eager")


def rms_norm(norm, hidden: Tensor) -> Tensor:
    """LlamaRMSNorm's forward, op for op."""
    x = hidden.to(torch.float32)
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon)
    return norm.weight * x.to(hidden.dtype)


def rotary_tables(rotary, positions: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """(cos, sin) of shape (n, head_dim) for one position per row, as LlamaRotaryEmbedding makes them."""
    freqs = positions[:, None].float() * rotary.inv_freq.to(device=positions.device, dtype=torch.float)
    emb = torch.cat((freqs, freqs), dim=-1)
    return (emb.cos() * rotary.attention_scaling).to(dtype), (emb.sin() * rotary.attention_scaling).to(dtype)


def rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x * cos + rotate_half(x) * sin, with x (n, heads, d) and cos/sin (n, 1, d)."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


def project(attn, hidden: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """The new position's rotated queries and keys and its values, each (n, heads, d)."""
    n, d = hidden.shape[0], attn.head_dim
    q = F.linear(hidden, attn.q_proj.weight).view(n, -1, d)
    k = F.linear(hidden, attn.k_proj.weight).view(n, -1, d)
    v = F.linear(hidden, attn.v_proj.weight).view(n, -1, d)
    return rotate(q, cos, sin), rotate(k, cos, sin), v


def attention(layer, hidden: Tensor, cos: Tensor, sin: Tensor, cache_layer, additive_mask: Tensor) -> Tensor:
    """Self-attention of one new position per row against the row's cached keys and values."""
    attn = layer.self_attn
    n, d = hidden.shape[0], attn.head_dim
    q, k, v = project(attn, hidden, cos, sin)
    keys, values = cache_layer.update(k.unsqueeze(2), v.unsqueeze(2))  # (n, kv_heads, T, d)
    groups = q.view(n, keys.shape[1], -1, d)  # the query heads that share each key/value head
    # keys x queries^T, transposed back: the product reads the cache's (T, d) slice in place,
    # where queries x keys^T copies it first (the attention core 333 -> 258 us a layer at 32 rows)
    scores = torch.matmul(keys, groups.transpose(2, 3)).transpose(2, 3).contiguous()
    scores = scores * attn.scaling + additive_mask
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return F.linear(torch.matmul(probs, values).reshape(n, -1), attn.o_proj.weight)


def mlp(layer, hidden: Tensor) -> Tensor:
    m = layer.mlp
    return F.linear(F.silu(F.linear(hidden, m.gate_proj.weight)) * F.linear(hidden, m.up_proj.weight),
                    m.down_proj.weight)


def lean_step(model, tokens: Tensor, positions: Tensor, key_mask: Tensor, cache, attend=attention) -> Tensor:
    """Logits (n, V) of the next token after `tokens` (n,) at `positions` (n,).

    `key_mask` (n, T): which of the T cached positions (this step's included) each row
    attends to; `cache`: the engine's buffer cache, which the step appends to; `attend`: the
    attention of a layer over it (`attention`, or covey/rollout/paged.py's over blocks).
    """
    body = model.model
    hidden = body.embed_tokens(tokens)
    cos, sin = rotary_tables(body.rotary_emb, positions, hidden.dtype)
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    additive_mask = torch.zeros(key_mask.shape, dtype=hidden.dtype, device=hidden.device)
    additive_mask = additive_mask.masked_fill(~key_mask.bool(), torch.finfo(hidden.dtype).min)[:, None, None, :]
    for layer, cache_layer in zip(body.layers, cache.layers, strict=True):
        hidden = hidden + attend(layer, rms_norm(layer.input_layernorm, hidden), cos, sin, cache_layer,
                                 additive_mask)
        hidden = hidden + mlp(layer, rms_norm(layer.post_attention_layernorm, hidden))
    return model.lm_head(rms_norm(body.norm, hidden))
