"""Fast generation: a sampling loop of our own around the model's forward (rollout.engine=fast).

What it does differently from `HFEngine` (`model.generate`), and why (CPU profile of a
SmolLM2-135M decode step at N=32 in docs/benchmark.md):

- each prompt is encoded once and its KV cache expanded to its G samples
  (`generate` encodes G copies of every prompt);
- keys and values are written in place into a buffer sized for prompt + max_new_tokens
  (`DynamicCache` concatenates a growing tensor at every step: ~25% of a decode step); a sliding-window
  layer's buffer holds two windows, a linear-attention layer its conv and recurrent states
  (covey/rollout/decode_cache.py), so every family of covey/models/families.py decodes here;
- rows that finished are dropped from the batch at once, and decoding stops as soon as
  every row has; with `rollout.slots`, a finished row's place goes to a waiting row at once
  (covey/rollout/slots.py), and single answers on the lean step keep their keys in blocks
  of 16 positions, memory by tokens in flight (covey/rollout/paged.py);
- a token is drawn by inverse CDF from one uniform per row (covey/rollout/sampling.py);
- a bf16 Llama on a CPU decodes with `lean_step` (covey/rollout/lean_decode.py), the same
  operations as HF's forward without its per-module Python and mask building;
- on a GPU (rollout.decode=graphs, its default there) the cache is allocated once for all steps and calls, and each
  step is one replay of a CUDA graph (covey/rollout/static_decode.py).

The distribution sampled from is HF's: the same temperature, top-k and top-p warpers
(transformers' own classes) applied to the same logits. So samples follow the same
distribution as `HFEngine`'s, but are not the same tokens under one seed (a different
random stream). Greedy decoding picks HF's tokens. The uniforms of a step are drawn for
every row, finished or not, so the tokens do not depend on when rows are dropped.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch
from torch import Tensor
from transformers.cache_utils import Cache

from covey.batch import Rollout
from covey.models.attention import sampling_attention
from covey.models.families import family_of
from covey.models.hf_compat import last_positions, with_cache
from covey.rollout.base import Engine, Prompt, Quorum, RowSource, encode_prompts
from covey.rollout.decode_cache import BufferLayer as BufferLayer
from covey.rollout.decode_cache import buffer_cache, cache_plan, held_bytes
from covey.rollout.fast_episodes import EpisodeRows, episodes_in_slots, loop_refusal
from covey.rollout.hf import eos_ids, response_mask_from_ids
from covey.rollout.lean_decode import lean_step, supports_lean_step
from covey.rollout.paged import BLOCK, PagedDecoder
from covey.rollout.sampling import Uniforms, hf_warpers, sample_inverse_cdf
from covey.rollout.slots import AnswerRows, SlotDecoder, SlotStats
from covey.rollout.speculate import SPECULATE_TOKENS, Drafter, RecentNgrams, residual_probs
from covey.rollout.static_decode import StaticDecoder
from covey.rollout.static_step import supports_static_decode
from covey.rollout.stream import serve_stream
from covey.runtime.signals import check_abort

DROP_FINISHED = True  # a dropped row costs one copy of the cache, a kept one a row of every later step


class FastEngine(Engine):
    """Samples G completions per prompt with a prefix-shared, preallocated KV cache (left padding); per-prompt
    seeds in one batched call (one uniform stream per prompt)."""

    def __init__(self, model, tokenizer, *, max_new_tokens: int, temperature: float = 1.0,
                 top_p: float = 1.0, top_k: int = 0, share_prefix: bool = True, lean: bool = True,
                 static_cache: bool = False, cuda_graphs: bool = False, compile_decode: bool = False,
                 persistent: bool = True, slots: int = 0, speculate: int = 0, ignore_eos: bool = False,
                 paged: bool = True):
        """`static_cache`: decode on buffers allocated once (`cuda_graphs`: each step a graph replay,
        `compile_decode`: through torch.compile); `persistent`: keep them between calls; `slots` > 0: rows
        decode in that many slots, refilled as rows finish (covey/rollout/slots.py); `speculate` > 0: draft
        that many tokens per row and verify them while few rows remain (covey/rollout/speculate.py);
        `ignore_eos`: rows end at their budgets only (vLLM's ignore_eos: for benchmarks of set lengths);
        `paged`: single answers through slots keep their keys in blocks where the lean step runs
        (covey/rollout/paged.py; False: per-slot buffers, for tests and the benchmark)."""
        self.model = model
        self.tokenizer = tokenizer
        self.max_new_tokens = max_new_tokens
        self.warpers = hf_warpers(temperature, top_k, top_p)
        self.temperature = temperature
        self.share_prefix = share_prefix  # False: encode G copies like `generate` (for tests)
        self.lean = lean  # False: every step through the model's forward (for tests)
        self.eos = [] if ignore_eos else eos_ids(model, tokenizer)
        self.static = StaticDecoder(cuda_graphs, compile_decode, persistent) if static_cache else None
        self.cache_bytes = 0  # of the last call's cache, after its prefill and expansion to every row
        self.slots, self.paged = slots, paged
        self.speculate = speculate
        self.recent = RecentNgrams(speculate)  # recent answers' n-grams: drafts across calls
        self.slot_stats = SlotStats()  # of the last call through slots
        self.slot_use = [0, 0]  # busy row-steps and slot-steps of the calls since `take_metrics`

    @property
    def keeps_weights(self) -> bool:
        """A static cache's graphs read the weights where they were captured: a sampling copy stays resident."""
        return self.static is not None

    def sync_weights(self, model) -> None:
        self.model = model

    @property
    def continues_episodes(self) -> bool:
        """Whether `decode_episodes` runs tool episodes in one loop: not on a static cache's graphs, nor for
        a model whose layers the loop's holes would change (`loop_refusal`: sliding windows)."""
        return self.static is None and loop_refusal(self.model) is None

    @property
    def serves_rows(self) -> bool:
        """Whether `serve_rows` streams jobs through the slot loop (covey/rollout/stream.py): where that loop
        decodes the model, as for `continues_episodes`."""
        return self.continues_episodes

    def serve_rows(self, source: RowSource) -> None:
        serve_stream(self, source)

    def decode_path(self) -> str:
        """One start-up line: how this engine decodes its model's rows and tool episodes, and why."""
        model = self.model
        runner = self.static.runner if self.static is not None else None
        if runner is not None and supports_static_decode(model):
            kind = "CUDA graphs" if runner.graphs_on else "compiled steps" if runner.whole_capacity else "eager steps"
            steps = f"static cache ({kind}, buffers allocated once)"
        else:
            if runner is not None:
                why = f"the static step does not cover {type(model).__name__}"
            elif self.lean and supports_lean_step(model):
                why = None
            else:
                why = "lean steps off" if not self.lean else "the lean step takes plain Llamas in bf16/fp16 on a CPU"
            steps = "lean steps (a plain Llama in eager attention)" if why is None else f"plain forward steps ({why})"
            steps += f"; cache: {cache_plan(model)}"
        refusal = loop_refusal(model)
        if self.speculate:
            steps += (f"; drafts of {self.speculate} n-gram tokens verified while a step has at most "
                      f"{SPECULATE_TOKENS} tokens" if self.speculates() else
                      f"; no drafts (rollout.speculate: {self.speculation_refusal()})")
        episodes = ("tool episodes in one loop" if self.continues_episodes else
                    f"turn-by-turn episodes: {refusal or 'the static cache decodes their turns'}")
        if self.uses_slots() and self.slots and self.pages(model):
            steps += (f"; a call of more than {self.slots} single answers in KV blocks of {BLOCK} positions, as many "
                      f"rows at once as the blocks of {self.slots} full-length rows hold (others through the slots)")
        elif self.uses_slots() and self.slots:
            steps += f"; rows through {self.slots} slots, each taking the next row as its own ends"
        elif self.slots:
            steps += f"; every row at once (rollout.slots={self.slots}: {refusal or 'the static cache has no slots'})"
        return f"fast engine, {steps}; {episodes}"

    @torch.inference_mode()
    def decode_episodes(self, prompts: list[Prompt], group_size: int, hosts: list, options, *, greedy: bool = False,
                        seeds: list[int] | None = None) -> tuple[Rollout, dict]:
        """len(prompts) x group_size tool episodes (covey/rollout/fast_episodes.py): the Rollout of the
        whole episodes and their metrics. Refused (ValueError) for a model the loop does not decode exactly."""
        refusal = loop_refusal(self.model)
        if refusal is not None:
            raise ValueError(f"decode_episodes: {refusal}; run its episodes turn by turn (covey/rollout/episodes.py)")
        was_training = self.model.training
        self.model.eval()
        try:
            with sampling_attention(self.model):
                uniforms = Uniforms(len(prompts) * group_size, group_size, seeds)
                rows = EpisodeRows(self, hosts, options, greedy)
                return episodes_in_slots(self, prompts, group_size, rows, uniforms)
        finally:
            self.model.train(was_training)

    def next_token_probs(self, logits: Tensor) -> Tensor:
        """softmax of the warped logits: the distribution `generate` would sample from."""
        scores = logits.float()
        for warp in self.warpers:
            scores = warp(None, scores)
        return torch.softmax(scores, dim=-1)

    def pick(self, logits: Tensor, uniforms: Tensor, greedy: bool, bans: list[int | None] | None = None) -> Tensor:
        """Each row's token: argmax, or by inverse CDF from its uniform; `bans`: a token a row must not draw
        (a rejected draft: the speculative residual, covey/rollout/speculate.py; greedy never draws one)."""
        if greedy:
            return logits.argmax(dim=-1)
        probs = self.next_token_probs(logits)
        if bans is not None:
            probs = residual_probs(probs, bans)
        return sample_inverse_cdf(probs, uniforms)

    def uses_slots(self) -> bool:
        """Rows decode through slots (or, to speculate, all at once in the slot loop): asked for, on a model the
        column loop decodes exactly, without a static cache."""
        return bool(self.slots or self.speculate) and self.static is None and loop_refusal(self.model) is None

    def pages(self, model) -> bool:
        """Single answers through slots keep their keys in blocks (covey/rollout/paged.py): asked for (`paged`,
        `slots` > 0), without drafts, on the lean step."""
        return self.paged and self.slots > 0 and not self.speculates() and self.lean and supports_lean_step(model)

    def slot_decoder(self, rows: AnswerRows):
        """Blocks for a call with more rows than slots (memory-bound); when every row has a slot, the slots'
        buffers: they read the keys in place, where a step over blocks first gathers them (docs/rollouts.md)."""
        if self.pages(self.model) and len(rows.budgets) > self.slots:
            return PagedDecoder(self, self.slots, rows)
        return SlotDecoder(self, self.slots, rows)

    def speculation_refusal(self) -> str | None:
        """Why this engine would not verify drafts (None: it does): a rejected draft's columns are masked out,
        which undoes nothing in a recurrent state."""
        if self.static is not None or loop_refusal(self.model) is not None:
            return "the slot loop does not decode this engine's rows"
        kinds = set(family_of(self.model.config).layer_types)
        other = sorted(kinds - {"full_attention"})
        return f"layers of kind {', '.join(other)}" if other else None

    def speculates(self) -> bool:
        return bool(self.speculate) and self.speculation_refusal() is None

    def drafter(self, prompt_ids: Tensor, prompt_mask: Tensor, index: Tensor) -> Drafter | None:
        """The n-gram drafter of one call's rows (None: no speculation)."""
        if not self.speculates():
            return None
        prompts = [ids[mask.bool()].tolist() for ids, mask in zip(prompt_ids, prompt_mask)]
        return Drafter(self.speculate, self.recent, prompts, index.tolist())

    @torch.inference_mode()
    def generate(self, prompts: list[Prompt], group_size: int, *, greedy: bool = False,
                 max_new_tokens: int | None = None, seeds: list[int] | None = None,
                 budgets: Sequence[int] | None = None) -> Rollout:
        """`budgets`: each row's own token budget (rows in prompt-major order), at most the call's
        max_new_tokens; None: every row the call's."""
        tok = self.tokenizer
        enc = encode_prompts(tok, prompts)
        index = torch.arange(len(prompts)).repeat_interleave(group_size)
        max_new = max_new_tokens or self.max_new_tokens
        limits = torch.full((len(index),), max_new) if budgets is None else torch.as_tensor(budgets).clamp(1, max_new)
        was_training = self.model.training
        self.model.eval()
        try:
            with sampling_attention(self.model):
                uniforms = Uniforms(len(index), group_size, seeds)
                if self.uses_slots():
                    drafter = self.drafter(enc["input_ids"], enc["attention_mask"], index)
                    rows = AnswerRows(self, limits, greedy, drafter)
                    slots = self.slot_decoder(rows)
                    out = slots.run(enc["input_ids"], enc["attention_mask"], index, uniforms)
                    self.record_slots(slots.stats, len(index))
                elif self.static is not None and supports_static_decode(self.model):  # cut at the budgets below
                    longest = min(int(limits.max()), max_new) if len(limits) else max_new
                    out = self.static.decode(self, enc["input_ids"], enc["attention_mask"], index, longest, greedy,
                                             uniforms)
                else:
                    out = self._decode(enc["input_ids"], enc["attention_mask"], index, max_new, greedy, uniforms,
                                       limits)
                tokens, logps = out if isinstance(out, tuple) else (out, None)  # the static path: no log-probs yet
                tokens = tokens.cpu()
        finally:
            self.model.train(was_training)
        mask, truncated = response_mask_from_ids(tokens, self.eos)
        if budgets is not None:  # a row cut at its own budget ends there, whatever pads it
            within = torch.arange(tokens.shape[1])[None, :] < limits[:, None]
            truncated = ~(mask.bool() & within & torch.isin(tokens, torch.tensor(self.eos))).any(1)
            mask = mask * within
        longest = max(int(mask.sum(1).max()), 1) if len(mask) else tokens.shape[1]
        tokens, mask = tokens[:, :longest], mask[:, :longest]  # a static decode runs to its next check
        tokens = torch.where(mask.bool(), tokens, torch.full_like(tokens, tok.pad_token_id))
        if logps is not None:
            logps = logps.cpu()[:, :longest] * mask
        return Rollout(
            prompt_ids=enc["input_ids"][index], prompt_mask=enc["attention_mask"][index],
            response_ids=tokens, response_mask=mask, group_ids=index.clone(), truncated=truncated,
            completions=tok.batch_decode(tokens, skip_special_tokens=True), example_index=index.tolist(),
            sample_logp=logps,
        )

    def record_slots(self, stats: SlotStats, rows: int) -> None:
        """Busy slot-steps over slot-steps; with KV blocks, tokens in flight over the rows' block positions."""
        self.slot_stats = stats
        self.slot_use[0] += stats.token_columns if stats.row_block_columns else stats.row_steps
        self.slot_use[1] += stats.row_block_columns or min(self.slots or rows, rows) * stats.steps

    def take_metrics(self, total: Callable[[Tensor], Tensor] | None = None) -> dict:
        """rollout/busy_slot_frac: the share of the slots' decode steps that fed a row, over the calls through
        slots since the last take (summed over processes by `total`); {} without slots."""
        if not (self.uses_slots() or self.slot_use[1]):  # generate_until's slot loop runs in one process
            return {}
        use = torch.tensor(self.slot_use, dtype=torch.float64)
        self.slot_use = [0, 0]
        use = total(use) if total is not None else use
        return {"rollout/busy_slot_frac": float(use[0] / use[1])} if use[1] else {}

    @torch.inference_mode()
    def generate_until(self, prompts: list[Prompt], quorum: Quorum, *, budgets: Sequence[int],
                       seeds: list[int] | None = None) -> Rollout:
        """One row per prompt through the slot loop, stopped at `quorum` (rollout.partial; Engine's docstring).
        Equal prompts are encoded once, as a group's are."""
        refusal = loop_refusal(self.model) if self.static is None else "a static cache"
        if refusal is not None:
            raise NotImplementedError(f"rollout.partial needs the slot loop, which does not decode {refusal}")
        keys = [p if isinstance(p, str) else tuple(p) for p in prompts]
        where = {k: i for i, k in enumerate(dict.fromkeys(keys))}
        index = torch.tensor([where[k] for k in keys], dtype=torch.long)
        enc = encode_prompts(self.tokenizer, [k if isinstance(k, str) else list(k) for k in where])
        limits = torch.as_tensor(list(budgets), dtype=torch.long).clamp(min=1)
        was_training = self.model.training
        self.model.eval()
        try:
            with sampling_attention(self.model):
                rows = AnswerRows(self, limits, False, self.drafter(enc["input_ids"], enc["attention_mask"], index),
                                  quorum)
                slots = self.slot_decoder(rows)
                uniforms = Uniforms(len(index), 1, seeds)
                tokens, logps = slots.run(enc["input_ids"], enc["attention_mask"], index, uniforms)
                self.record_slots(slots.stats, len(index))
        finally:
            self.model.train(was_training)
        mask = (torch.arange(tokens.shape[1])[None, :] < torch.tensor(rows.count)[:, None]).float()
        cut = torch.tensor(rows.cut(), dtype=torch.bool)
        ended_eos = (torch.isin(tokens, torch.tensor(self.eos, dtype=torch.long)) & mask.bool()).any(1)
        tokens = torch.where(mask.bool(), tokens, torch.full_like(tokens, self.tokenizer.pad_token_id))
        return Rollout(
            prompt_ids=enc["input_ids"][index], prompt_mask=enc["attention_mask"][index], response_ids=tokens,
            response_mask=mask, group_ids=torch.as_tensor(list(quorum.groups), dtype=torch.long),
            truncated=~ended_eos & ~cut, completions=self.tokenizer.batch_decode(tokens, skip_special_tokens=True),
            example_index=list(range(len(prompts))), sample_logp=logps * mask, cut=cut)

    def prefill(self, prompt_ids: Tensor, prompt_mask: Tensor, index: Tensor, capacity: int):
        """Encode the prompts (once each when sharing) and return (cache, first logits) for all rows."""
        if not self.share_prefix:
            prompt_ids, prompt_mask = prompt_ids[index], prompt_mask[index]
        cache = buffer_cache(self.model, capacity)
        positions = (prompt_mask.cumsum(-1) - 1).clamp(min=0)
        out = self.model(input_ids=prompt_ids, attention_mask=prompt_mask, position_ids=positions,
                         **with_cache(cache), use_cache=True,
                         logits_to_keep=last_positions(1, prompt_ids.shape[1], prompt_ids.device))
        logits = out.logits[:, -1].float()
        if self.share_prefix:
            cache.batch_select_indices(index)
            logits = logits[index]
        self.cache_bytes = held_bytes(cache)  # its largest: rows only leave it
        return cache, logits

    def _decode(self, prompt_ids: Tensor, prompt_mask: Tensor, index: Tensor, max_new: int, greedy: bool,
                uniforms: Uniforms, budgets: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """(N, steps) new tokens, pad after a row's EOS, and each token's log-prob under the sampler's
        logits / temperature (the trainer's quantity, at the sampler's precision); stops when every row
        has finished."""
        device = next(self.model.parameters()).device
        prompt_ids, prompt_mask, index = prompt_ids.to(device), prompt_mask.to(device), index.to(device)
        budgets = budgets.to(device) if budgets is not None else None
        n, width = len(index), prompt_ids.shape[1]
        pad, eos = self.tokenizer.pad_token_id, torch.tensor(self.eos, device=device)
        cache, logits = self.prefill(prompt_ids, prompt_mask, index, width + max_new)
        lean = self.lean and supports_lean_step(self.model)
        mask = torch.cat([prompt_mask[index], prompt_mask.new_ones(n, max_new)], dim=1)
        start = prompt_mask[index].sum(-1)         # position of each row's first new token
        tokens = torch.full((n, max_new), pad, dtype=torch.long, device=device)
        logps = torch.zeros((n, max_new), dtype=torch.float32, device=device)
        rows = torch.arange(n, device=device)      # batch rows still in the cache, in cache order
        alive = torch.ones(n, dtype=torch.bool, device=device)
        for t in range(max_new):
            check_abort()  # a stop signal during the evaluation before training (covey/runtime/signals.py)
            step = torch.where(alive[rows], self.pick(logits, uniforms.draw().to(device)[rows], greedy), pad)
            tokens[rows, t] = step
            logps[rows, t] = torch.log_softmax(logits / self.temperature, -1).gather(1, step[:, None]).squeeze(1)
            alive[rows] &= ~torch.isin(step, eos)
            if budgets is not None:
                alive[rows] &= t + 1 < budgets[rows]
            if t == max_new - 1 or not bool(alive.any()):
                return tokens[:, :t + 1].cpu(), logps[:, :t + 1].cpu()
            done = ~alive[rows]
            if DROP_FINISHED and bool(done.any()):
                keep = (~done).nonzero().squeeze(1)
                cache.batch_select_indices(keep)
                rows, mask, start, step = rows[keep], mask[keep], start[keep], step[keep]
            logits = self.step_logits(step, start + t, mask[:, :width + t + 1], cache, lean)
        return tokens.cpu(), logps.cpu()

    def block_logits(self, tokens: Tensor, positions: Tensor, key_mask: Tensor, cache: Cache) -> Tensor:
        """(n, q, V) float32 logits after q new tokens per row (a speculative step's token and drafts)."""
        out = self.model(input_ids=tokens, attention_mask=key_mask, position_ids=positions, **with_cache(cache),
                         use_cache=True)
        return out.logits.float()

    def step_logits(self, step: Tensor, positions: Tensor, key_mask: Tensor, cache: Cache, lean: bool) -> Tensor:
        """(n, V) float32 logits after one new token per row."""
        if lean:
            return lean_step(self.model, step, positions, key_mask, cache).float()
        out = self.model(input_ids=step.unsqueeze(1), attention_mask=key_mask, position_ids=positions.unsqueeze(1),
                         **with_cache(cache), use_cache=True)
        return out.logits[:, -1].float()
