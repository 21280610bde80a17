"""Packed response pass: a micro-batch's responses laid end to end on top of their prompt's KV cache.

A GRPO micro-batch is G responses to one prompt, of very different lengths (14 to 64
tokens in one typical step). The padded forward runs n x (P + L') positions: the prompt
G times and every response padded to the longest. Here each distinct prompt runs once
(pass 1, its KV cache kept), and the responses run packed (pass 2): the tokens of several
responses of one prompt share a row, each response attending to its prompt and causally
to itself only (a block-diagonal 4-D mask), with the positions it has in its own sequence.
That is the same computation as the padded pass, row by row, without the padding.

Only tokens 0..r-2 of a response of length r are fed: token 0 is scored by the prompt's
last logits, token j > 0 by the output at token j-1, and nothing reads the last output.
A packed row holds at most max(L'-1, MIN_CAPACITY) tokens, so the wasted attention over
masked-out pairs stays small next to the linear layers; EAGER_CAPACITY with eager attention
(covey/models/attention.py), which builds the masked score matrix of every row.

Layers of another kind get their own mask (`layer_masks`): a sliding-window layer (Gemma 3,
gpt-oss, Mistral) lets a token see only the keys of the last `window` positions of its own
sequence, prompt included (key position > query position - window, transformers' rule), so
it takes the block mask cut to that band. One mask for every layer would let a sliding layer
attend its whole sequence: the log-probs of a response longer than the window would be
another model's. Layers with a recurrent state (Qwen3.5's Gated DeltaNet) cannot be packed:
their state would run from one response into the next (covey/models/families.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from covey.models.families import Family
from covey.models.hf_compat import position_ids

MIN_CAPACITY = 1024  # tokens per packed row; below it the quadratic masked attention is cheap
EAGER_CAPACITY = 128  # eager attention materialises the masked scores: short rows ran 5% faster (dev/LOG.md)


@dataclass
class Packing:
    prompt_of_bin: Tensor  # (K,) distinct prompt each packed row continues
    input_ids: Tensor      # (K, T) fed tokens, padding after the last block
    position_ids: Tensor   # (K, T) position of each token in its own sequence
    attention: Tensor      # (K, 1, T, P + T) bool, True where a query may attend a key
    targets: Tensor        # (K, T) the token each fed position predicts
    source: tuple[Tensor, Tensor]  # (bin, slot) of every fed position
    dest: tuple[Tensor, Tensor]    # (row, column) of the same positions in the (n, L'-1) output


def row_capacity(attention: str) -> int:
    """Tokens per packed row for an attention implementation (eager materialises the masked scores)."""
    return EAGER_CAPACITY if attention == "eager" else MIN_CAPACITY


def plan_bins(fed: list[int], prompt_of_row: list[int], capacity: int) -> list[list[int]]:
    """Rows of one prompt share bins: the fewest bins that hold them within `capacity` when filled
    longest row first into the emptiest bin, so bins come out even (they are padded to the widest)."""
    bins: list[list[int]] = []
    for prompt in dict.fromkeys(prompt_of_row):
        rows = sorted((r for r, p in enumerate(prompt_of_row) if p == prompt and fed[r] > 0),
                      key=lambda r: (-fed[r], r))
        count = -(-sum(fed[r] for r in rows) // capacity)
        while rows:
            mine, loads = [[] for _ in range(count)], [0] * count
            for row in rows:
                emptiest = loads.index(min(loads))
                mine[emptiest].append(row)
                loads[emptiest] += fed[row]
            if max(loads) <= capacity:
                bins += mine
                break
            count += 1
    return bins


PAD_ID = 0
"""The id of a packed row's padding positions: no score reads them, so any id in the vocabulary does."""


def pack(responses: Tensor, lengths: Tensor, starts: Tensor, prompt_of_row: Tensor, prompt_mask: Tensor,
         width_multiple: int = 1, min_capacity: int | None = None) -> Packing:
    """Lay out responses (n, L') of real lengths (n,) whose first token sits at position starts (n,).

    `prompt_mask` (U, P) is the mask of each distinct prompt, `prompt_of_row` (n,) indexes it.
    A row holds at most max(longest response, `min_capacity`) tokens (default MIN_CAPACITY).
    The packed width is padded up to a multiple of `width_multiple`: oneDNN's bf16 kernels keep
    memory for every matrix shape they have seen, so a width that differs at every micro-batch
    grew a bf16 run's resident memory by gigabytes (dev/LOG.md, 2026-11-25); a few widths do not.
    """
    fed = (lengths - 1).clamp(min=0).tolist()
    owner_of_row = prompt_of_row.tolist()
    capacity = MIN_CAPACITY if min_capacity is None else min_capacity
    bins = plan_bins(fed, owner_of_row, max(max(fed, default=0), capacity))
    width = max((sum(fed[r] for r in b) for b in bins), default=0)
    width = -(-width // width_multiple) * width_multiple
    k, device = len(bins), responses.device
    input_ids = torch.full((k, width), PAD_ID, dtype=responses.dtype, device=device)
    targets, position_ids = torch.full_like(input_ids, PAD_ID), torch.zeros_like(input_ids)
    block = torch.full((k, width), -1, dtype=torch.long, device=device)
    src_bin, src_slot, dst_row, dst_col = [], [], [], []
    for b, rows in enumerate(bins):
        offset = 0
        for row in rows:
            n_fed, end = fed[row], offset + fed[row]
            input_ids[b, offset:end] = responses[row, :n_fed]
            targets[b, offset:end] = responses[row, 1:n_fed + 1]
            position_ids[b, offset:end] = starts[row] + torch.arange(n_fed, device=device)
            block[b, offset:end] = row
            src_bin += [b] * n_fed
            src_slot += range(offset, end)
            dst_row += [row] * n_fed
            dst_col += range(n_fed)
            offset = end
    prompt_of_bin = _long([owner_of_row[rows[0]] for rows in bins], device)
    return Packing(prompt_of_bin, input_ids, position_ids, block_mask(block, prompt_mask[prompt_of_bin]),
                   targets, (_long(src_bin, device), _long(src_slot, device)),
                   (_long(dst_row, device), _long(dst_col, device)))


def _long(values: list[int], device) -> Tensor:
    return torch.tensor(values, dtype=torch.long, device=device)


def block_mask(block: Tensor, prompt_mask: Tensor) -> Tensor:
    """(K, 1, T, P + T): a token sees its prompt's real tokens and the earlier tokens of its own block.

    Padding queries (block -1) see only themselves, so no softmax row is empty (an empty
    row is NaN, and NaN times a zero gradient is still NaN).
    """
    width = block.shape[1]
    real = block >= 0
    causal = torch.ones(width, width, dtype=torch.bool, device=block.device).tril()
    own = (block[:, :, None] == block[:, None, :]) & causal & real[:, :, None]
    own |= torch.eye(width, dtype=torch.bool, device=block.device) & ~real[:, :, None]
    prompt = prompt_mask.bool()[:, None, :] & real[:, :, None]
    return torch.cat([prompt, own], dim=-1)[:, None]


def layer_masks(packing: Packing, prompt_mask: Tensor, family: Family) -> Tensor | dict[str, Tensor]:
    """The packed pass's attention argument for a model of `family`: the block mask where every layer
    attends fully, else one mask per layer kind ({kind: (K, 1, T, P + T)}), a sliding layer's cut to its
    window; a model whose layers are all sliding takes its one mask alone (its forward takes no dict).

    `prompt_mask` (U, P) is the mask of each distinct prompt, as given to `pack`.
    """
    if not family.sliding:
        return packing.attention
    prompt_positions = position_ids(prompt_mask[packing.prompt_of_bin])           # (K, P)
    keys = torch.cat([prompt_positions, packing.position_ids], dim=1)              # (K, P + T)
    in_window = keys[:, None, :] > packing.position_ids[:, :, None] - family.window  # (K, T, P + T)
    sliding = packing.attention & in_window[:, None]
    if not family.mixed:
        return sliding
    return {"full_attention": packing.attention, "sliding_attention": sliding}


def unpack(packed: Tensor, packing: Packing, n_rows: int, width: int) -> Tensor:
    """(K, T) per fed position -> (n, width) per response token 1..width; zero where nothing was fed."""
    out = packed.new_zeros(n_rows, width)
    return out.index_put(packing.dest, packed[packing.source])
