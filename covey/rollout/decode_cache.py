"""The fast engine's cache: one layer object per decoder layer, of the layer's kind (covey/models/families.py).

- full attention: `BufferLayer`, keys and values written in place into a buffer sized for the prompt and
  every new token (`DynamicLayer` concatenates a growing tensor at every step);
- sliding attention: `SlidingBufferLayer`, a buffer of at most `SLIDING_SPAN` windows written in place;
  when it is full, its last window - 1 columns move to its front (the only keys a later query can reach),
  so a step copies about one column more on average, and the buffer never grows with the response;
- linear attention (Qwen3.5's Gated DeltaNet): `StateLayer`, transformers' own `LinearAttentionLayer` (the
  conv and recurrent states the layer's forward reads and writes in place), which the engine can also
  expand to a prompt's samples, thin to the rows still decoding, and hold still for rows whose step is a
  hole (`rows_held`, the episode loop's waiting rows).

The attention layers report the (kv_length, kv_offset) of what `update` returns (`get_mask_sizes`), so
transformers' own mask functions build each kind's mask from the one 2-D mask the engine passes, over
absolute columns, as for its `DynamicSlidingWindowLayer`.
"""

from __future__ import annotations

import contextlib

import torch
from torch import Tensor
from transformers.cache_utils import Cache, DynamicLayer, LinearAttentionLayer

from covey.models.families import family_of

SLIDING_SPAN = 2
"""Windows a sliding layer's buffer holds at most: with 2, a move of window - 1 columns every window + 1 steps."""


class BufferLayer(DynamicLayer):
    """One layer's keys/values in a preallocated (n, heads, capacity, dim) buffer, written in place.

    `update` returns views of the filled part, so attention sees exactly what a
    `DynamicLayer` would hand it, without a concatenation per step.
    """

    def __init__(self, capacity: int):
        super().__init__()
        self.capacity = capacity
        self.filled = 0

    def lazy_initialization(self, key_states: Tensor, value_states: Tensor) -> None:
        n, heads, _, dim = key_states.shape
        self.dtype, self.device = key_states.dtype, key_states.device
        self.key_buf = key_states.new_empty(n, heads, self.capacity, dim)
        self.value_buf = value_states.new_empty(n, value_states.shape[1], self.capacity, value_states.shape[-1])
        self.is_initialized = True

    def update(self, key_states: Tensor, value_states: Tensor, *args, **kwargs) -> tuple[Tensor, Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        end = self.filled + key_states.shape[-2]
        if end > self.capacity:
            raise RuntimeError(f"KV buffer of {self.capacity} positions overflows at {end}")
        self.key_buf[:, :, self.filled:end] = key_states
        self.value_buf[:, :, self.filled:end] = value_states
        self.filled = end
        self.keys, self.values = self.key_buf[:, :, :end], self.value_buf[:, :, :end]
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self.filled

    def take_columns(self, source: Tensor, width: int) -> None:
        """Row r's first `width` positions become its positions source[r] (n, width): the episode loop's
        packing of its cache (covey/rollout/fast_episodes.py)."""
        if self.is_initialized:
            for name in ("key_buf", "value_buf"):
                buf = getattr(self, name)
                buf[:, :, :width] = buf.gather(2, source[:, None, :, None].expand(-1, buf.shape[1], -1, buf.shape[3]))
            self.filled = width
            self.keys, self.values = self.key_buf[:, :, :width], self.value_buf[:, :, :width]

    def batch_select_indices(self, indices: Tensor) -> None:
        """Keep (or repeat) rows `indices`: expands a prompt to its samples, drops finished rows."""
        if self.is_initialized:
            self.key_buf, self.value_buf = self.key_buf[indices], self.value_buf[indices]
            self.keys, self.values = self.key_buf[:, :, :self.filled], self.value_buf[:, :, :self.filled]

    def skip_to(self, column: int) -> None:
        """The next write goes to `column` (>= the filled columns): the columns between are holes the caller
        masks out."""
        if self.is_initialized:
            self.filled = column
            self.keys, self.values = self.key_buf[:, :, :column], self.value_buf[:, :, :column]

    def save_rows(self, rows: Tensor) -> list[Tensor]:
        """Rows `rows`' filled columns (copies): a prompt's keys and values, kept to start its later rows."""
        return [self.key_buf[rows, :, :self.filled].clone(), self.value_buf[rows, :, :self.filled].clone()]

    def place_rows(self, rows: Tensor, saved: list[Tensor], sources: Tensor, end: int) -> None:
        """Rows `rows` take saved rows `sources` as their columns end - width .. end - 1 (a slot's new row)."""
        keys, values = saved
        start = end - keys.shape[2]
        self.key_buf[rows, :, start:end] = keys[sources]
        self.value_buf[rows, :, start:end] = values[sources]


class SlidingBufferLayer(DynamicLayer):
    """A sliding-window layer's keys/values: buffer slot j holds absolute column `start + j`, `held` slots
    filled, `capacity` = min(positions, SLIDING_SPAN * window) slots (a window at least).

    A query at column c attends to columns c - window + 1 .. c, so only the last window - 1 columns are
    ever needed again. `update` writes in place where the new columns fit; else it first moves the last
    window - 1 held columns to the front. Only a write longer than the buffer itself (a prefill of more
    than capacity - window + 1 tokens) attends over a concatenation, and keeps its last window - 1 columns.
    """

    is_sliding = True
    is_croppable = False

    def __init__(self, window: int, positions: int):
        super().__init__()
        self.window = self.sliding_window = window
        self.capacity = max(min(positions, SLIDING_SPAN * window), window)
        self.start = 0
        self.held = 0

    def lazy_initialization(self, key_states: Tensor, value_states: Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        shape = (key_states.shape[0], key_states.shape[1], self.capacity)
        self.key_buf = key_states.new_empty(*shape, key_states.shape[-1])
        self.value_buf = value_states.new_empty(shape[0], value_states.shape[1], shape[2], value_states.shape[-1])
        self.is_initialized = True

    def kept(self, query_length: int) -> int:
        """How many held columns `update` keeps in front of `query_length` new ones: all where they fit,
        else the last window - 1."""
        if self.held + query_length <= self.capacity:
            return self.held
        return min(self.held, self.window - 1)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        """(kv_length, kv_offset): `update` returns the kept columns and the new ones, the first at absolute
        column start + held - kept."""
        kept = self.kept(query_length)
        return kept + query_length, self.start + self.held - kept

    def update(self, key_states: Tensor, value_states: Tensor, *args, **kwargs) -> tuple[Tensor, Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        q, kept = key_states.shape[-2], self.kept(key_states.shape[-2])
        first = self.start + self.held - kept  # absolute column of the first key returned
        if kept + q > self.capacity:  # longer than the buffer: attend over the concatenation
            keys = torch.cat([self.key_buf[:, :, self.held - kept:self.held], key_states], dim=-2)
            values = torch.cat([self.value_buf[:, :, self.held - kept:self.held], value_states], dim=-2)
            last = min(self.window - 1, kept + q)
            self.key_buf[:, :, :last] = keys[:, :, kept + q - last:]
            self.value_buf[:, :, :last] = values[:, :, kept + q - last:]
            self.start, self.held = first + kept + q - last, last
            self.keys, self.values = self.key_buf[:, :, :last], self.value_buf[:, :, :last]
            return keys, values
        if kept < self.held:  # move the last `kept` columns to the front (clone: the ranges may overlap)
            for buf in (self.key_buf, self.value_buf):
                buf[:, :, :kept] = buf[:, :, self.held - kept:self.held].clone()
        self.key_buf[:, :, kept:kept + q] = key_states
        self.value_buf[:, :, kept:kept + q] = value_states
        self.start, self.held = first, kept + q
        self.keys, self.values = self.key_buf[:, :, :self.held], self.value_buf[:, :, :self.held]
        return self.keys, self.values

    def get_seq_length(self) -> int:
        """Columns seen so far (the query offset of transformers' masks), not columns held."""
        return self.start + self.held

    def get_max_length(self) -> int:
        return self.window

    def batch_select_indices(self, indices: Tensor) -> None:
        """Keep (or repeat) rows `indices`: expands a prompt to its samples, drops finished rows."""
        if self.is_initialized:
            self.key_buf, self.value_buf = self.key_buf[indices], self.value_buf[indices]
            self.keys, self.values = self.key_buf[:, :, :self.held], self.value_buf[:, :, :self.held]


class StateLayer(LinearAttentionLayer):
    """A linear-attention layer's conv and recurrent states (transformers' `LinearAttentionLayer`, updated
    in place by the layer's forward), with the row operations of the engine."""

    def batch_select_indices(self, indices: Tensor) -> None:
        """Keep (or repeat) rows `indices` of every state."""
        self.reorder_cache(indices)

    def states(self) -> list[tuple[dict, int]]:
        """(dict, index) of every initialized state tensor."""
        out = [(self.conv_states, i) for i, ready in self.is_conv_states_initialized.items() if ready]
        return out + [(self.recurrent_states, i) for i, ready in self.is_recurrent_states_initialized.items() if ready]

    def save_rows(self, rows: Tensor) -> list[Tensor]:
        return [held[i][rows].clone() for held, i in self.states()]

    def restore_rows(self, rows: Tensor, saved: list[Tensor]) -> None:
        for (held, i), before in zip(self.states(), saved, strict=True):
            held[i][rows] = before

    def place_rows(self, rows: Tensor, saved: list[Tensor], sources: Tensor, end: int) -> None:
        """Rows `rows` take the states of saved rows `sources` (a slot's new row starts from its prompt's)."""
        self.restore_rows(rows, [state[sources] for state in saved])


@contextlib.contextmanager
def rows_held(cache: Cache, held: Tensor):
    """Rows where `held` (n,) is True leave the forward run inside with the linear-attention states they
    entered it with: a waiting row's hole step must not advance its recurrence (its attention columns are
    masked out by the caller's key mask)."""
    layers = [layer for layer in cache.layers if isinstance(layer, StateLayer)]
    rows = held.nonzero().squeeze(1) if layers else held[:0]
    saved = [layer.save_rows(rows) for layer in layers]
    yield
    for layer, before in zip(layers, saved):
        layer.restore_rows(rows, before)


def cache_layer(kind: str, window: int | None, positions: int):
    """The engine's cache layer for a decoder layer of `kind` in a row of at most `positions` columns."""
    if kind == "full_attention":
        return BufferLayer(positions)
    if kind == "sliding_attention":
        return SlidingBufferLayer(window, positions)
    if kind == "linear_attention":
        return StateLayer()
    raise ValueError(f"the fast engine has no cache for layers of kind {kind!r} (covey/models/families.py)")


def buffer_cache(model, capacity: int) -> Cache:
    """A Cache of `model`'s layer kinds for rows of at most `capacity` columns (prompt + new tokens)."""
    family = family_of(model.config)
    return Cache(layers=[cache_layer(kind, family.window, capacity) for kind in family.layer_types])


def cache_plan(model) -> str:
    """What `buffer_cache` holds for `model`, per layer kind, in a few words (the engine's start-up line)."""
    family = family_of(model.config)
    words = {"full_attention": "full-attention buffer{s} of prompt + new tokens",
             "sliding_attention": f"sliding buffer{{s}} of at most {SLIDING_SPAN * (family.window or 0)} positions "
                                  f"({SLIDING_SPAN} windows)",
             "linear_attention": "linear-attention state{s} (conv and recurrent)"}
    counts = {kind: family.layer_types.count(kind) for kind in dict.fromkeys(family.layer_types)}
    return ", ".join(f"{n} " + words.get(kind, kind).format(s="s" if n > 1 else "") for kind, n in counts.items())


def column_layers(cache: Cache) -> list[BufferLayer]:
    """The layers whose buffer columns are the rows' positions one for one (full attention)."""
    return [layer for layer in cache.layers if isinstance(layer, BufferLayer)]


def held_bytes(cache: Cache) -> int:
    """Bytes of every tensor the cache holds (buffers and states, not the views of them)."""
    total = 0
    for layer in cache.layers:
        tensors = [getattr(layer, name, None) for name in ("key_buf", "value_buf")]
        if isinstance(layer, StateLayer):
            tensors += [held[i] for held, i in layer.states()]
        total += sum(t.numel() * t.element_size() for t in tensors if t is not None)
    return total
