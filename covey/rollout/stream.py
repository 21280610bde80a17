"""A stream of jobs through the slot loop (`Engine.serve_rows`, the policy server's engine thread): each job's
prompt joins the running decode as slots free up, instead of waiting for a call to end.

covey/rollout/slots.py's `SlotDecoder` decodes one call's rows, every prompt known when the call starts.
`StreamDecoder` is the same loop (its decode step, its packing, its refill of a slot whose row ended) over
rows that arrive while it runs:

- admission: at each step with free slots, the loop takes the jobs its source (`RowSource`) has waiting,
  never waiting for one; their prompts are encoded in one forward (left-padded to the widest of them), and
  each prompt's keys and values (or states) and last logits are saved, as a call's prompts are;
- placement: a job's rows wait in order for a slot; a slot whose row ended takes the next at once, its
  prompt's columns ending at the current column (`place`); while rows still wait and fewer than the limit
  run (rollout.slots, else the source's `max_rows`), the batch grows by new slots. A prompt wider than the
  current column moves the column on: the columns between are holes, masked out for every row;
- capacity: the buffers are sized for the first jobs (prompt + budget + slack, as a call's) and widened for a
  later job that would not fit; columns are packed as in a call's loop;
- results: a row's tokens, log-probs and whether it was cut go back to its job, whose samples go to the
  source once its n rows have ended. A job whose prompt fails to encode fails alone (its group is encoded
  again job by job); a decode step that raises fails the jobs admitted then, and the stream goes on.

Sampling is the engine's: a greedy row takes the argmax; a sampled row g of a job takes its k-th token from the
k-th draw of n uniforms of the job's own generator (seeded by the job's seed), as `FastEngine.generate` draws
a prompt's with per-prompt seeds. So a job's tokens do not depend on what runs beside it or when it joined
(up to the float rounding of a batch's composition: tests/rollout/test_stream.py).

A stream verifies no n-gram drafts (rollout.speculate): its rows decode one token a step.

`serve_stream` returns once no row runs and the source gives nothing; a source that drains gives nothing, so
its admitted rows end first (the policy server swaps weights between two streams).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from covey.models.attention import sampling_attention
from covey.rollout.base import RowJob, RowSource, Sample, encode_prompts
from covey.rollout.decode_cache import column_layers
from covey.rollout.lean_decode import supports_lean_step
from covey.rollout.slots import SlotDecoder, prefill_prompts
from covey.runtime.signals import check_abort


def slack_of(budget: int) -> int:
    """Columns a buffer holds beyond a row's prompt and budget (a call's, slots.AnswerRows): room for the holes
    and new prompts between two packings."""
    return max(64, budget // 4)


def widen(cache, capacity: int) -> None:
    """The full-attention buffers of `cache` grow to `capacity` columns, their filled columns kept."""
    for layer in column_layers(cache):
        if layer.is_initialized and layer.key_buf.shape[2] < capacity:
            grown = []
            for buf in (layer.key_buf, layer.value_buf):
                more = buf.new_zeros(buf.shape[0], buf.shape[1], capacity - buf.shape[2], buf.shape[3])
                grown.append(torch.cat([buf, more], dim=2))
            layer.key_buf, layer.value_buf = grown
        layer.capacity = max(layer.capacity, capacity)
        layer.skip_to(layer.filled)  # the views over the new buffers


class JobDraws:
    """A job's uniforms: draw k is n uniforms of its own generator, as `sampling.Uniforms` draws a seeded prompt's;
    row g's k-th token takes draw k's g-th."""

    def __init__(self, seed: int, n: int):
        self.generator, self.n = torch.Generator().manual_seed(int(seed)), n
        self.table = torch.zeros((0, n))

    def take(self, g: int, k: int) -> float:
        while len(self.table) <= k:
            self.table = torch.cat([self.table, torch.rand(self.n, generator=self.generator)[None]])
        return float(self.table[k, g])


@dataclass(eq=False)
class JobRows:
    """An admitted job: its draws, its rows' samples so far, how many rows are still to end."""
    job: RowJob
    draws: JobDraws
    samples: list = field(default_factory=list)
    left: int = 0


@dataclass(eq=False)
class Admission:
    """Prompts encoded in one forward: each one's saved cache rows and last logits (B, V), kept until every row
    of theirs has a slot, and their mask (B, w), left-padded."""
    owners: list[JobRows]
    saved: list | None
    logits: Tensor | None
    mask: Tensor
    unplaced: int = 0

    @property
    def width(self) -> int:
        return self.mask.shape[1]


@dataclass(eq=False)
class StreamRow:
    """Row g of a job: where its prompt was saved (`admission`, row `source`), its tokens and log-probs so far."""
    owner: JobRows
    g: int
    admission: Admission
    source: int
    tokens: list[int] = field(default_factory=list)
    logps: list[float] = field(default_factory=list)


class StreamRows:
    """The stream's rows as the slot loop's rows object (what `AnswerRows` is to a call): each row's next token,
    and each job's samples handed to the source as its last row ends."""

    def __init__(self, engine, source: RowSource):
        self.engine, self.source = engine, source
        self.rows: dict[int, StreamRow] = {}  # the rows admitted and not yet ended, by id
        self.admitted = 0
        self.open: list[JobRows] = []  # jobs taken from the source and not yet answered
        self.eos = set(engine.eos)
        self.sampled = 0

    def register(self, jobs: list[RowJob]) -> list[JobRows]:
        owners = [JobRows(j, JobDraws(j.seed, j.n), [None] * j.n, j.n) for j in jobs]
        self.open += owners
        return owners

    def fail(self, owner: JobRows, error: BaseException) -> None:
        if owner in self.open:
            self.open.remove(owner)
            self.source.fail(owner.job, error)

    def fail_all(self, error: BaseException) -> None:
        for owner in list(self.open):
            self.fail(owner, error)

    def admit(self, admission: Admission) -> list[int]:
        """The ids of the admission's rows, job by job, each job's in row order."""
        ids = []
        for i, owner in enumerate(admission.owners):
            for g in range(owner.job.n):
                ids.append(self.admitted)
                self.rows[self.admitted] = StreamRow(owner, g, admission, i)
                self.admitted += 1
        admission.unplaced = len(ids)
        return ids

    def inputs(self, ids: list[int], logits: Tensor) -> tuple[list[int], list[bool], list[bool]]:
        """Each row's token for this step, whether it is fed (its answer goes on) and whether the row ended."""
        picked, logp = self.sample(ids, logits)
        going = [self.take(r, token, lp) for r, token, lp in zip(ids, picked, logp)]
        return picked, going, [not g for g in going]

    def sample(self, ids: list[int], logits: Tensor) -> tuple[list[int], list[float]]:
        """Greedy rows' argmax, sampled rows' draw from their job's uniforms; each token's log-prob under
        logits / temperature (the engine's, as `AnswerRows.sample`)."""
        rows = [self.rows[r] for r in ids]
        picked = logits.argmax(dim=-1)
        drawn = [j for j, row in enumerate(rows) if not row.owner.job.greedy]
        if drawn:
            uniforms = torch.tensor([rows[j].owner.draws.take(rows[j].g, len(rows[j].tokens)) for j in drawn])
            at = torch.tensor(drawn, device=logits.device)
            picked[at] = self.engine.pick(logits[at], uniforms.to(logits.device), False)
        logp = torch.log_softmax(logits / self.engine.temperature, -1).gather(1, picked[:, None]).squeeze(1)
        self.sampled += len(ids)
        return picked.tolist(), logp.tolist()

    def take(self, r: int, token: int, logp: float) -> bool:
        """Add a token to row r; whether it goes on (else its sample is its job's, and the row is forgotten)."""
        row = self.rows[r]
        row.tokens.append(token)
        row.logps.append(logp)
        if token not in self.eos and len(row.tokens) < row.owner.job.max_tokens:
            return True
        owner = self.rows.pop(r).owner
        owner.samples[row.g] = Sample(row.tokens, row.logps, token not in self.eos)
        owner.left -= 1
        if not owner.left:
            self.open.remove(owner)
            self.source.finish(owner.job, owner.samples)
        return False


class StreamDecoder(SlotDecoder):
    """The slot loop over a stream (module docstring): slots refilled from the jobs that arrive while it runs."""

    def __init__(self, engine, source: RowSource):
        limit = source.max_rows if engine.slots <= 0 else min(engine.slots, source.max_rows)
        super().__init__(engine, max(limit, 1), StreamRows(engine, source))
        self.source, self.stream = source, self.policy
        self.device = next(engine.model.parameters()).device
        self.queue: list[int] = []  # admitted rows waiting for a slot, in order
        self.width = self.column = self.capacity = 0

    def serve(self, jobs: list[RowJob]) -> None:
        """Decode `jobs` and what the source gives while they run, until no row runs and the source gives none."""
        admitted = self.encode(self.stream.register(jobs))
        if not admitted:
            return
        (first, self.cache), later = admitted[0], admitted[1:]
        self.queue = self.stream.admit(first)
        count = min(self.slots, len(self.queue))
        placed, self.queue = self.queue[:count], self.queue[count:]
        sources = torch.tensor([self.stream.rows[r].source for r in placed], device=self.device)
        logits = first.logits[sources]
        self.capacity = max(first.width + o.job.max_tokens + slack_of(o.job.max_tokens) for o in first.owners)
        widen(self.cache, self.capacity)
        self.cache.batch_select_indices(sources)  # the first rows start where the prefill left their prompts
        self.key_mask = torch.zeros((count, self.capacity), dtype=torch.long, device=self.device)
        self.key_mask[:, :first.width] = first.mask[sources]
        self.position = first.mask[sources].sum(-1)
        self.width = self.column = first.width
        self.rows = placed
        self.placed(placed)
        for admission, _ in later:
            self.fit(admission)
        lean = self.engine.lean and supports_lean_step(self.engine.model)
        while True:
            check_abort()
            tokens, valid = self.turn_over(*self.inputs(self.rows, logits))
            if not self.rows:
                return
            logits = self.step(tokens, valid, lean)

    def encode(self, owners: list[JobRows]) -> list[tuple[Admission, object]]:
        """One forward over the prompts of `owners` (Admission, its cache); if it raises, each job alone, and a
        job whose own forward raises fails alone. A job that asks for no rows or no tokens fails at once."""
        good = []
        for owner in owners:
            job = owner.job
            if job.n < 1 or job.max_tokens < 1 or not len(job.prompt_ids):
                self.stream.fail(owner, ValueError(f"serve_rows: a job needs a prompt, n >= 1 and max_tokens >= 1, "
                                                   f"not {len(job.prompt_ids)} ids, n={job.n}, "
                                                   f"max_tokens={job.max_tokens}"))
            else:
                good.append(owner)
        if not good:
            return []
        try:
            enc = encode_prompts(self.engine.tokenizer, [o.job.prompt_ids for o in good])
            ids, mask = enc["input_ids"].to(self.device), enc["attention_mask"].to(self.device)
            cache, logits, saved = prefill_prompts(self.engine.model, ids, mask, ids.shape[1])
        except Exception as e:  # noqa: BLE001 - a bad prompt fails its own job only
            if len(good) == 1:
                self.stream.fail(good[0], e)
                return []
            return [a for owner in good for a in self.encode([owner])]
        return [(Admission(good, saved, logits, mask), cache)]

    def admit(self, busy: int) -> None:
        """Take what the source has for the free slots (rows not running or waiting), encoded and queued."""
        room = self.slots - busy - len(self.queue)
        jobs = self.source.take(room) if room > 0 else []
        if jobs:
            for admission, _ in self.encode(self.stream.register(jobs)):
                self.fit(admission)

    def fit(self, admission: Admission) -> None:
        """Queue the admission's rows; widen the buffers first where one of them would not fit."""
        self.queue += self.stream.admit(admission)
        self.width = max(self.width, admission.width)
        budget = max(o.job.max_tokens for o in admission.owners)
        need = admission.width + budget
        if need + slack_of(budget) // 2 > self.capacity:
            self.capacity = need + slack_of(budget)
            widen(self.cache, self.capacity)
            more = self.capacity - self.key_mask.shape[1]
            self.key_mask = torch.cat([self.key_mask, self.key_mask.new_zeros(len(self.key_mask), more)], dim=1)

    def turn_over(self, tokens: list[int], valid: list[bool], done: list[bool]) -> tuple[list[int], list[bool]]:
        """New jobs admitted; slots whose row ended take waiting rows (each new row's first token drawn at once,
        again while a new row ends at its first), then new slots while rows wait under the limit; slots left
        without a row leave the batch. Returns each remaining slot's token and whether it is fed."""
        self.admit(len(done) - sum(done))
        free, pad = [j for j, d in enumerate(done) if d], self.engine.tokenizer.pad_token_id
        while self.queue and (free or len(self.rows) < self.slots):
            if not free:
                free = self.grow(min(len(self.queue), self.slots - len(self.rows)))
                tokens, valid, done = tokens + [pad] * len(free), valid + [False] * len(free), done + [True] * len(free)
            slots, new = free[:len(self.queue)], self.queue[:len(free)]
            del self.queue[:len(slots)]
            logits = torch.stack([self.stream.rows[r].admission.logits[self.stream.rows[r].source] for r in new])
            self.place(slots, new)
            first, fed, over = self.inputs(new, logits)
            for j, slot in enumerate(slots):
                tokens[slot], valid[slot], done[slot] = first[j], fed[j], over[j]
            free = [slot for slot in slots if done[slot]] + free[len(slots):]
        return self.drop(tokens, valid, done)

    def grow(self, count: int) -> list[int]:
        """`count` new slots at the end of the batch (copies of slot 0, masked out until a row is placed)."""
        n = len(self.rows)
        self.cache.batch_select_indices(torch.cat([torch.arange(n), torch.zeros(count, dtype=torch.long)]).to(
            self.device))
        self.key_mask = torch.cat([self.key_mask, self.key_mask.new_zeros(count, self.key_mask.shape[1])])
        self.position = torch.cat([self.position, self.position.new_zeros(count)])
        self.rows = self.rows + [-1] * count
        return list(range(n, n + count))

    def place(self, slots: list[int], rows: list[int]) -> None:
        """Slots `slots` start rows `rows`: each prompt's columns end at the current column, moved on first to
        the widest of their prompts."""
        of = [self.stream.rows[r] for r in rows]
        widest = max(row.admission.width for row in of)
        if self.column < widest:
            for layer in column_layers(self.cache):
                layer.skip_to(widest)
            self.column = widest
        for admission in dict.fromkeys(row.admission for row in of):
            pairs = [(s, row.source) for s, row in zip(slots, of) if row.admission is admission]
            slots_t = torch.tensor([s for s, _ in pairs], device=self.device)
            sources = torch.tensor([i for _, i in pairs], device=self.device)
            self.write_prompts(slots_t, admission.saved, sources, admission.mask[sources])
        for slot, row in zip(slots, rows):
            self.rows[slot] = row
        self.placed(rows)

    def placed(self, rows: list[int]) -> None:
        """Rows that have slots: an admission whose every row has one frees its saved prompts."""
        for r in rows:
            admission = self.stream.rows[r].admission
            admission.unplaced -= 1
            if not admission.unplaced:
                admission.saved = admission.logits = None


@torch.inference_mode()
def serve_stream(engine, source: RowSource) -> None:
    """`FastEngine.serve_rows`: streams of `source`'s jobs through the engine's slot loop until the source gives
    none; a stream that raises fails the jobs it had taken, and the next stream starts afresh."""
    was_training = engine.model.training
    engine.model.eval()
    try:
        with sampling_attention(engine.model):
            while True:
                decoder = StreamDecoder(engine, source)
                jobs = source.take(decoder.slots)
                if not jobs:
                    return
                try:
                    decoder.serve(jobs)
                except Exception as e:  # noqa: BLE001 - the jobs it ran fail; the source's others go on
                    decoder.stream.fail_all(e)
    finally:
        engine.model.train(was_training)
