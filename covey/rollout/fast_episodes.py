"""Whole episodes in one decoding loop of the fast engine: a row that waits for its tools stands aside
while the other rows keep decoding, and the tools' reply is fed into the row's own KV cache.

The turn-by-turn runner (covey/rollout/episodes.py, `run_episodes`) samples a turn for every active
episode, waits for all their tool calls, and starts the next turn from every id so far, encoding the
whole episode again. Here each of the N rows moves through its episode on its own:

- sampling: the row draws its next token from the last forward's logits;
- waiting: its turn ended with tool calls, which run in a thread pool (each call under the tool
  timeout); the row still occupies its batch slot, but what a step writes in its cache column is
  masked out and its position does not advance;
- feeding: the reply's ids (rendered once by the chat template, covey/rollout/tools.py) go into the
  cache one per step, through the same decode step as sampled tokens (so the same code, and on a
  GPU the same kernels); after the last one, the row samples again.

So a slow tool holds its own episode only, and an appended reply costs its length in rows of decode
steps the batch runs anyway, not a prefill of the whole episode. Each step writes one cache column for
every row; the columns of waiting rows are holes, and when the buffer is full the valid columns of each
row are packed to the left (rotary positions travel inside the keys, and position ids are per row, so
moving a column changes nothing). Finished episodes leave the batch at once.

Sampling is independent of when tools answer: row r's k-th sampled token uses the k-th uniform of row
r, drawn up front (from torch's global generator, or from its prompt's seed), so the tokens do not
depend on which rows were waiting at a step (up to the float rounding of a batch's composition, as
when finished rows leave the single-turn loop). Greedy episodes are the turn-by-turn runner's
(tests/rollout/test_fast_episodes.py).

Layer kinds (covey/models/families.py). Full attention is exact with holes: a hole's column is masked
out. Linear attention (Qwen3.5's Gated DeltaNet) is made exact: its conv and recurrent states run through
every step of the batch, so a waiting row's hole step would advance them; the step restores the waiting
rows' states as they were (covey/rollout/decode_cache.py, `rows_held`). Sliding-window attention is not
run here: transformers builds a sliding layer's mask over columns, so a row's holes would push valid
positions out of its window (exact holes would need each kind's mask built from positions, and sliding
buffers that keep a window of valid columns per row). `loop_refusal` names such a model;
`FastEngine.continues_episodes` is then False and its episodes run turn by turn.

Used by `FastEngine` without a static cache (the CPU default, and rollout.decode=plain on a GPU); with
rollout.decode=static|graphs|compile the turn-by-turn runner drives the engine's graphs instead.
"""

from __future__ import annotations

from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field

import torch
from torch import Tensor

from covey.batch import Rollout
from covey.models.families import family_of
from covey.rollout.base import Prompt, encode_prompts
from covey.rollout.decode_cache import column_layers, rows_held
from covey.rollout.episodes import (
    MAX_EPISODES_AT_ONCE,
    Episode,
    EpisodeHost,
    EpisodeOptions,
    append_replies,
    end_turn,
    episode_metrics,
    episode_rollout,
)
from covey.rollout.lean_decode import supports_lean_step
from covey.runtime.signals import check_abort

SAMPLE, WAIT, FEED, DONE = range(4)
SLACK = 64
"""Cache columns beyond prompt + episode budget: the holes waiting rows leave before a packing."""


@dataclass
class Row:
    """One episode's place in the loop."""
    episode: Episode
    mode: int = SAMPLE
    turn: list[int] = field(default_factory=list)        # the model's ids of the current turn
    turn_logp: list[float] = field(default_factory=list)
    queue: list[int] = field(default_factory=list)       # appended ids still to feed
    calls: list = field(default_factory=list)
    reply: Future | None = None
    drawn: int = 0                                       # uniforms used


def loop_refusal(model) -> str | None:
    """Why this loop would not decode `model`'s episodes exactly (None: it does)."""
    family = family_of(model.config)
    if family.sliding:
        return (f"{family.model_type} has sliding-window layers, whose window would count the holes of "
                "waiting rows")
    return None


def draw_uniforms(uniforms, length: int) -> Tensor:
    """(N, length): row r's k-th uniform at [r, k], drawn up front from the engine's `Uniforms` (torch's
    global generator, or one generator per prompt from its seed: covey/rollout/fast.py)."""
    return torch.stack([uniforms.draw() for _ in range(length)], dim=1)


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


class EpisodeDecoder:
    """One call's episodes: the rows, the cache and the tool threads."""

    def __init__(self, engine, hosts: list[EpisodeHost], options: EpisodeOptions, greedy: bool):
        self.engine, self.options, self.greedy = engine, options, greedy
        self.hosts = hosts
        self.pool = ThreadPoolExecutor(max_workers=min(max(len(hosts), 1), MAX_EPISODES_AT_ONCE))

    def run(self, prompts: list[Prompt], group_size: int, uniforms) -> tuple[Rollout, dict]:
        """The episodes of `prompts` x `group_size`; `uniforms`: the engine's per-row draws (fast.Uniforms)."""
        tok = self.engine.tokenizer
        enc = encode_prompts(tok, prompts)
        index = torch.arange(len(prompts)).repeat_interleave(group_size)
        if len(self.hosts) != len(index):
            raise ValueError(f"decode_episodes: {len(self.hosts)} hosts for {len(index)} episodes")
        prompt_ids, prompt_mask = enc["input_ids"][index], enc["attention_mask"][index]
        self.rows = [Row(Episode(prompt=prompt_ids[i][prompt_mask[i].bool()].tolist(), host=h))
                     for i, h in enumerate(self.hosts)]
        self.uniforms = draw_uniforms(uniforms, self.options.max_episode_tokens + 1)
        try:
            self.loop(enc["input_ids"], enc["attention_mask"], index)
        finally:
            self.pool.shutdown(wait=True)
        first = Rollout(prompt_ids=prompt_ids, prompt_mask=prompt_mask, response_ids=prompt_ids[:, :0],
                        response_mask=prompt_mask[:, :0].float(), group_ids=index.clone(),
                        truncated=torch.zeros(len(index), dtype=torch.bool), completions=[""] * len(index),
                        example_index=index.tolist())
        episodes = [row.episode for row in self.rows]
        return episode_rollout(first, episodes, tok), episode_metrics(episodes)

    def loop(self, prompt_ids: Tensor, prompt_mask: Tensor, index: Tensor) -> None:
        engine = self.engine
        device = next(engine.model.parameters()).device
        width = prompt_ids.shape[1]
        capacity = width + self.options.max_episode_tokens + SLACK
        cache, logits = engine.prefill(prompt_ids.to(device), prompt_mask.to(device), index.to(device), capacity)
        key_mask = torch.zeros((len(index), capacity), dtype=torch.long, device=device)
        key_mask[:, :width] = prompt_mask[index].to(device)
        position = prompt_mask[index].sum(-1).to(device)
        rows = torch.arange(len(index), device=device)  # episode of each cache row, in cache order
        lean = engine.lean and supports_lean_step(engine.model)
        column = width  # cache columns written (the next step writes this one)
        while True:
            check_abort()  # a stop signal during the evaluation before training (covey/runtime/signals.py)
            self.take_replies(block=False)
            modes = [self.rows[r].mode for r in rows.tolist()]
            keep = [j for j, m in enumerate(modes) if m != DONE]
            if not keep:
                return
            if len(keep) < len(modes):
                keep_t = torch.tensor(keep, device=device)
                cache.batch_select_indices(keep_t)
                rows, key_mask, position, logits = rows[keep_t], key_mask[keep_t], position[keep_t], logits[keep_t]
            if all(self.rows[r].mode == WAIT for r in rows.tolist()):
                self.take_replies(block=True)
                continue
            tokens, valid = self.next_inputs(rows, logits)
            if column == capacity:
                key_mask = pack_cache(cache, key_mask)
                column = int(key_mask.sum(1).max())
            key_mask[:, column] = valid.long()
            with rows_held(cache, ~valid):
                logits = engine.step_logits(tokens, position, key_mask[:, :column + 1], cache, lean)
            position, column = position + valid.long(), column + 1

    def next_inputs(self, rows: Tensor, logits: Tensor) -> tuple[Tensor, Tensor]:
        """Each cache row's token for this step and whether it is real (a waiting row's is not)."""
        ids = rows.tolist()
        sampling = [j for j, r in enumerate(ids) if self.rows[r].mode == SAMPLE]
        feed = [self.engine.tokenizer.pad_token_id] * len(ids)
        valid = [False] * len(ids)
        if sampling:
            picked, logp = self.sample([ids[j] for j in sampling], logits[sampling])
            for j, token, lp in zip(sampling, picked, logp):
                feed[j], valid[j] = token, self.take_token(self.rows[ids[j]], token, lp)
        for j, r in enumerate(ids):
            row = self.rows[r]
            if row.mode == FEED:
                feed[j], valid[j] = row.queue.pop(0), True
                if not row.queue:
                    row.mode = SAMPLE
        device = rows.device
        return torch.tensor(feed, device=device), torch.tensor(valid, device=device)

    def sample(self, ids: list[int], logits: Tensor) -> tuple[list[int], list[float]]:
        """The next token of each sampling row and its log-prob under logits / temperature."""
        drawn = torch.tensor([self.uniforms[r, self.rows[r].drawn].item() for r in ids])
        picked = self.engine.pick(logits, drawn.to(logits.device), self.greedy)
        logp = torch.log_softmax(logits / self.engine.temperature, -1).gather(1, picked[:, None]).squeeze(1)
        for r in ids:
            self.rows[r].drawn += 1
        return picked.tolist(), logp.tolist()

    def take_token(self, row: Row, token: int, logp: float) -> bool:
        """Add a sampled token to the row's turn; at the turn's end read its calls. Whether the token goes
        into the cache (not when the episode ends with it)."""
        row.turn.append(token)
        row.turn_logp.append(logp)
        ep = row.episode
        budget = min(self.options.max_turn_tokens, self.options.max_episode_tokens - len(ep.ids))
        ended = token in self.engine.eos
        if not ended and len(row.turn) < budget:
            return True
        text = self.engine.tokenizer.decode(row.turn, skip_special_tokens=True)  # read; the ids stay as sampled
        row.calls = end_turn(ep, row.turn, row.turn_logp, text, not ended, self.options)
        row.turn, row.turn_logp = [], []
        if not row.calls:
            row.mode = DONE
            return False
        row.mode, row.reply = WAIT, self.pool.submit(ep.host.reply, row.calls)
        return True

    def take_replies(self, block: bool) -> None:
        """Queue the ids of the replies that came back (all that are done; with `block`, at least one)."""
        waiting = [row for row in self.rows if row.mode == WAIT]
        if block and waiting:
            wait([row.reply for row in waiting], return_when=FIRST_COMPLETED)
        for row in waiting:
            if not row.reply.done():
                continue
            ep, before = row.episode, len(row.episode.ids)
            append_replies(ep, row.calls, row.reply.result(), self.options)
            row.reply, row.calls = None, []
            row.queue = ep.ids[before:]
            row.mode = FEED if row.queue and not ep.done else DONE
