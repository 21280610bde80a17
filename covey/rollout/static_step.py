"""One decode step over a preallocated (static) KV cache, in plain tensor ops: the step the fast engine
replays as a CUDA graph (rollout.decode; covey/rollout/static_decode.py).

A CUDA graph replays fixed kernels on fixed addresses, so every tensor a step reads or writes
lives in a buffer allocated once (`StaticState`): the keys and values of every layer for
`rows` sequences and `capacity` positions, an additive mask over those positions, each row's
next token and rotary position, and the column the step writes. The step writes its keys and
values at that column, unmasks it, attends over the first `length` columns (a bucket of
columns rounded up, so one graph serves many steps), and advances the position and the column
itself: replaying the graph again is the next step.

Families (`STATIC_FAMILIES`; `supports_static_decode` refuses every other model, and these with options
the step does not reproduce). Operations and precision follow each model's eager forward:

- Llama, Qwen2: RMSNorm, rotary embeddings, grouped-query attention (Qwen2's q/k/v biases), SwiGLU MLP;
- Qwen3: the same with QK-norm (an RMSNorm over each query and key head, before the rotation) and the
  config's own head_dim; full attention in every layer (a config with sliding layers is refused);
- Gemma 3 (text-only `Gemma3ForCausalLM`): embeddings scaled by sqrt(hidden) rounded to their dtype;
  Gemma's RMSNorm (x / rms(x) * (1 + w), in float32, then cast); four norms a layer (before and after
  the attention, before and after the MLP: each block's output is normed before the residual adds it);
  QK-norm; attention scaled by query_pre_attn_scalar**-0.5; a GELU (tanh) gated MLP; two rotary tables
  (the local one for sliding layers, the global one, with its own parameters, for full layers); final
  logit softcapping where the config sets it; sliding layers attend only the last `sliding_window`
  positions (transformers' rule: key position > query position - window). Sliding layers keep the
  full-length cache and mask the older columns (one extra mask a step, shared by those layers): exact,
  but the memory saving of a window-sized buffer is not taken on this path.

Rotary tables are read from the model's rotary module (inverse frequencies and cos/sin scaling, per
layer kind), so every rope type whose tables are fixed at load (`FIXED_ROPE_TYPES`: default, linear,
llama3, yarn) is exact; types whose tables change with the sequence length (dynamic, longrope) are
refused. So are other classes (mixtures of experts, gpt-oss, Qwen3.5's linear-attention layers,
Mistral), sliding windows outside Gemma 3, attention-logit softcapping, bidirectional attention and MLP
biases (attention biases are applied, where a config sets them).

In fewer kernels than the forward, about 13 a layer for Llama instead of 30-odd: RMSNorm is torch's
fused kernel; the rotation of queries and keys is one batched product with a per-row rotation matrix;
the query heads of a key/value head enter SDPA as that head's query positions (one attention kernel,
the keys read once, no copies per query head); where no norm follows them (all but Gemma) the output
and down projections add into the residual inside the matrix product (`addmm`); and where the weights
are frozen (the sampling copy) the q/k/v and the gate/up projections are each one matrix
(`fuse_linears`). Differences from the model's forward are float rounding only (tests compare greedy
tokens with `generate` for every family).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

STATIC_FAMILIES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "Gemma3ForCausalLM")
FIXED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")
GEMMA = "Gemma3ForCausalLM"


def supports_static_decode(model) -> bool:
    """A model of `STATIC_FAMILIES` the step reproduces: its own activation (SiLU; Gemma 3: GELU tanh), no MLP
    biases, rotary tables fixed at load, full attention in every layer (Gemma 3: full or sliding), no
    attention-logit softcapping or bidirectional attention, parameters that are ordinary tensors (not FSDP
    shards, not a PEFT wrapper)."""
    name = type(model).__name__
    if name not in STATIC_FAMILIES:
        return False
    config = model.config
    gemma = name == GEMMA
    activation = config.hidden_activation if gemma else config.hidden_act
    kinds = {"full_attention", "sliding_attention"} if gemma else {"full_attention"}
    return (activation == ("gelu_pytorch_tanh" if gemma else "silu") and not getattr(config, "mlp_bias", False)
            and getattr(config, "pretraining_tp", 1) == 1 and rope_types(config) <= set(FIXED_ROPE_TYPES)
            and set(getattr(config, "layer_types", None) or ["full_attention"]) <= kinds
            and getattr(config, "attn_logit_softcapping", None) is None
            and not getattr(config, "use_bidirectional_attention", False)
            and all(type(p.data) is torch.Tensor for p in model.parameters()))


def rope_types(config) -> set[str]:
    """The rope types of a config's rotary tables: one, or one per layer kind (Gemma 3)."""
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    nested = [p for p in params.values() if isinstance(p, dict)]
    return {p.get("rope_type", "default") for p in nested or [params]}


@dataclass
class Rope:
    """A rotary table as the model's rotary module holds it: inverse frequencies and the cos/sin scaling."""
    inv_freq: Tensor
    scale: float


@dataclass
class LayerWeights:
    norm1: Tensor                                # before the attention
    qkv: list[tuple[Tensor, Tensor | None]]      # one fused (weight, bias) or q, k, v apart
    out: tuple[Tensor, Tensor | None]
    norm2: Tensor                                # before the MLP
    gate_up: list[tuple[Tensor, Tensor | None]]  # one fused (weight, bias) or gate, up apart
    down: tuple[Tensor, Tensor | None]
    qk_norm: tuple[Tensor, Tensor] | None = None    # Qwen3, Gemma 3: each query head's and key head's RMSNorm
    out_norms: tuple[Tensor, Tensor] | None = None  # Gemma 3: the attention's and the MLP's outputs, normed
    sliding: bool = False                           # attends the last `DecodeWeights.window` positions only

    def tensors(self) -> list[Tensor | None]:
        pairs = [t for pair in self.qkv + self.gate_up for t in pair]
        return [self.norm1, self.norm2, *self.out, *self.down, *pairs, *(self.qk_norm or ()), *(self.out_norms or ())]


@dataclass
class DecodeWeights:
    """The tensors a step reads, by reference to the model's own parameters, and the family's options."""
    embed: Tensor
    layers: list[LayerWeights]
    norm: Tensor
    head: Tensor
    rope: Rope                       # full-attention layers' (every layer's, where there is one table)
    eps: float
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    scaling: float
    local_rope: Rope | None = None   # sliding layers' (Gemma 3)
    window: int | None = None        # sliding layers' window, in positions
    embed_scale: float | None = None  # Gemma 3: sqrt(hidden), rounded to the embeddings' dtype
    offset_norms: bool = False        # Gemma 3: RMSNorm weights applied as 1 + w, in float32
    gelu: bool = False                # Gemma 3: GELU (tanh) gate; SiLU otherwise
    softcap: float | None = None      # final logits -> cap * tanh(logits / cap)

    def signature(self) -> tuple[int, ...]:
        """Addresses of every tensor read: a captured graph is valid while they do not change."""
        tensors = [self.embed, self.norm, self.head, self.rope.inv_freq]
        tensors += [self.local_rope.inv_freq] if self.local_rope is not None else []
        for layer in self.layers:
            tensors += layer.tensors()
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
    gemma = type(model).__name__ == GEMMA
    layers = [layer_weights(layer, i, fused, gemma) for i, layer in enumerate(body.layers)]
    attn = body.layers[0].self_attn
    rope, local_rope = rotary_tables(body.rotary_emb)
    windows = {layer.self_attn.sliding_window for layer in body.layers if getattr(layer.self_attn, "is_sliding", False)}
    embed_scale = None
    if gemma:  # as transformers scales: by the (float32) scale cast to the embeddings' dtype; read on the host
        scale = torch.tensor(body.embed_tokens.scalar_embed_scale, dtype=torch.float32)
        embed_scale = float(scale.to(body.embed_tokens.weight.dtype))
    return DecodeWeights(
        embed=body.embed_tokens.weight, layers=layers, norm=body.norm.weight, head=model.lm_head.weight,
        rope=rope, eps=norm_eps(body.norm), heads=attn.q_proj.out_features // attn.head_dim,
        kv_heads=attn.k_proj.out_features // attn.head_dim, head_dim=attn.head_dim,
        intermediate=config.intermediate_size, scaling=float(attn.scaling), local_rope=local_rope,
        window=windows.pop() if windows else None, embed_scale=embed_scale, offset_norms=gemma, gelu=gemma,
        softcap=getattr(config, "final_logit_softcapping", None))


def layer_weights(layer, index: int, fused: dict | None, gemma: bool) -> LayerWeights:
    attn, mlp = layer.self_attn, layer.mlp
    qkv = [attn.q_proj, attn.k_proj, attn.v_proj]
    gate_up = [mlp.gate_proj, mlp.up_proj]
    qk_norm = (attn.q_norm.weight, attn.k_norm.weight) if hasattr(attn, "q_norm") else None
    if gemma:  # its post_attention_layernorm norms the attention's output; pre_feedforward_layernorm the MLP's input
        norm2, out_norms = layer.pre_feedforward_layernorm, (layer.post_attention_layernorm.weight,
                                                            layer.post_feedforward_layernorm.weight)
    else:
        norm2, out_norms = layer.post_attention_layernorm, None
    return LayerWeights(
        norm1=layer.input_layernorm.weight,
        qkv=fuse_linears(qkv, fused, (index, "qkv")) if fused is not None else [(m.weight, m.bias) for m in qkv],
        out=(attn.o_proj.weight, attn.o_proj.bias), norm2=norm2.weight,
        gate_up=(fuse_linears(gate_up, fused, (index, "gate_up")) if fused is not None
                 else [(m.weight, m.bias) for m in gate_up]),
        down=(mlp.down_proj.weight, mlp.down_proj.bias), qk_norm=qk_norm, out_norms=out_norms,
        sliding=bool(getattr(attn, "is_sliding", False)))


def rotary_tables(rotary) -> tuple[Rope, Rope | None]:
    """(every layer's or the full layers', the sliding layers' or None) from the model's rotary module."""
    if hasattr(rotary, "inv_freq"):
        return Rope(rotary.inv_freq, float(rotary.attention_scaling)), None
    full = Rope(rotary.full_attention_inv_freq, float(rotary.full_attention_attention_scaling))
    if not hasattr(rotary, "sliding_attention_inv_freq"):
        return full, None
    return full, Rope(rotary.sliding_attention_inv_freq, float(rotary.sliding_attention_attention_scaling))


def norm_eps(norm: nn.Module) -> float:
    return float(norm.eps if hasattr(norm, "eps") else norm.variance_epsilon)
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
    x = F.embedding(s.tokens, w.embed)
    if w.embed_scale is not None:
        x = x * w.embed_scale
    s.mask.index_fill_(1, s.column, 0.0)  # the scalar goes to the kernel: no host copy inside a capture
    mask = s.mask.narrow(1, 0, length)[:, None, None, :]  # narrow, not a slice: no clamping to guard on
    full = (rotation_matrices(w.rope, s.positions, x.dtype), mask)
    local = full
    if w.window is not None:  # a sliding layer sees a key column c from query column q where c > q - window
        columns = torch.arange(length, device=mask.device)
        local = (rotation_matrices(w.local_rope or w.rope, s.positions, x.dtype),
                 torch.where(columns > s.column - w.window, mask, torch.finfo(mask.dtype).min))
    for layer, keys, values in zip(w.layers, s.keys, s.values):
        attn = attend(w, layer, s, rms_norm(w, x, layer.norm1), local if layer.sliding else full, (keys, values))
        if layer.out_norms is None:
            x = add_linear(x, attn, layer.out)
            x = add_linear(x, gated_mlp(w, layer, rms_norm(w, x, layer.norm2)), layer.down)
        else:  # Gemma 3: each block's output normed before the residual adds it
            x = x + rms_norm(w, F.linear(attn, *layer.out), layer.out_norms[0])
            x = x + rms_norm(w, F.linear(gated_mlp(w, layer, rms_norm(w, x, layer.norm2)), *layer.down),
                             layer.out_norms[1])
    s.positions.add_(1)
    s.column.add_(1)
    logits = F.linear(rms_norm(w, x, w.norm), w.head)
    return logits if w.softcap is None else torch.tanh(logits / w.softcap) * w.softcap


def attend(w: DecodeWeights, layer: LayerWeights, s: StaticState, h: Tensor, where: tuple[Tensor, Tensor],
           cache: tuple[Tensor, Tensor]) -> Tensor:
    """(rows, heads * d) attention of the normed hidden states `h` over the cache, before the output
    projection; `where` is the layer kind's (rotation matrices, additive mask); writes the step's column."""
    (rotation, mask), (keys, values) = where, cache
    rows, d, heads, kv, length = s.rows, w.head_dim, w.heads, w.kv_heads, mask.shape[-1]
    qkv = linear(h, layer.qkv)
    qk = qkv[:, :(heads + kv) * d].view(rows, heads + kv, d)
    if layer.qk_norm is not None:  # each head's RMSNorm, before the rotation
        qk = torch.cat([rms_norm(w, qk[:, :heads], layer.qk_norm[0]), rms_norm(w, qk[:, heads:], layer.qk_norm[1])], 1)
    qk = torch.bmm(qk, rotation)
    keys[:, :, s.column] = qk[:, heads:].unsqueeze(2)  # index_put_: compiled into an in-place scatter
    values[:, :, s.column] = qkv[:, (heads + kv) * d:].view(rows, kv, 1, d)
    # the query heads of a key/value head as its query positions: one attention kernel, no copies of the keys
    attn = F.scaled_dot_product_attention(qk[:, :heads].view(rows, kv, heads // kv, d), keys.narrow(2, 0, length),
                                          values.narrow(2, 0, length), attn_mask=mask, scale=w.scaling)
    return attn.reshape(rows, heads * d)


def gated_mlp(w: DecodeWeights, layer: LayerWeights, h: Tensor) -> Tensor:
    """act(gate) * up of the normed hidden states `h`, before the down projection."""
    gate_up = linear(h, layer.gate_up)
    gate, up = gate_up[:, :w.intermediate], gate_up[:, w.intermediate:]
    return (F.gelu(gate, approximate="tanh") if w.gelu else F.silu(gate)) * up


def rms_norm(w: DecodeWeights, x: Tensor, weight: Tensor) -> Tensor:
    """RMSNorm over the last dimension: torch's fused kernel (Llama, Qwen), or Gemma's x / rms(x) * (1 + w)
    computed in float32 and cast back."""
    if not w.offset_norms:
        return F.rms_norm(x, (x.shape[-1],), weight, w.eps)
    return (F.rms_norm(x.float(), (x.shape[-1],), eps=w.eps) * (1.0 + weight.float())).to(x.dtype)


def rotation_matrices(rope: Rope, positions: Tensor, dtype: torch.dtype) -> Tensor:
    """(rows, d, d) M with x @ M = x * cos + rotate_half(x) * sin: the rotary embedding of each row's
    position as one batched matrix product per layer (for queries and keys together) instead of four
    elementwise kernels. rotate_half(x)_j is -x_(j+d/2) for j < d/2 and x_(j-d/2) above, so M holds cos
    on its diagonal and -sin, sin on the diagonals d/2 below and above it."""
    cos, sin = rotary_tables_scaled(rope, positions, dtype)
    half = cos.shape[-1] // 2
    return (torch.diag_embed(cos) + torch.diag_embed(-sin[:, :half], offset=-half)
            + torch.diag_embed(sin[:, half:], offset=half))


def rotary_tables_scaled(rope: Rope, positions: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """(cos, sin) (rows, d) as the model's rotary module makes them: float32 angles, scaled, then cast."""
    freqs = positions[:, None].float() * rope.inv_freq.float()
    emb = torch.cat((freqs, freqs), dim=-1)
    return (emb.cos() * rope.scale).to(dtype), (emb.sin() * rope.scale).to(dtype)
