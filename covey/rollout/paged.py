"""Paged keys and values: a call's KV memory grows with the tokens in flight, not with rows x longest budget.

The slot loop (covey/rollout/slots.py) gives each slot a buffer of prompt + longest budget + slack columns,
so a long-tailed call holds several times the keys its rows have written. Here every full-attention layer
keeps its keys and values in blocks of `BLOCK` positions, and each running row has a list of block ids:

- a prompt is encoded once and written into blocks; its G rows share its full blocks (reference counts,
  no copy) and each copies the prompt's last, partly filled block, which it then fills with its own
  tokens (a write never lands in a shared block);
- a row takes a new block when it has filled its last one, and gives back every block at its end;
- the block ids are a call's budget: the rows `slots` holds at full length (prompt + longest budget), plus
  the prompts. Rows are admitted while blocks are free beyond one per running row (each may need one at
  the next step), so a call runs as many rows at once as their tokens allow, not `slots`;
- when a row needs a block and none is free, the row admitted last leaves the batch (preempted, as in
  vLLM's recompute): its blocks are freed, and it waits at the head of the queue. When blocks are free
  again it is encoded again from its prompt and the tokens it has fed, and goes on with the token it was
  about to feed. Its sampled tokens and their log-probs are kept; the keys encoded again can differ from
  the first ones by float rounding (a prefill against single steps), as a batch's composition can;
- the pools are (heads, blocks, BLOCK, dim) tensors per layer, grown by doubling to the highest block id
  used (ids are handed out lowest first), so memory follows the call's peak of tokens in flight.

A decode step gathers each row's blocks into one (heads, rows, T, dim) tensor per layer (rows of similar
length together, T: a group's widest row's blocks) and runs the lean step's attention on it
(covey/rollout/lean_decode.py): the same products in another layout. The gather copies a layer's keys once
per step, the price of blocks without a paged attention kernel (bench/rollout.py: at 64 rows of up to 1024
tokens that all fit their slots, blocks ran 0.69x the per-slot buffers' batch loop).

Where it runs: single answers (`AnswerRows`: a step's rows and `generate_until`'s quorum calls) on the
lean step (a plain Llama in bf16/fp16 on a CPU), without speculation, in a call with more rows than slots
(`FastEngine.slot_decoder`). Tool episodes, speculation, the policy server's stream, every other model and
a call whose rows all have a slot keep the per-slot buffers.
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from dataclasses import dataclass, field

import torch
from torch import Tensor

from covey.rollout.lean_decode import lean_step, project
from covey.rollout.slots import SlotStats, begin_call, prefill_prompts
from covey.runtime.signals import check_abort

BLOCK = 16
"""Positions per block: a row wastes fewer than BLOCK positions (its last block's empty part)."""


class Blocks:
    """A call's block ids, 0 .. limit - 1: the lowest free id first (so the pools grow only to the highest
    id in use), with a reference count each (a prompt's full blocks are shared by its rows)."""

    def __init__(self, limit: int):
        self.limit, self.top, self.free, self.refs = limit, 0, [], {}

    def take(self) -> int | None:
        """A free block (its count 1), or None when all `limit` are in use."""
        if self.free:
            block = heapq.heappop(self.free)
        elif self.top < self.limit:
            block, self.top = self.top, self.top + 1
        else:
            return None
        self.refs[block] = 1
        return block

    def share(self, blocks: list[int]) -> None:
        for block in blocks:
            self.refs[block] += 1

    def release(self, blocks: list[int]) -> None:
        for block in blocks:
            self.refs[block] -= 1
            if not self.refs[block]:
                del self.refs[block]
                heapq.heappush(self.free, block)

    @property
    def used(self) -> int:
        return len(self.refs)

    @property
    def available(self) -> int:
        return self.limit - self.used


class PagedLayer:
    """One full-attention layer's keys and values: pools (heads, blocks, BLOCK, dim), grown on demand."""

    def __init__(self, paging: Paging):
        self.paging = paging
        self.keys: Tensor | None = None
        self.values: Tensor | None = None

    def reserve(self, like: Tensor) -> None:
        """Room for every block id handed out so far (`like`: (n, heads, dim) new keys, for the first pools)."""
        have, top = (0 if self.keys is None else self.keys.shape[1]), self.paging.blocks.top
        if top <= have:
            return
        size = min(max(top, 2 * have), self.paging.blocks.limit)
        heads, dim = (like.shape[1], like.shape[-1]) if self.keys is None else (self.keys.shape[0], self.keys.shape[-1])
        for name in ("keys", "values"):
            old, new = getattr(self, name), like.new_zeros(heads, size, BLOCK, dim)  # finite where masked out
            if old is not None:
                new[:, :have] = old
            setattr(self, name, new)

    def write(self, blocks: Tensor, offsets: Tensor, keys: Tensor, values: Tensor) -> None:
        """Keys and values (m, heads, dim) at positions (blocks, offsets), each (m,)."""
        self.reserve(keys)
        self.keys[:, blocks, offsets] = keys.transpose(0, 1)
        self.values[:, blocks, offsets] = values.transpose(0, 1)

    def copy_block(self, source: int, target: int) -> None:
        self.reserve(self.keys)
        self.keys[:, target], self.values[:, target] = self.keys[:, source], self.values[:, source]

    def gather(self, table: Tensor) -> tuple[Tensor, Tensor]:
        """(heads, n, nb x BLOCK, dim) keys and values of the rows whose blocks are `table` (n, nb)."""
        n, flat = table.shape[0], table.reshape(-1)
        return tuple(pool.index_select(1, flat).view(pool.shape[0], n, -1, pool.shape[-1])
                     for pool in (self.keys, self.values))

    def held_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.keys, self.values) if t is not None)


@dataclass
class Paging:
    """The blocks of one call, every layer's pools, and what the next step writes and reads."""
    blocks: Blocks
    layers: list[PagedLayer] = field(default_factory=list)
    groups: list[tuple[Tensor, Tensor]] = field(default_factory=list)
    """The step's rows in groups of similar length, each (rows (m,), their block ids (m, nb) padded with the
    row's first block, masked out): a group's rows attend over its widest row's blocks only."""
    write_at: tuple[Tensor, Tensor] | None = None
    """(blocks, offsets), each (n,): where each row's new key goes."""

    def store(self, cache, mask: Tensor) -> list[list[int]]:
        """Write each row's valid columns of a prefill's buffer cache (left-padded, `mask` (n, W)) into new
        blocks; each row's block ids. The caller has checked that enough blocks are free."""
        lengths, width = mask.sum(1).tolist(), mask.shape[1]
        tables = [[self.blocks.take() for _ in range(math.ceil(n / BLOCK))] for n in lengths]
        rows = [r for r, n in enumerate(lengths) for _ in range(n)]
        positions = [p for n in lengths for p in range(n)]
        device = mask.device
        at = (torch.tensor([tables[r][p // BLOCK] for r, p in zip(rows, positions)], device=device),
              torch.tensor([p % BLOCK for p in positions], device=device))
        rows_t = torch.tensor(rows, device=device)
        columns = torch.tensor([width - lengths[r] + p for r, p in zip(rows, positions)], device=device)
        for layer, held in zip(self.layers, cache.layers, strict=True):
            layer.write(*at, held.key_buf[rows_t, :, columns], held.value_buf[rows_t, :, columns])
        return tables

    def held_bytes(self) -> int:
        return sum(layer.held_bytes() for layer in self.layers)

    def position_bytes(self) -> int:
        """Bytes of one position's keys and values over every layer."""
        return sum(2 * layer.keys.shape[0] * layer.keys.shape[-1] * layer.keys.element_size()
                   for layer in self.layers if layer.keys is not None)


def paged_attention(layer, hidden: Tensor, cos: Tensor, sin: Tensor, cache_layer: PagedLayer,
                    additive_mask: Tensor) -> Tensor:
    """The lean step's attention (lean_decode.attention) over a row's blocks: the new key and value are
    written at the row's next position, then its blocks are gathered (heads first) and attended to."""
    attn = layer.self_attn
    n, d = hidden.shape[0], attn.head_dim
    q, k, v = project(attn, hidden, cos, sin)
    cache_layer.write(*cache_layer.paging.write_at, k, v)
    out = q.new_empty(n, q.shape[1] * d)
    for rows, table in cache_layer.paging.groups:
        keys, values = cache_layer.gather(table)  # (kv_heads, m, T, d)
        groups = q[rows].view(len(rows), keys.shape[0], -1, d).transpose(0, 1)  # (kv_heads, m, G, d)
        scores = torch.matmul(keys, groups.transpose(2, 3)).transpose(2, 3).contiguous()
        scores = scores * attn.scaling + additive_mask[rows, 0, 0, :keys.shape[2]][None, :, None, :]
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
        out[rows] = torch.matmul(probs, values).transpose(0, 1).reshape(len(rows), -1)
    return torch.nn.functional.linear(out, attn.o_proj.weight)


@dataclass
class Running:
    """A row in the batch: its blocks (shared ones first), the positions written, the token it feeds next."""
    row: int
    blocks: list[int]
    length: int
    token: int


class PagedDecoder:
    """One call's rows (`AnswerRows`) through blocks of `engine`'s model (a `FastEngine` on the lean step),
    within the blocks `slots` rows hold at full length; the same interface as `SlotDecoder`."""

    def __init__(self, engine, slots: int, rows):
        self.engine, self.slots, self.policy = engine, slots, rows
        self.stats = SlotStats()

    @torch.inference_mode()
    def run(self, prompt_ids: Tensor, prompt_mask: Tensor, index: Tensor, uniforms):
        begin_call(self, prompt_ids, prompt_mask, index, uniforms)
        if len(index):
            self.loop()
        return self.policy.result()

    def loop(self) -> None:
        prompt_blocks = sum(math.ceil(int(n) / BLOCK) for n in self.prompt_mask.sum(1))
        row_blocks = math.ceil((self.prompt_ids.shape[1] + self.policy.columns) / BLOCK)
        self.paging = Paging(Blocks(prompt_blocks + self.slots * row_blocks))
        self.paging.layers = [PagedLayer(self.paging) for _ in self.engine.model.model.layers]
        cache, self.first_logits, _ = prefill_prompts(self.engine.model, self.prompt_ids, self.prompt_mask,
                                                      self.prompt_ids.shape[1])
        self.prompts = self.paging.store(cache, self.prompt_mask)
        del cache
        self.unstarted = torch.bincount(self.index, minlength=len(self.prompts)).tolist()
        self.fresh, self.resumed, self.batch = deque(range(len(self.index))), deque(), []
        self.admit()
        while self.batch and not self.policy.enough():
            check_abort()
            self.make_room()
            if not self.batch:
                self.admit()
                if not self.batch:
                    raise RuntimeError(f"paged KV: a row does not fit the call's {self.paging.blocks.limit} blocks")
                continue
            logits = self.step()
            tokens, fed, done = self.policy.inputs([run.row for run in self.batch], logits)
            for run, token, over in zip(self.batch, tokens, done):
                run.length, run.token = run.length + 1, token
                if over:
                    self.paging.blocks.release(run.blocks)
            self.batch = [run for run, over in zip(self.batch, done) if not over]
            self.admit()
        self.stats.cache_bytes, self.stats.position_bytes = self.paging.held_bytes(), self.paging.position_bytes()
        self.stats.tokens = self.policy.sampled

    def admit(self) -> None:
        """Start waiting rows while blocks are free beyond one per running row: preempted rows first (encoded
        again), then new rows (their first token drawn from their prompt's logits at once)."""
        blocks = self.paging.blocks
        while self.resumed and not self.policy.enough():
            run = self.resumed[0]
            if blocks.available < math.ceil(run.length / BLOCK) + len(self.batch) + 1:
                return
            self.resumed.popleft()
            self.encode_again(run)
        while self.fresh and not self.policy.enough() and blocks.available >= len(self.batch) + 1:
            r = self.fresh.popleft()
            p = int(self.index[r])
            self.unstarted[p] -= 1
            tokens, _, done = self.policy.inputs([r], self.first_logits[p:p + 1])
            shared = self.prompts[p] if int(self.prompt_mask[p].sum()) % BLOCK == 0 else self.prompts[p][:-1]
            if not done[0]:
                blocks.share(shared)
                own = [] if len(shared) == len(self.prompts[p]) else [blocks.take()]
                for layer in self.paging.layers if own else []:  # the prompt's last, partly filled block
                    layer.copy_block(self.prompts[p][-1], own[0])
                self.batch.append(Running(r, shared + own, int(self.prompt_mask[p].sum()), tokens[0]))
            if not self.unstarted[p]:  # every row of the prompt has started: its own hold on its blocks ends
                blocks.release(self.prompts[p])

    def encode_again(self, run: Running) -> None:
        """A preempted row's prompt and fed tokens, encoded again into new blocks."""
        p = int(self.index[run.row])
        prompt = self.prompt_ids[p][self.prompt_mask[p].bool()]
        count = run.length - len(prompt)  # the tokens it has fed; `run.token` is the next
        ids = torch.cat([prompt, self.policy.tokens[run.row, :count].to(self.device)])[None]
        mask = torch.ones_like(ids)
        cache, _, _ = prefill_prompts(self.engine.model, ids, mask, ids.shape[1])
        run.blocks = self.paging.store(cache, mask)[0]
        self.batch.append(run)

    def make_room(self) -> None:
        """A block for each row whose blocks are full, oldest rows first; while none is free, the row admitted
        last leaves the batch (its blocks freed) and waits at the head of the queue."""
        blocks, j = self.paging.blocks, 0
        while j < len(self.batch):
            run = self.batch[j]
            if run.length < len(run.blocks) * BLOCK:
                j += 1
                continue
            block = blocks.take()
            if block is not None:
                run.blocks.append(block)
                j += 1
                continue
            last = self.batch.pop()
            blocks.release(last.blocks)
            last.blocks = []
            self.resumed.appendleft(last)
            self.stats.preempted += 1

    def step(self) -> Tensor:
        """One new position for every running row: its token written and attended with its blocks."""
        device, batch = self.device, self.batch
        widest = max(len(run.blocks) for run in batch)
        lengths = torch.tensor([run.length for run in batch], device=device)
        self.paging.write_at = (torch.tensor([run.blocks[run.length // BLOCK] for run in batch], device=device),
                                lengths % BLOCK)
        self.paging.groups = [(torch.tensor(rows, device=device), self.table(rows)) for rows in self.length_groups()]
        key_mask = (torch.arange(widest * BLOCK, device=device)[None, :] <= lengths[:, None]).long()
        self.record(sum(run.length + 1 for run in batch))
        tokens = torch.tensor([run.token for run in batch], device=device)
        return lean_step(self.engine.model, tokens, lengths, key_mask, self.paging, paged_attention).float()

    def table(self, rows: list[int]) -> Tensor:
        """Rows `rows`' block ids (longest first), each padded with its first block to the first row's count."""
        width = len(self.batch[rows[0]].blocks)
        return torch.tensor([self.batch[j].blocks + self.batch[j].blocks[:1] * (width - len(self.batch[j].blocks))
                             for j in rows], device=self.device)

    def length_groups(self) -> list[list[int]]:
        """The batch's rows, longest first, in groups whose shortest row has more than half the blocks of the
        longest: attention over padded blocks costs at most twice a group's own."""
        order = sorted(range(len(self.batch)), key=lambda j: -len(self.batch[j].blocks))
        groups = [[order[0]]]
        for j in order[1:]:
            if 2 * len(self.batch[j].blocks) <= len(self.batch[groups[-1][0]].blocks):
                groups.append([])
            groups[-1].append(j)
        return groups

    def record(self, in_flight: int) -> None:
        """A step's rows, tokens in flight (prompt and answer, per row) and positions in blocks in use."""
        s = self.stats
        s.steps, s.row_steps = s.steps + 1, s.row_steps + len(self.batch)
        s.token_columns += in_flight
        s.block_columns += BLOCK * self.paging.blocks.used
        s.row_block_columns += BLOCK * sum(len(run.blocks) for run in self.batch)
        s.widest = max(s.widest, len(self.batch))
