"""Rows through slots: the fast engine's one decode loop, for single answers and for whole tool episodes.

A call's N rows decode in S slots (rollout.slots; every row at once when S = 0 or S >= N), and a row that
ends gives its slot to the next waiting row at once:

- every prompt is encoded once (one prefill of the B prompts); its keys and values (or, for a linear-
  attention layer, its states) and its last logits are kept, and each of its G rows starts from them;
- a slot whose row ends (end of sequence, its token budget, or an episode's last turn) takes the next
  waiting row in the same step: the prompt's columns are written just left of the current cache column,
  the slot's earlier columns are masked out, and the row's first token is drawn from the prompt's logits
  at once, so a slot feeds a real token to the next decode step;
- columns are written one per step for every slot; when the buffer is full, each slot's valid columns are
  packed to the left (`pack_cache`: rotary positions travel inside the keys, position ids are per row).

What a row feeds at a step is its kind's (the `rows` object): a single answer samples until its end
(`AnswerRows`, here); an episode samples its turn, waits while its tools run (a hole: the step's column
is masked out for it and a linear-attention state is held still) and then feeds the tools' reply as
forced tokens through the same decode step (`EpisodeRows`, covey/rollout/fast_episodes.py). So tool
episodes and long answers share one loop, one cache and one refill.

Sampling is independent of slots: row r's k-th sampled token uses the k-th uniform of row r (`RowUniforms`,
covey/rollout/sampling.py: from torch's global generator, N per draw as the batch loop draws them, or from
its prompt's seed). So a row's tokens do not depend on the slot it ran in or when it started (up to the float
rounding of a batch's composition), and greedy tokens are the batch loop's (tests/rollout/test_slots.py).

Memory: S rows of prompt + the longest row's columns + slack, where the batch loop holds N rows of prompt +
max_new_tokens. Single answers on the lean step keep their keys in blocks instead (covey/rollout/paged.py):
memory by the tokens in flight, as many rows at once as those blocks hold.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from covey.models.hf_compat import last_positions, with_cache
from covey.rollout.decode_cache import buffer_cache, column_layers, held_bytes, rows_held
from covey.rollout.lean_decode import supports_lean_step
from covey.rollout.sampling import RowUniforms
from covey.rollout.speculate import SPECULATE_TOKENS, accepted_counts
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
    drafted: int = 0
    """Draft tokens verified (rollout.speculate)."""
    accepted: int = 0
    """Draft tokens accepted."""
    block_columns: int = 0
    """Paged KV (covey/rollout/paged.py): sum over steps of the positions in the blocks in use."""
    row_block_columns: int = 0
    """Paged KV: sum over steps and rows of the positions in each row's blocks (a shared block once per row)."""
    position_bytes: int = 0
    """Paged KV: bytes of one position's keys and values over every layer."""
    preempted: int = 0  # paged KV: rows that left the batch for want of blocks (encoded again later)
    widest: int = 0  # paged KV: the most rows a step decoded

    @property
    def kv_bytes_per_token(self) -> float:
        """The cache's bytes over the mean tokens in flight; with paged KV, the blocks in use over them."""
        if self.block_columns:
            return self.position_bytes * self.block_columns / max(self.token_columns, 1)
        return self.cache_bytes / max(self.token_columns / max(self.steps, 1), 1.0)


class AnswerRows:
    """Single answers: each row samples until an end-of-sequence token or its budget; (N, L) tokens and log-probs.
    With a `drafter` (covey/rollout/speculate.py), small steps also verify n-gram drafts."""

    def __init__(self, engine, budgets: Tensor, greedy: bool, drafter=None, quorum=None):
        """`quorum` (covey/rollout/base.py `Quorum`): the call stops once enough groups have ended."""
        self.engine, self.budgets, self.greedy = engine, budgets.tolist(), greedy
        self.quorum, self.over = quorum, set()  # over: the rows that have ended
        if quorum is not None:
            self.left = {}  # rows of each group still to end
            for g in quorum.groups:
                self.left[g] = self.left.get(g, 0) + 1
            self.groups_over, self.must_left = 0, len(set(quorum.must) & set(self.left))
        n, longest = len(self.budgets), max(self.budgets, default=1)
        self.columns, self.slack = longest, max(64, longest // 4)
        self.tokens = torch.full((n, max(longest, 1)), engine.tokenizer.pad_token_id, dtype=torch.long)
        self.logps = torch.zeros((n, max(longest, 1)), dtype=torch.float32)
        self.count = [0] * n
        self.drawn = [0] * n  # uniforms used: a row's k-th token takes its k-th uniform unless it speculates
        self.eos = set(engine.eos)
        self.upfront = 0
        self.sampled = 0
        self.drafter, self.ban, self.ended = drafter, {}, set()

    def draw_from(self, uniforms: RowUniforms) -> None:
        """Where each row's k-th uniform comes from (set by the decoder at the start of a call)."""
        self.uniforms = uniforms

    def poll(self) -> None:
        """Nothing runs beside the decode steps."""

    def all_waiting(self, rows: list[int]) -> bool:
        return False

    def end(self, r: int) -> None:
        """Row r has ended (end of sequence or budget): its group's count of rows still going falls."""
        if r in self.over:
            return
        self.over.add(r)
        if self.quorum is not None:
            g = self.quorum.groups[r]
            self.left[g] -= 1
            if not self.left[g]:
                self.groups_over += 1
                self.must_left -= g in self.quorum.must

    def enough(self) -> bool:
        """The quorum is met: the call stops, and the rows still going are cut."""
        return self.quorum is not None and self.groups_over >= self.quorum.needed and not self.must_left

    def cut(self) -> list[bool]:
        """Each row: stopped by the quorum before its end (or never started)."""
        return [r not in self.over for r in range(len(self.budgets))]

    def wait(self) -> None:
        """Never called: an answer never waits."""

    def inputs(self, rows: list[int], logits: Tensor) -> tuple[list[int], list[bool], list[bool]]:
        """Each row's token for this step, whether it is fed (its answer goes on) and whether the row ended
        (a row that ended inside an accepted draft samples nothing)."""
        live = [j for j, r in enumerate(rows) if r not in self.ended]
        picked, done = [self.engine.tokenizer.pad_token_id] * len(rows), [True] * len(rows)
        if live:
            tokens, logp = self.sample([rows[j] for j in live], logits[live])
            for j, token, lp in zip(live, tokens, logp):
                picked[j], done[j] = token, not self.take(rows[j], token, lp)
                if done[j]:
                    self.end(rows[j])
        return picked, [not d for d in done], done

    def take(self, r: int, token: int, logp: float) -> bool:
        """Add a token to row r's answer; whether the answer goes on."""
        self.tokens[r, self.count[r]], self.logps[r, self.count[r]] = token, logp
        self.count[r] += 1
        if self.drafter is not None:
            self.drafter.add_row(r, [token])
        return token not in self.eos and self.count[r] < self.budgets[r]

    def sample(self, rows: list[int], logits: Tensor) -> tuple[list[int], list[float]]:
        drawn = self.uniforms.take(rows, [self.drawn[r] for r in rows]).to(logits.device)
        picked = self.engine.pick(logits, drawn, self.greedy, [self.ban.pop(r, None) for r in rows])
        logp = torch.log_softmax(logits / self.engine.temperature, -1).gather(1, picked[:, None]).squeeze(1)
        for r in rows:
            self.drawn[r] += 1
        self.sampled += len(rows)
        return picked.tolist(), logp.tolist()

    def drafts(self, rows: list[int]) -> list[list[int]] | None:
        """Each row's draft for this step, or None: no drafter, a step too wide to pay, or no draft at all."""
        if self.drafter is None or len(rows) * (self.drafter.k + 1) > SPECULATE_TOKENS or not self.drafter.paying():
            return None
        out = [self.drafter.draft(r, self.budgets[r] - self.count[r]) for r in rows]
        return out if any(out) else None

    def accept(self, rows: list[int], logits: Tensor, drafts: list[list[int]]) -> tuple[list[int], Tensor]:
        """Verify each row's draft against the block's logits (n, m+1, V): the draft tokens each row keeps
        (up to an end of sequence or its budget) and the logits its next token is drawn from."""
        n, m = len(rows), max(len(d) for d in drafts)
        lengths = torch.tensor([len(d) for d in drafts])
        padded = torch.tensor([d + [0] * (m - len(d)) for d in drafts], dtype=torch.long)
        probs = self.engine.next_token_probs(logits.reshape(n * (m + 1), -1)).view(n, m + 1, -1)
        uniforms = self.uniforms.take([r for r in rows for _ in range(m)],
                                      [self.drawn[r] + i for r in rows for i in range(m)]).view(n, m)
        counts = accepted_counts(probs.cpu(), padded, lengths, uniforms, self.greedy).tolist()
        logp = torch.log_softmax(logits[:, :m] / self.engine.temperature, -1)
        logp = logp.gather(2, padded.to(logits.device)[..., None]).squeeze(2).tolist()
        kept = []
        for j, r in enumerate(rows):
            self.drawn[r] += len(drafts[j])
            a, going = 0, True
            while going and a < counts[j]:
                going = self.take(r, drafts[j][a], logp[j][a])
                a += 1
            if not going:
                self.ended.add(r)
                self.end(r)
            elif a < len(drafts[j]):
                self.ban[r] = drafts[j][a]  # its next token comes from the residual
            kept.append(a)
        self.drafter.drafted += int(lengths.sum())
        self.drafter.accepted += sum(kept)
        return kept, logits[torch.arange(n, device=logits.device), torch.tensor(kept, device=logits.device)]

    def result(self) -> tuple[Tensor, Tensor]:
        if self.drafter is not None:
            self.drafter.close([self.tokens[r, :c].tolist() for r, c in enumerate(self.count)])
        steps = max(max(self.count, default=1), 1)
        return self.tokens[:, :steps], self.logps[:, :steps]


class SlotDecoder:
    """One call's rows through `slots` slots of `engine`'s model (a `FastEngine`); `rows`: what each row feeds
    (`AnswerRows`, or fast_episodes' `EpisodeRows`)."""

    def __init__(self, engine, slots: int, rows):
        self.engine, self.slots, self.policy = engine, slots, rows
        self.stats = SlotStats()

    @torch.inference_mode()
    def run(self, prompt_ids: Tensor, prompt_mask: Tensor, index: Tensor, uniforms):
        """Decode rows `index` (each row's prompt among `prompt_ids`); the rows object holds what they gave."""
        begin_call(self, prompt_ids, prompt_mask, index, uniforms)
        if len(index):
            width = prompt_ids.shape[1]
            self.loop(width, width + self.policy.columns + self.policy.slack)
        drafter = getattr(self.policy, "drafter", None)
        if drafter is not None:
            self.stats.drafted, self.stats.accepted = drafter.drafted, drafter.accepted
        return self.policy.result()

    def prefill(self, capacity: int) -> None:
        """Encode every prompt once: its cache rows and last logits are what each of its rows starts from."""
        self.cache, self.first_logits, self.saved = prefill_prompts(self.engine.model, self.prompt_ids,
                                                                    self.prompt_mask, capacity)

    def loop(self, width: int, capacity: int) -> None:
        engine, device = self.engine, self.device
        self.prefill(capacity)
        count = len(self.index) if self.slots <= 0 else min(self.slots, len(self.index))
        self.cache.batch_select_indices(self.index[:count])
        self.stats.cache_bytes = held_bytes(self.cache)  # its largest: the buffers never grow, slots only leave
        self.rows = list(range(count))  # the row in each slot, in cache order
        self.key_mask = torch.zeros((count, capacity), dtype=torch.long, device=device)
        self.key_mask[:, :width] = self.prompt_mask[self.index[:count]]
        self.position = self.prompt_mask[self.index[:count]].sum(-1)
        self.waiting, self.column, self.width = count, width, width
        logits = self.first_logits[self.index[:count]]
        lean = engine.lean and supports_lean_step(engine.model)
        self.capacity = capacity
        while True:
            check_abort()  # a stop signal during the evaluation before training (covey/runtime/signals.py)
            self.policy.poll()
            if self.rows and self.policy.all_waiting(self.rows):
                self.policy.wait()
                continue
            tokens, valid = self.turn_over(*self.inputs(self.rows, logits))
            if not self.rows or self.policy.enough():  # every row ended, or a quorum of groups (the rest cut)
                return
            drafts = self.policy.drafts(self.rows)
            logits = self.step(tokens, valid, lean) if drafts is None else self.speculate(tokens, drafts)

    def step(self, tokens: list[int], valid: list[bool], lean: bool) -> Tensor:
        """One column for every slot: its token, fed or (a hole) not; the logits after it."""
        device = self.device
        if self.column == self.capacity:
            self.pack()
        valid_t = torch.tensor(valid, device=device)
        self.key_mask[:, self.column] = valid_t.long()
        self.record(sum(valid))
        with rows_held(self.cache, ~valid_t):
            logits = self.engine.step_logits(torch.tensor(tokens, device=device), self.position,
                                             self.key_mask[:, :self.column + 1], self.cache, lean)
        self.position, self.column = self.position + valid_t.long(), self.column + 1
        return logits

    def speculate(self, tokens: list[int], drafts: list[list[int]]) -> Tensor:
        """m + 1 columns for every slot: its token and its draft (covey/rollout/speculate.py), verified in one
        forward; the columns of rejected drafts are masked out. The logits each row's next token comes from."""
        device, m, pad = self.device, max(len(d) for d in drafts), self.engine.tokenizer.pad_token_id
        if self.column + m + 1 > self.capacity:
            self.pack()
        block = torch.tensor([[t, *d] + [pad] * (m - len(d)) for t, d in zip(tokens, drafts)], device=device)
        columns = slice(self.column, self.column + m + 1)
        self.key_mask[:, columns] = torch.tensor([[1] * (1 + len(d)) + [0] * (m - len(d)) for d in drafts],
                                                 device=device)
        self.record(len(tokens))
        steps = torch.arange(m + 1, device=device)
        logits = self.engine.block_logits(block, self.position[:, None] + steps, self.key_mask[:, :columns.stop],
                                          self.cache)
        kept, logits = self.policy.accept(self.rows, logits, drafts)
        kept_t = torch.tensor(kept, device=device)
        self.key_mask[:, columns] = (steps[None, :] <= kept_t[:, None]).long()
        self.position, self.column = self.position + 1 + kept_t, columns.stop
        return logits

    def inputs(self, rows: list[int], logits: Tensor) -> tuple[list[int], list[bool], list[bool]]:
        tokens, valid, done = self.policy.inputs(rows, logits)
        self.stats.tokens = self.policy.sampled
        return list(tokens), list(valid), list(done)

    def pack(self) -> None:
        """The buffer is full: each slot's valid columns move left; a new row's prompt still fits left of the
        next column."""
        self.key_mask = pack_cache(self.cache, self.key_mask)
        self.column = max(int(self.key_mask.sum(1).max()), self.width)
        for layer in column_layers(self.cache):
            layer.skip_to(self.column)

    def record(self, busy: int) -> None:
        s = self.stats
        s.steps, s.row_steps = s.steps + 1, s.row_steps + busy
        s.token_columns += int(self.key_mask.sum())

    def turn_over(self, tokens: list[int], valid: list[bool], done: list[bool]) -> tuple[list[int], list[bool]]:
        """Slots whose row ended take waiting rows (each new row's first input drawn at once from its prompt's
        logits, again while a new row ends at its first); slots left without a row leave the batch. Returns
        each remaining slot's token and whether it is fed."""
        ended = [j for j, d in enumerate(done) if d]
        while ended and self.waiting < len(self.index) and not self.policy.enough():
            slots = ended[:len(self.index) - self.waiting]
            new = list(range(self.waiting, self.waiting + len(slots)))
            self.waiting += len(slots)
            self.place(slots, new)
            first, fed, over = self.inputs(new, self.first_logits[self.index[new]])
            for j, slot in enumerate(slots):
                tokens[slot], valid[slot], done[slot] = first[j], fed[j], over[j]
            ended = [slot for slot in slots if done[slot]]
        return self.drop(tokens, valid, done)

    def drop(self, tokens: list[int], valid: list[bool], done: list[bool]) -> tuple[list[int], list[bool]]:
        """Slots whose row ended (and took no other) leave the batch; the others' tokens and whether each is fed."""
        if any(done):
            keep = [j for j, d in enumerate(done) if not d]
            keep_t = torch.tensor(keep, dtype=torch.long, device=self.device)
            self.cache.batch_select_indices(keep_t)
            self.key_mask, self.position = self.key_mask[keep_t], self.position[keep_t]
            self.rows, tokens, valid = ([seq[j] for j in keep] for seq in (self.rows, tokens, valid))
        return tokens, valid

    def place(self, slots: list[int], rows: list[int]) -> None:
        """Slots `slots` start rows `rows`: their prompt's columns end at the current column."""
        slots_t, groups = torch.tensor(slots, device=self.device), self.index[rows]
        self.write_prompts(slots_t, self.saved, groups, self.prompt_mask[groups])
        for slot, row in zip(slots, rows):
            self.rows[slot] = row

    def write_prompts(self, slots_t: Tensor, saved: list, sources: Tensor, mask: Tensor) -> None:
        """Slots `slots_t` take saved prompts `sources` (per layer `saved`; their masks `mask` (n, width)): the
        prompts' columns end at the current column, the slots' earlier columns are masked out."""
        for layer, held in zip(self.cache.layers, saved, strict=True):
            layer.place_rows(slots_t, held, sources, self.column)
        self.key_mask[slots_t] = 0
        self.key_mask[slots_t, self.column - mask.shape[1]:self.column] = mask
        self.position[slots_t] = mask.sum(-1)


def begin_call(decoder, prompt_ids: Tensor, prompt_mask: Tensor, index: Tensor, uniforms) -> None:
    """A decoder's call (`SlotDecoder`, paged.py's `PagedDecoder`): the model's device, the prompts and each row's
    prompt there, and where each row's k-th uniform comes from."""
    decoder.device = device = next(decoder.engine.model.parameters()).device
    decoder.prompt_ids, decoder.prompt_mask = prompt_ids.to(device), prompt_mask.to(device)
    decoder.index = index.to(device)
    decoder.policy.draw_from(RowUniforms(uniforms, len(index), decoder.policy.upfront))


def prefill_prompts(model, prompt_ids: Tensor, prompt_mask: Tensor, capacity: int) -> tuple:
    """Encode prompts (B, P) once into a new cache of `capacity` columns: (the cache, each prompt's last logits
    (B, V) in float32, each layer's saved rows of every prompt: what its rows start from)."""
    cache = buffer_cache(model, capacity)
    positions = (prompt_mask.cumsum(-1) - 1).clamp(min=0)
    out = model(input_ids=prompt_ids, attention_mask=prompt_mask, position_ids=positions, **with_cache(cache),
                use_cache=True, logits_to_keep=last_positions(1, prompt_ids.shape[1], prompt_ids.device))
    every = torch.arange(len(prompt_ids), device=prompt_ids.device)
    return cache, out.logits[:, -1].float(), [layer.save_rows(every) for layer in cache.layers]


def pack_cache(cache, key_mask: Tensor) -> Tensor:
    """Move each row's valid cache columns to the right end of the smallest width that holds them all
    (left padding, as after a prefill); returns the new key mask (n, capacity). Linear-attention states
    have no columns: they stay."""
    valid = key_mask.bool()
    counts = valid.sum(1)
    width = int(counts.max())
    # source column of each destination slot: the row's valid columns in order, column 0 where padding
    order = torch.sort((~valid).to(torch.int8), dim=1, stable=True).indices  # valid columns first, in order
    slot = torch.arange(width, device=key_mask.device)[None, :] - (width - counts)[:, None]
    source = torch.where(slot >= 0, order.gather(1, slot.clamp(min=0)), torch.zeros_like(slot))
    for layer in column_layers(cache):
        layer.take_columns(source, width)
    packed = torch.zeros_like(key_mask)
    packed[:, :width] = (slot >= 0).to(key_mask.dtype)
    return packed
