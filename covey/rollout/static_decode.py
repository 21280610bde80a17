"""The fast engine's decoding loop on a static KV cache, its step replayed as a CUDA graph
(rollout.decode=static | graphs | compile).

On a GPU a decode step of a small model is a few hundred short kernels, and launching them one by
one from Python takes longer than running them. Here the prompts run once through the model's own
forward (SDPA: the flash or memory-efficient kernels), their keys and values are copied into
buffers sized once (covey/rollout/static_step.py), and every later step is one replay of a
captured CUDA graph of `decode_step` followed by the picking of each row's next token (`Picker`: the
engine's own greedy or sampling choice, on uniforms copied in before the first step), which the graph
feeds to the next replay; between checks the host only launches replays. What makes graphs reusable
from step to step and from one rollout to the next:

- rows are held in buckets of 8, 16, 32, ... (a batch of 48 runs in the 64-row graphs, its last 16
  rows idle); when enough rows have finished, the live ones move to a smaller bucket;
- a step attends over the first columns of the cache rounded up to a multiple of LENGTH_STEP, so
  one graph serves LENGTH_STEP steps; the capacity only grows (rounded up to CAPACITY_STEP);
- the graphs, buffers and the weights they read stay where they were captured: an engine with a
  static cache keeps its sampling copy resident (`keeps_weights`), and a change of any weight's
  address (a model swapped in) drops the graphs, which are captured again.

The loop reads the picked tokens and checks whether every row has finished only every CHECK_EVERY
steps (a check waits for the GPU); rows that finished keep decoding in the meantime and their
tokens are replaced by padding, so the tokens are those of the plain loop: greedy tokens equal
`generate`'s (tested on CPU, and under graph capture on a GPU), and sampled ones follow the same
distribution from the same uniforms (all drawn up front, one per row and step, as the plain loop
draws them).

`compile` runs the step through torch.compile (inductor's fused kernels) and captures those in
the same graphs: what torch.compile(mode="reduce-overhead") does, with the engine's own buckets.
Its shapes are static (one compilation per rows bucket), so its steps attend the whole capacity.
Without CUDA the same loop runs eagerly (how CI tests it); on a CPU the plain loop is the default.
"""

from __future__ import annotations

import torch
from torch import Tensor

from covey.models.hf_compat import cache_tensors, last_positions, position_ids, with_cache
from covey.rollout.static_step import DecodeWeights, StaticState, decode_step, gather_weights
from covey.runtime.signals import check_abort

LENGTH_STEP = 64      # attended columns rounded up to this: one graph per LENGTH_STEP steps
CAPACITY_STEP = 128   # cache positions rounded up to this, so prompts a little longer reuse the buffers
CHECK_EVERY = 16      # steps between checks that every row has finished
SMALLEST_BUCKET = 8


def row_bucket(n: int) -> int:
    """The smallest power of two >= n (at least SMALLEST_BUCKET)."""
    size = SMALLEST_BUCKET
    while size < n:
        size *= 2
    return size


def round_up(value: int, step: int) -> int:
    return -(-value // step) * step


class Picker:
    """Picks each row's next token inside the step, from the step's logits: the engine's `pick` (greedy, or
    its warpers and inverse CDF on the row's uniform for that column), padding for rows already finished,
    which rows go on; the token is fed to the next step and kept by column, with its log-prob under the
    sampler's logits / temperature (the trainer's quantity at the sampler's precision, as the plain loop
    records it: importance sampling reads it). Its tensors (the stop tokens) stay where a captured graph
    reads them; `key` tells graphs of different pickers apart."""

    def __init__(self, pick, greedy: bool, pad: int, eos: list[int], device, temperature: float = 1.0):
        self.pick, self.greedy, self.pad, self.temperature = pick, greedy, pad, temperature
        self.key = self.key_of(greedy, pad, eos, temperature)
        self.eos = torch.tensor(self.key[2], dtype=torch.long, device=device)

    @staticmethod
    def key_of(greedy: bool, pad: int, eos: list[int], temperature: float = 1.0) -> tuple:
        return greedy, pad, tuple(sorted(set(eos))), float(temperature)

    def logp(self, logits: Tensor, tokens: Tensor) -> Tensor:
        """(rows,) float32 log-prob of `tokens` under softmax(logits / temperature)."""
        return torch.log_softmax(logits.float() / self.temperature, -1).gather(1, tokens.unsqueeze(1)).squeeze(1)

    def first(self, logits: Tensor, uniforms: Tensor | None) -> tuple[Tensor, Tensor]:
        """The first new token of every row, from the prompts' last logits (outside any graph), and its log-prob."""
        tokens = self.pick(logits, uniforms, self.greedy)
        return tokens, self.logp(logits, tokens)

    def finished(self, tokens: Tensor) -> Tensor:
        return (tokens.unsqueeze(1) == self.eos).any(1)

    def __call__(self, s: StaticState, logits: Tensor) -> None:
        """After `decode_step` has advanced the column to the token its logits are for."""
        column = s.column.expand(s.rows).unsqueeze(1)
        uniforms = None if self.greedy else s.draws.gather(1, column).squeeze(1)
        picked = torch.where(s.live, self.pick(logits.float(), uniforms, self.greedy), self.pad)
        s.live &= ~self.finished(picked)
        s.tokens.copy_(picked)
        s.picked.scatter_(1, column, picked.unsqueeze(1))
        s.logp.scatter_(1, column, self.logp(logits, picked).unsqueeze(1))


class StepRunner:
    """`decode_step` and the picking of its tokens, eagerly or replayed from CUDA graphs captured once per
    (rows, attended columns, picker)."""

    def __init__(self, graphs: bool, compile_step: bool):
        self.graphs_on = graphs
        # compiled: static shapes, every step attends the whole capacity (the mask hides the columns not
        # yet written), so one compilation serves a rows bucket (symbolic lengths and rows recompiled anyway)
        self.step = torch.compile(decode_step, dynamic=False, fullgraph=True) if compile_step else decode_step
        self.whole_capacity = compile_step
        self.graphs: dict[tuple, torch.cuda.CUDAGraph] = {}
        self.pool = None
        self.signature: tuple[int, ...] | None = None
        self.captures = 0  # graphs captured so far (tests and the benchmark read it)

    def check_weights(self, weights: DecodeWeights) -> None:
        """Drop graphs captured on tensors that have moved."""
        signature = weights.signature()
        if signature != self.signature:
            self.graphs.clear()
            self.signature = signature

    def forget(self) -> None:
        self.graphs.clear()
        self.pool = None

    def __call__(self, weights: DecodeWeights, state: StaticState, length: int, picker: Picker) -> None:
        if not self.graphs_on:
            return picker(state, self.step(weights, state, length))
        key = (id(state), state.rows, length, picker.key)
        if key not in self.graphs:
            self.graphs[key] = self.capture(weights, state, length, picker)
        self.graphs[key].replay()

    def capture(self, weights: DecodeWeights, state: StaticState, length: int, picker: Picker):
        """Warm up on a side stream (compiles, if compiling), undo what the warm-up advanced, capture."""
        tokens, live = state.tokens.clone(), state.live.clone()  # queued before the side stream waits
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            # writes the column's keys/values and picked tokens, which the replay writes again
            picker(state, self.step(weights, state, length))
            state.positions.sub_(1)
            state.column.sub_(1)
            state.tokens.copy_(tokens)
            state.live.copy_(live)
        torch.cuda.current_stream().wait_stream(side)
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            picker(state, self.step(weights, state, length))
        self.captures += 1
        return graph


class StaticDecoder:
    """Buffers, graphs and fused weights of one engine, kept between its generate calls."""

    def __init__(self, cuda_graphs: bool = False, compile_step: bool = False, persistent: bool = True):
        self.runner = StepRunner(cuda_graphs, compile_step)
        self.persistent = persistent  # False: free buffers and graphs after each call (held-out evaluation)
        self.states: dict[int, StaticState] = {}  # rows bucket -> buffers, all of one capacity
        self.fused: dict = {}
        self.pickers: dict[tuple, Picker] = {}
        self.steps = 0  # decode steps run (replays or eager), for the benchmark

    def weights(self, model) -> DecodeWeights:
        """Fused q/k/v and gate/up where the model is frozen (a sampling copy), its own tensors otherwise."""
        frozen = not any(p.requires_grad for p in model.parameters())
        weights = gather_weights(model, self.fused if frozen else None)
        self.runner.check_weights(weights)
        return weights

    def state(self, weights: DecodeWeights, rows: int, positions: int, dtype, device) -> StaticState:
        capacity = max((s.capacity for s in self.states.values()), default=0)
        if positions > capacity or any(s.dtype != dtype for s in self.states.values()):
            self.states.clear()  # buffers of another size: their graphs go with them
            self.runner.forget()
            capacity = round_up(positions, CAPACITY_STEP)
        if rows not in self.states:
            self.states[rows] = StaticState(weights, rows, capacity, dtype, device)
        return self.states[rows]

    def release(self) -> None:
        self.states.clear()
        self.runner.forget()

    def prefill(self, model, prompt_ids: Tensor, prompt_mask: Tensor) -> tuple[list, Tensor]:
        """The distinct prompts through the model's forward: (keys/values per layer, last logits (U, V)).
        Every layer's cache keeps every position (no config: no window-sized layers), as the static
        buffers do; sliding layers still attend their window, by the forward's own masks."""
        from transformers import DynamicCache
        cache = DynamicCache()
        out = model(input_ids=prompt_ids, attention_mask=prompt_mask, position_ids=position_ids(prompt_mask),
                    **with_cache(cache), use_cache=True,
                    logits_to_keep=last_positions(1, prompt_ids.shape[1], prompt_ids.device))
        return cache_tensors(cache), out.logits[:, -1].float()

    def decode(self, engine, prompt_ids: Tensor, prompt_mask: Tensor, index: Tensor, max_new: int,
               greedy: bool, uniforms) -> tuple[Tensor, Tensor]:
        """(N, steps) new tokens, padding after each row's EOS, and (N, steps) float32 log-probs of the tokens
        (padding's are meaningless), as `FastEngine` returns them."""
        model = engine.model
        device = next(model.parameters()).device
        prompt_ids, prompt_mask, index = prompt_ids.to(device), prompt_mask.to(device), index.to(device)
        n, width = len(index), prompt_ids.shape[1]
        weights = self.weights(model)
        state = self.state(weights, row_bucket(n), width + max_new, weights.embed.dtype, device)
        pairs, first_logits = self.prefill(model, prompt_ids, prompt_mask)
        draws = None if greedy else torch.stack([uniforms.draw() for _ in range(max_new)]).to(device)
        picker = self.picker(engine, greedy, device)
        out = torch.full((n, max_new), picker.pad, dtype=torch.long, device=device)
        logps = torch.zeros((n, max_new), dtype=torch.float32, device=device)
        first, logps[:, 0] = picker.first(first_logits[index], None if greedy else draws[0])
        out[:, 0] = first
        rows = torch.arange(n, device=device)     # which output row each state row 0..m-1 holds
        try:
            if max_new > 1:
                state.load_prompts(pairs, index, prompt_mask, first, ~picker.finished(first), draws)
            kept = 1                              # tokens 0..kept-1 are in `out`
            for t in range(1, max_new):           # the step feeding token t-1 picks token t
                check_abort()                     # a stop signal during the evaluation before training
                length = state.capacity if self.runner.whole_capacity else min(
                    round_up(width + t, LENGTH_STEP), state.capacity)
                self.runner(weights, state, length, picker)
                self.steps += 1
                if (t + 1) % CHECK_EVERY and t < max_new - 1:
                    continue
                out[rows, kept:t + 1] = state.picked[:len(rows), width + kept:width + t + 1]
                logps[rows, kept:t + 1] = state.logp[:len(rows), width + kept:width + t + 1]
                kept = t + 1
                if t == max_new - 1:
                    break
                state, rows = self.shrink(weights, state, rows)
                if not len(rows):
                    break
        finally:
            if not self.persistent:
                self.release()
        return out, logps

    def picker(self, engine, greedy: bool, device) -> Picker:
        """One per (greedy, padding, stop tokens, temperature), kept: captured graphs read its stop tokens in place."""
        pad, temperature = engine.tokenizer.pad_token_id, engine.temperature
        key = (*Picker.key_of(greedy, pad, engine.eos, temperature), str(device))
        if key not in self.pickers:
            self.pickers[key] = Picker(engine.pick, greedy, pad, engine.eos, device, temperature)
        return self.pickers[key]

    def shrink(self, weights: DecodeWeights, state: StaticState, rows: Tensor):
        """At a check: the rows still decoding, moved to the smallest bucket that holds them."""
        live = state.live[:len(rows)]
        left = int(live.sum())
        if left == 0:
            return state, rows[:0]
        bucket = row_bucket(left)
        if bucket >= state.rows:
            return state, rows
        keep = live.nonzero().squeeze(1)
        smaller = self.state(weights, bucket, state.capacity, state.dtype, state.tokens.device)
        smaller.take_rows(state, keep)
        return smaller, rows[keep]
