"""One decode step over a preallocated (static) KV cache, in plain tensor ops: the step the fast engine
replays as a CUDA graph (rollout.decode; covey/rollout/static_decode.py).

A CUDA graph replays fixed kernels on fixed addresses, so every tensor a step reads or writes
lives in a buffer allocated once (`StaticState`): the keys and values of every layer for
`rows` sequences and `capacity` positions, an additive mask over those positions, each row's
next token and rotary position, and the column the step writes. The step writes its keys and
values at that column, unmasks it, attends over the first `length` columns (a bucket of
columns rounded up, so one graph serves many steps), and advances the position and the column
itself: replaying the graph again is the next step.

Operations and precision follow the model's eager forward (Llama and Qwen2: RMSNorm, rotary
embeddings from the module's own inverse frequencies, grouped-query attention, SwiGLU MLP) in
fewer kernels, about 13 a layer instead of the forward's 30-odd: RMSNorm is torch's fused kernel;
the rotation of queries and keys is one batched product with a per-row rotation matrix; the query
heads of a key/value head enter SDPA as that head's query positions (one attention kernel, the
keys read once, no copies per query head); the output and down projections add into the residual
inside the matrix product (`addmm`); and where the weights are frozen (the sampling copy) the
q/k/v and the gate/up projections are each one matrix (`fuse_linears`). Differences from the
model's forward are float rounding only (tests compare greedy tokens with `generate`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

STATIC_FAMILIES = ("LlamaForCausalLM", "Qwen2ForCausalLM")


def supports_static_decode(model) -> bool:
    """A plain Llama or Qwen2 (SiLU MLP without biases, default rotary embeddings, full attention in
    every layer) whose parameters are ordinary tensors (not FSDP shards, not a PEFT wrapper)."""
    if type(model).__name__ not in STATIC_FAMILIES:
        return False
    config = model.config
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    layer_types = getattr(config, "layer_types", None) or ["full_attention"]
    return (config.hidden_act == "silu" and not getattr(config, "mlp_bias", False)
            and getattr(config, "pretraining_tp", 1) == 1 and rope.get("rope_type", "default") == "default"
            and all(kind == "full_attention" for kind in layer_types)
            and all(type(p.data) is torch.Tensor for p in model.parameters()))


@dataclass
class LayerWeights:
    norm1: Tensor
    qkv: list[tuple[Tensor, Tensor | None]]      # one fused (weight, bias) or q, k, v apart
    out: tuple[Tensor, Tensor | None]
    norm2: Tensor
    gate_up: list[tuple[Tensor, Tensor | None]]  # one fused (weight, bias) or gate, up apart
    down: tuple[Tensor, Tensor | None]


@dataclass
class DecodeWeights:
    """The tensors a step reads, by reference to the model's own parameters."""
    embed: Tensor
    layers: list[LayerWeights]
    norm: Tensor
    head: Tensor
    inv_freq: Tensor
    rope_scale: float
    eps: float
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    scaling: float

    def signature(self) -> tuple[int, ...]:
        """Addresses of every tensor read: a captured graph is valid while they do not change."""
        tensors = [self.embed, self.norm, self.head, self.inv_freq]
        for layer in self.layers:
            tensors += [layer.norm1, layer.norm2, *layer.out, *layer.down]
            tensors += [t for pair in layer.qkv + layer.gate_up for t in pair]
        return tuple(t.data_ptr() if t is not None else 0 for t in tensors)


def fuse_linears(linears: list[nn.Linear], fused: dict, key) -> list[tuple[Tensor, Tensor | None]]:
    """One (weight, bias) whose rows are the linears' stacked, the linears' parameters re-pointed to
    views of it (so copying new weights into them updates it); `fused[key]` keeps it between calls.

    Refused (the linears returned apart) where their biases are mixed, or their dtypes or devices differ.
    """
    weights = [m.weight for m in linears]
    biases = [m.bias for m in linears]
    if (any(b is None for b in biases) and any(b is not None for b in biases)
            or len({(w.dtype, w.device) for w in weights}) > 1):
        return [(w, b) for w, b in zip(weights, biases)]
    held = fused.get(key)
    if held is None or not views_of(held[0], weights) or (held[1] is not None and not views_of(held[1], biases)):
        held = (torch.cat([w.detach() for w in weights]),
                torch.cat([b.detach() for b in biases]) if biases[0] is not None else None)
        repoint(held[0], weights)
        if held[1] is not None:
            repoint(held[1], biases)
        fused[key] = held
    return [held]


def views_of(whole: Tensor, parts: list[Tensor]) -> bool:
    """True where `parts` are, in order, consecutive row blocks of `whole`'s memory."""
    offset = whole.data_ptr()
    for part in parts:
        if part.data_ptr() != offset or not part.is_contiguous():
            return False
        offset += part.numel() * part.element_size()
    return offset == whole.data_ptr() + whole.numel() * whole.element_size()


def repoint(whole: Tensor, params: list[Tensor]) -> None:
    start = 0
    for param in params:
        param.data = whole[start:start + param.shape[0]]
        start += param.shape[0]


def gather_weights(model, fused: dict | None = None) -> DecodeWeights:
    """The model's tensors for `decode_step`; with `fused` (a frozen model), q/k/v and gate/up fused."""
    body, config = model.model, model.config
    layers = []
    for i, layer in enumerate(body.layers):
        attn, mlp = layer.self_attn, layer.mlp
        qkv = [attn.q_proj, attn.k_proj, attn.v_proj]
        gate_up = [mlp.gate_proj, mlp.up_proj]
        layers.append(LayerWeights(
            norm1=layer.input_layernorm.weight,
            qkv=fuse_linears(qkv, fused, (i, "qkv")) if fused is not None else [(m.weight, m.bias) for m in qkv],
            out=(attn.o_proj.weight, attn.o_proj.bias),
            norm2=layer.post_attention_layernorm.weight,
            gate_up=(fuse_linears(gate_up, fused, (i, "gate_up")) if fused is not None
                     else [(m.weight, m.bias) for m in gate_up]),
            down=(mlp.down_proj.weight, mlp.down_proj.bias)))
    attn = body.layers[0].self_attn
    return DecodeWeights(
        embed=body.embed_tokens.weight, layers=layers, norm=body.norm.weight, head=model.lm_head.weight,
        inv_freq=body.rotary_emb.inv_freq, rope_scale=float(body.rotary_emb.attention_scaling),
        eps=float(body.norm.variance_epsilon), heads=attn.q_proj.out_features // attn.head_dim,
        kv_heads=attn.k_proj.out_features // attn.head_dim, head_dim=attn.head_dim,
        intermediate=config.intermediate_size, scaling=float(attn.scaling))


class StaticState:
    """Every buffer a step reads or writes, for `rows` sequences and `capacity` positions."""

    def __init__(self, weights: DecodeWeights, rows: int, capacity: int, dtype: torch.dtype, device):
        kv, d = weights.kv_heads, weights.head_dim
        # zeros, not empty: a masked column's value is multiplied by a zero weight, and 0 * NaN is NaN
        self.keys = [torch.zeros(rows, kv, capacity, d, dtype=dtype, device=device) for _ in weights.layers]
        self.values = [torch.zeros(rows, kv, capacity, d, dtype=dtype, device=device) for _ in weights.layers]
        self.mask = torch.full((rows, capacity), torch.finfo(dtype).min, dtype=dtype, device=device)
        self.tokens = torch.zeros(rows, dtype=torch.long, device=device)
        self.positions = torch.zeros(rows, dtype=torch.long, device=device)
        self.column = torch.zeros(1, dtype=torch.long, device=device)
        # what sampling inside the step reads and writes, by column: each row's uniform for the token
        # whose logits the step makes, the tokens picked and their log-probs, and whether the row is still decoding
        self.draws = torch.zeros(rows, capacity, dtype=torch.float32, device=device)
        self.picked = torch.zeros(rows, capacity, dtype=torch.long, device=device)
        self.logp = torch.zeros(rows, capacity, dtype=torch.float32, device=device)  # the picked tokens' log-probs
        self.live = torch.zeros(rows, dtype=torch.bool, device=device)
        self.rows, self.capacity, self.dtype = rows, capacity, dtype

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.keys + self.values)

    def load_prompts(self, pairs: list[tuple[Tensor, Tensor]], index: Tensor, prompt_mask: Tensor,
                     first_tokens: Tensor, live: Tensor, draws: Tensor | None) -> None:
        """Rows 0..n-1 continue prompts `index` (n,): their keys/values `pairs` (U, kv, P, d) per layer
        in columns 0..P-1, their mask, first new tokens, whether they go on (`live`) and their uniforms
        `draws` (steps, n) for the tokens at columns P, P+1, ...; rows n.. are idle (they see column 0
        only, so stay finite, and are not live)."""
        n, width = len(index), prompt_mask.shape[1]
        for buf, (src, _) in zip(self.keys, pairs):
            buf[:n, :, :width] = src[index]
        for buf, (_, src) in zip(self.values, pairs):
            buf[:n, :, :width] = src[index]
        minimum = torch.finfo(self.dtype).min
        self.mask.fill_(minimum)
        self.mask[:n, :width] = torch.where(prompt_mask[index].bool(), 0.0, minimum).to(self.dtype)
        self.mask[n:, 0] = 0.0
        self.tokens.zero_()
        self.tokens[:n] = first_tokens
        self.positions.zero_()
        self.positions[:n] = prompt_mask[index].sum(-1)
        self.column.fill_(width)
        self.live.zero_()
        self.live[:n] = live
        if draws is not None:
            self.draws[:n, width:width + len(draws)] = draws.t()

    def take_rows(self, source: "StaticState", keep: Tensor) -> None:
        """Rows `keep` of `source` (a larger bucket) into rows 0..len(keep)-1 of this one."""
        m = len(keep)
        for dst, src in zip(self.keys + self.values, source.keys + source.values):
            dst[:m] = src[keep]
        self.mask.fill_(torch.finfo(self.dtype).min)
        self.mask[:m] = source.mask[keep]
        self.mask[m:, 0] = 0.0
        self.tokens.zero_()
        self.tokens[:m] = source.tokens[keep]
        self.positions.zero_()
        self.positions[:m] = source.positions[keep]
        self.column.copy_(source.column)
        self.live.zero_()
        self.live[:m] = source.live[keep]
        self.draws[:m] = source.draws[keep]
        self.picked[:m] = source.picked[keep]
        self.logp[:m] = source.logp[keep]


def linear(x: Tensor, pairs: list[tuple[Tensor, Tensor | None]]) -> Tensor:
    if len(pairs) == 1:
        return F.linear(x, *pairs[0])
    return torch.cat([F.linear(x, w, b) for w, b in pairs], dim=-1)


def add_linear(residual: Tensor, x: Tensor, pair: tuple[Tensor, Tensor | None]) -> Tensor:
    """residual + x W^T (+ b): the addition inside the matrix product."""
    weight, bias = pair
    out = torch.addmm(residual, x, weight.t())
    return out if bias is None else out.add_(bias)


def decode_step(w: DecodeWeights, s: StaticState, length: int) -> Tensor:
    """Logits (rows, V) after feeding `s.tokens` at `s.positions`; writes column `s.column` of the
    cache, attends over columns 0..length-1, then advances positions and column by one."""
    rows, d, kv = s.rows, w.head_dim, w.kv_heads
    x = F.embedding(s.tokens, w.embed)
    rotation = rotation_matrices(w, s.positions, x.dtype)
    s.mask.index_fill_(1, s.column, 0.0)  # the scalar goes to the kernel: no host copy inside a capture
    mask = s.mask.narrow(1, 0, length)[:, None, None, :]  # narrow, not a slice: no clamping to guard on
    for layer, keys, values in zip(w.layers, s.keys, s.values):
        qkv = linear(F.rms_norm(x, (x.shape[-1],), layer.norm1, w.eps), layer.qkv)
        qk = torch.bmm(qkv[:, :(w.heads + kv) * d].view(rows, w.heads + kv, d), rotation)
        keys[:, :, s.column] = qk[:, w.heads:].unsqueeze(2)  # index_put_: compiled into an in-place scatter
        values[:, :, s.column] = qkv[:, (w.heads + kv) * d:].view(rows, kv, 1, d)
        # the query heads of a key/value head as its query positions: one attention kernel, no copies of the keys
        attn = F.scaled_dot_product_attention(qk[:, :w.heads].view(rows, kv, w.heads // kv, d),
                                              keys.narrow(2, 0, length), values.narrow(2, 0, length),
                                              attn_mask=mask, scale=w.scaling)
        x = add_linear(x, attn.reshape(rows, w.heads * d), layer.out)
        gate_up = linear(F.rms_norm(x, (x.shape[-1],), layer.norm2, w.eps), layer.gate_up)
        x = add_linear(x, F.silu(gate_up[:, :w.intermediate]) * gate_up[:, w.intermediate:], layer.down)
    s.positions.add_(1)
    s.column.add_(1)
    return F.linear(F.rms_norm(x, (x.shape[-1],), w.norm, w.eps), w.head)


def rotation_matrices(w: DecodeWeights, positions: Tensor, dtype: torch.dtype) -> Tensor:
    """(rows, d, d) M with x @ M = x * cos + rotate_half(x) * sin: the rotary embedding of each row's
    position as one batched matrix product per layer (for queries and keys together) instead of four
    elementwise kernels. rotate_half(x)_j is -x_(j+d/2) for j < d/2 and x_(j-d/2) above, so M holds cos
    on its diagonal and -sin, sin on the diagonals d/2 below and above it."""
    cos, sin = rotary_tables_scaled(w, positions, dtype)
    half = w.head_dim // 2
    return (torch.diag_embed(cos) + torch.diag_embed(-sin[:, :half], offset=-half)
            + torch.diag_embed(sin[:, half:], offset=half))


def rotary_tables_scaled(w: DecodeWeights, positions: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """(cos, sin) (rows, d) as the model's rotary module makes them: float32 angles, scaled, then cast."""
    freqs = positions[:, None].float() * w.inv_freq.float()
    emb = torch.cat((freqs, freqs), dim=-1)
    return (emb.cos() * w.rope_scale).to(dtype), (emb.sin() * w.rope_scale).to(dtype)
