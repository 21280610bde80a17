"""Rows through slots: a step's N rows decode in S slots, and a row that finishes gives its slot to the
next waiting row at once (rollout.slots).

The batch loop of `FastEngine` starts every row together and drops rows as they finish, so its batch
thins out while the longest answer runs on: with reasoning-length answers, whose lengths are long-tailed,
most of a call's steps decode a handful of rows. Here S slots stay busy until the queue of rows is empty:

- every prompt is encoded once (one prefill of the B prompts); its keys and values (or, for a linear-
  attention layer, its states) and its last logits are kept, and each of its G rows starts from them;
- a slot whose row ends (end of sequence, or the row's token budget) takes the next waiting row in the
  same step: the prompt's columns are written just left of the current cache column, the slot's earlier
  columns are masked out, and the row's first token is drawn from the prompt's logits at once, so every
  slot feeds a real token to every decode step;
- columns are written one per step for every slot, as in the episode loop (covey/rollout/fast_episodes.py);
  when the buffer is full, each slot's valid columns are packed to the left (`pack_cache`).

Sampling is independent of slots: row r's k-th token uses the k-th uniform of row r, from torch's global
generator (drawn step by step, N per draw, as the batch loop draws them, so the global stream advances by
the same draws) or from its prompt's seed. So a row's tokens do not depend on the slot it ran in or when it
started (up to the float rounding of a batch's composition, as when the batch loop drops finished rows),
and greedy tokens are the batch loop's (tests/rollout/test_slots.py).

Memory: S rows of prompt + longest budget + slack columns, where the batch loop holds N rows of prompt +
max_new_tokens. The buffers are per slot, not per token in flight (no paged blocks yet).
Families whose episode loop is refused (sliding windows: `loop_refusal`) decode in the batch loop.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from covey.models.hf_compat import last_positions, with_cache
from covey.rollout.decode_cache import buffer_cache, column_layers, held_bytes
from covey.rollout.fast_episodes import pack_cache
from covey.rollout.lean_decode import supports_lean_step
from covey.runtime.signals import check_abort


@dataclass
class SlotStats:
    """What one call's slots did: for the benchmark's useful row-steps and KV bytes per token in flight."""
    steps: int = 0
    """Decode steps (forwards of every busy slot)."""
    row_steps: int = 0
    """Sum over steps of the slots in the batch."""
    tokens: int = 0
    """Tokens sampled."""
    token_columns: int = 0
    """Sum over steps of the valid cache columns of every slot (prompt and response: the tokens in flight)."""
    cache_bytes: int = 0
    """Bytes the cache held (its buffers and states)."""

    @property
    def kv_bytes_per_token(self) -> float:
        """The cache's bytes over the mean tokens in flight."""
        return self.cache_bytes / max(self.token_columns / max(self.steps, 1), 1.0)


class SlotDecoder:
    """One `generate` call's rows through `slots` slots of `engine`'s model (a `FastEngine`)."""

    def __init__(self, engine, slots: int, greedy: bool):
        self.engine, self.slots, self.greedy = engine, slots, greedy
        self.stats = SlotStats()

    @torch.inference_mode()
    def run(self, prompt_ids: Tensor, prompt_mask: Tensor, index: Tensor, budgets: Tensor,
            uniforms) -> tuple[Tensor, Tensor]:
        """(N, steps) new tokens of rows `index` (each row's prompt), pad after a row's end, and each token's
        log-prob under the sampler's logits / temperature; row r samples at most budgets[r] tokens."""
        engine = self.engine
        device = next(engine.model.parameters()).device
        self.prompt_ids, self.prompt_mask = prompt_ids.to(device), prompt_mask.to(device)
        self.index, self.budgets, self.uniforms = index.to(device), budgets.to(device), uniforms
        n, width = len(index), prompt_ids.shape[1]
        longest = int(budgets.max()) if n else 0
        self.tokens = torch.full((n, max(longest, 1)), engine.tokenizer.pad_token_id, dtype=torch.long, device=device)
        self.logps = torch.zeros((n, max(longest, 1)), dtype=torch.float32, device=device)
        self.count = torch.zeros(n, dtype=torch.long, device=device)
        self.drawn = torch.zeros((0, n))  # row r's k-th uniform at [k, r], drawn as rows need them
        if n:
            self.loop(width, width + longest + max(64, longest // 4), device)
        steps = max(int(self.count.max()), 1) if n else 0
        return self.tokens[:, :steps].cpu(), self.logps[:, :steps].cpu()

    def prefill(self, capacity: int) -> None:
        """Encode every prompt once: its cache rows and last logits are what each of its rows starts from."""
        model = self.engine.model
        cache = buffer_cache(model, capacity)
        positions = (self.prompt_mask.cumsum(-1) - 1).clamp(min=0)
        out = model(input_ids=self.prompt_ids, attention_mask=self.prompt_mask, position_ids=positions,
                    **with_cache(cache), use_cache=True,
                    logits_to_keep=last_positions(1, self.prompt_ids.shape[1], self.prompt_ids.device))
        self.first_logits = out.logits[:, -1].float()
        every = torch.arange(len(self.prompt_ids), device=self.prompt_ids.device)
        self.saved = [layer.save_rows(every) for layer in cache.layers]
        self.cache = cache

    def loop(self, width: int, capacity: int, device) -> None:
        engine = self.engine
        self.prefill(capacity)
        count = min(self.slots, len(self.index))
        self.cache.batch_select_indices(self.index[:count])
        self.rows = torch.arange(count, device=device)       # the row in each slot, in cache order
        self.key_mask = torch.zeros((count, capacity), dtype=torch.long, device=device)
        self.key_mask[:, :width] = self.prompt_mask[self.index[:count]]
        self.position = self.prompt_mask[self.index[:count]].sum(-1)
        self.waiting, self.column, self.width = count, width, width
        logits = self.first_logits[self.index[:count]]
        lean = engine.lean and supports_lean_step(engine.model)
        while True:
            check_abort()  # a stop signal during the evaluation before training (covey/runtime/signals.py)
            step = self.sample(self.rows, logits)
            step = self.turn_over(step)
            if not len(self.rows):
                return
            if self.column == capacity:
                self.key_mask = pack_cache(self.cache, self.key_mask)
                self.column = max(int(self.key_mask.sum(1).max()), self.width)  # a new row's prompt fits left of it
                for layer in column_layers(self.cache):
                    layer.skip_to(self.column)
            self.key_mask[:, self.column] = 1
            self.record(len(self.rows))
            logits = engine.step_logits(step, self.position, self.key_mask[:, :self.column + 1], self.cache, lean)
            self.position, self.column = self.position + 1, self.column + 1

    def record(self, busy: int) -> None:
        s = self.stats
        s.steps, s.row_steps = s.steps + 1, s.row_steps + busy
        s.token_columns += int(self.key_mask.sum())
        s.cache_bytes = max(s.cache_bytes, held_bytes(self.cache))

    def sample(self, rows: Tensor, logits: Tensor) -> Tensor:
        """Each of `rows`' next token from its logits, with its own next uniform; recorded."""
        need = self.count[rows]
        while len(self.drawn) <= int(need.max()):  # the global stream advances as the batch loop's does
            self.drawn = torch.cat([self.drawn, self.uniforms.draw()[None]])
        drawn = self.drawn[need.cpu(), rows.cpu()].to(logits.device)
        step = self.engine.pick(logits, drawn, self.greedy)
        logp = torch.log_softmax(logits / self.engine.temperature, -1).gather(1, step[:, None]).squeeze(1)
        self.tokens[rows, need], self.logps[rows, need] = step, logp
        self.count[rows] += 1
        self.stats.tokens += len(rows)
        return step

    def ended(self, rows: Tensor, step: Tensor) -> Tensor:
        """Rows `rows` end with tokens `step`: an end of sequence, or their budget spent."""
        eos = torch.tensor(self.engine.eos, device=step.device)
        return torch.isin(step, eos) | (self.count[rows] >= self.budgets[rows])

    def turn_over(self, step: Tensor) -> Tensor:
        """Slots whose row ended take waiting rows (each row's first token drawn at once from its prompt's
        logits, again while a new row ends at its first token); slots left without a row leave the batch.
        Returns the token each remaining slot feeds."""
        done = self.ended(self.rows, step)
        while bool(done.any()) and self.waiting < len(self.index):
            slots = done.nonzero().squeeze(1)[:len(self.index) - self.waiting]
            new = torch.arange(self.waiting, self.waiting + len(slots), device=slots.device)
            self.waiting += len(slots)
            self.place(slots, new)
            first = self.sample(new, self.first_logits[self.index[new]])
            step[slots] = first
            done[slots] = self.ended(new, first)
        if bool(done.any()):
            keep = (~done).nonzero().squeeze(1)
            self.cache.batch_select_indices(keep)
            self.rows, self.key_mask, self.position, step = (self.rows[keep], self.key_mask[keep],
                                                            self.position[keep], step[keep])
        return step

    def place(self, slots: Tensor, rows: Tensor) -> None:
        """Slots `slots` start rows `rows`: their prompt's columns end at the current column."""
        groups = self.index[rows]
        for layer, saved in zip(self.cache.layers, self.saved, strict=True):
            layer.place_rows(slots, saved, groups, self.column)
        self.key_mask[slots] = 0
        self.key_mask[slots, self.column - self.width:self.column] = self.prompt_mask[groups]
        self.position[slots] = self.prompt_mask[groups].sum(-1)
        self.rows[slots] = rows
