"""Whole episodes in the fast engine's one decode loop (covey/rollout/slots.py, whose rows `EpisodeRows`
makes episodes): a row that waits for its tools stands aside while the other rows keep decoding, the tools'
reply is fed into the row's own KV cache, and with rollout.slots a finished episode's slot takes the next.

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
from covey.rollout.slots import SlotDecoder

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


def episodes_in_slots(engine, prompts: list[Prompt], group_size: int, rows: EpisodeRows,
                      uniforms) -> tuple[Rollout, dict]:
    """The episodes of `prompts` x `group_size` through the engine's slots (`rows`: their hosts and options;
    `uniforms`: the engine's per-row draws, sampling.Uniforms): the Rollout of the whole episodes and their metrics."""
    tok = engine.tokenizer
    enc = encode_prompts(tok, prompts)
    index = torch.arange(len(prompts)).repeat_interleave(group_size)
    prompt_ids, prompt_mask = enc["input_ids"][index], enc["attention_mask"][index]
    rows.start(prompt_ids, prompt_mask)
    try:
        SlotDecoder(engine, engine.slots, rows).run(enc["input_ids"], enc["attention_mask"], index, uniforms)
    finally:
        rows.close()
    first = Rollout(prompt_ids=prompt_ids, prompt_mask=prompt_mask, response_ids=prompt_ids[:, :0],
                    response_mask=prompt_mask[:, :0].float(), group_ids=index.clone(),
                    truncated=torch.zeros(len(index), dtype=torch.bool), completions=[""] * len(index),
                    example_index=index.tolist())
    episodes = [row.episode for row in rows.rows]
    return episode_rollout(first, episodes, tok), episode_metrics(episodes)


class EpisodeRows:
    """Whole tool episodes as the slot loop's rows (covey/rollout/slots.py): the rows, the hosts and the tool
    threads of one call."""

    def __init__(self, engine, hosts: list[EpisodeHost], options: EpisodeOptions, greedy: bool):
        self.engine, self.options, self.greedy = engine, options, greedy
        self.hosts = hosts
        self.pool = ThreadPoolExecutor(max_workers=min(max(len(hosts), 1), MAX_EPISODES_AT_ONCE))
        self.columns, self.slack = options.max_episode_tokens, SLACK
        self.upfront = options.max_episode_tokens + 1  # every uniform an episode may use, drawn first
        self.sampled = 0

    def start(self, prompt_ids: Tensor, prompt_mask: Tensor) -> None:
        """One Row per episode (`prompt_ids` (N, P): each row's prompt, left-padded)."""
        if len(self.hosts) != len(prompt_ids):
            raise ValueError(f"decode_episodes: {len(self.hosts)} hosts for {len(prompt_ids)} episodes")
        self.rows = [Row(Episode(prompt=prompt_ids[i][prompt_mask[i].bool()].tolist(), host=h))
                     for i, h in enumerate(self.hosts)]

    def result(self) -> list[Row]:
        return self.rows

    def close(self) -> None:
        self.pool.shutdown(wait=True)

    def draw_from(self, uniforms) -> None:
        """Where each row's k-th uniform comes from (sampling.RowUniforms, set by the decoder at the start)."""
        self.uniforms = uniforms

    def enough(self) -> bool:
        """Episodes run to their ends: no quorum stops them."""
        return False

    def poll(self) -> None:
        self.take_replies(block=False)

    def all_waiting(self, rows: list[int]) -> bool:
        return all(self.rows[r].mode == WAIT for r in rows)

    def wait(self) -> None:
        self.take_replies(block=True)

    def drafts(self, ids: list[int]) -> None:
        """Episodes do not speculate: a rejected draft would have run past a turn's end into its tools."""
        return None

    def inputs(self, ids: list[int], logits: Tensor) -> tuple[list[int], list[bool], list[bool]]:
        """Each row's token for this step, whether it is real (a waiting row's is not) and whether its episode
        ended."""
        feed, valid = self.next_inputs(ids, logits)
        return feed, valid, [self.rows[r].mode == DONE for r in ids]

    def next_inputs(self, ids: list[int], logits: Tensor) -> tuple[list[int], list[bool]]:
        """Each cache row's token for this step and whether it is real (a waiting row's is not)."""
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
        return feed, valid

    def sample(self, ids: list[int], logits: Tensor) -> tuple[list[int], list[float]]:
        """The next token of each sampling row and its log-prob under logits / temperature."""
        drawn = self.uniforms.take(ids, [self.rows[r].drawn for r in ids])
        picked = self.engine.pick(logits, drawn.to(logits.device), self.greedy)
        logp = torch.log_softmax(logits / self.engine.temperature, -1).gather(1, picked[:, None]).squeeze(1)
        for r in ids:
            self.rows[r].drawn += 1
        self.sampled += len(ids)
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
