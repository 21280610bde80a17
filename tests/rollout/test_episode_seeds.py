"""Per-episode seeds in the turn-by-turn runner (covey/rollout/episodes.py, driven by EpisodeEngine in
covey/rollout/agents.py): with rollout.seeding=per_prompt every later turn of an episode is sampled from a
generator seeded from the episode's own seed and the turn, so an episode's tokens do not depend on the
other episodes of its batch, on how the batch is split into calls, or on torch's global stream (what one
process and torchrun need to draw the same episodes). The tiny model on the fast engine's static cache
(the GPU default's decoding, eagerly on the CPU), tools called by script after given turns."""

from __future__ import annotations

import pytest
import torch

from covey.rollout.agents import EpisodeEngine
from covey.rollout.base import EngineWrapper
from covey.rollout.episodes import EpisodeOptions, row_seed, turn_seed
from covey.rollout.fast import FastEngine

PROMPTS = ["What is 2 + 3?", "hello there, how are you doing today", "x", "tools, please"]
SEEDS = [11, 22, 33, 44]
G = 2


class NoEnvironment:
    environment = None  # a Toolbox's: no environment instance to hand reward functions

    def reward(self):
        return None


class Host:
    """A scripted tool call after each model turn in `calls_after` (1: the first), whatever the text; the
    reply appends `reply_ids`. No environment: no episode reward."""

    def __init__(self, calls_after, reply_ids=(7, 8, 9)):
        self.calls_after, self.reply_ids, self.turn = set(calls_after), list(reply_ids), 0
        self.toolbox = NoEnvironment()

    def calls_in(self, text: str) -> list:
        self.turn += 1
        return [{"name": "calc", "arguments": {}}] if self.turn in self.calls_after else []

    def reply(self, calls) -> list[dict]:
        return [{"role": "tool", "name": "calc", "content": "4"} for _ in calls]

    def append_ids(self, messages) -> list[int]:
        return list(self.reply_ids)


class Recorder(EngineWrapper):
    """The fast engine on a static cache (so episodes go turn by turn), recording each call's seeds."""

    def __init__(self, engine):
        super().__init__(engine)
        self.calls = []

    def generate(self, prompts, group_size, **kwargs):
        self.calls.append(kwargs.get("seeds"))
        return super().generate(prompts, group_size, **kwargs)


def episode_engine(llama, tok, calls_after, own: bool = False) -> EpisodeEngine:
    """`calls_after(prompt)`: the turns after which that prompt's episodes call a tool; `own`: each episode
    its own prompt (as an environment's reset text gives), one row each."""
    fast = FastEngine(llama, tok, max_new_tokens=12, temperature=1.0, static_cache=True)
    fast.eos = sorted({tok.eos_token_id, *range(40, 240)})  # turns end at different steps, rarely cut at 12

    def episodes(prompts, g):
        hosts = [Host(calls_after(p)) for p in prompts for _ in range(g)]
        return ([f"{p} (episode {k})" for p in prompts for k in range(g)] if own else None), hosts

    options = EpisodeOptions(max_turns=4, max_turn_tokens=12, max_episode_tokens=60)
    return EpisodeEngine(Recorder(fast), episodes, options)


def episodes_of(rollout, rows) -> list[tuple]:
    """Each row's episode: its ids, which the model sampled, and its messages."""
    out = []
    for r in rows:
        n = int(rollout.response_attention[r].sum())
        out.append((rollout.response_ids[r, :n].tolist(), rollout.response_mask[r, :n].tolist(),
                    rollout.messages[r]))
    return out


def test_the_seed_formulas_by_hand():
    # row seed: the prompt's seed s, the episode's index g in its group: s * 1_000_003 + g
    assert row_seed(3, 0) == 3_000_009 and row_seed(3, 1) == 3_000_010
    # turn seed: (episode seed * 1_000_033 + turn) mod (2^63 - 1); 3_000_009 * 1_000_033 = 3_000_009_000_000
    # + 3_000_009 * 33 (= 99_000_297) = 3_000_108_000_297
    assert turn_seed(3_000_009, 1) == 3_000_108_000_298 and turn_seed(3_000_009, 2) == 3_000_108_000_299
    # near the modulus p = 2^63 - 1: (p - 1) * 1_000_033 + 1 = -1_000_033 + 1 (mod p) = p - 1_000_032
    assert turn_seed(2**63 - 2, 1) == 2**63 - 1 - 1_000_032 == 9_223_372_036_853_775_775
    # a row seed stays below 2^63 - 1 (torch's generators take at most 64 bits): (p - 1) * 1_000_003 + 5 = p - 1_000_003
    # + 5 (mod p) = p - 999_998
    assert row_seed(2**63 - 2, 5) == 2**63 - 1 - 999_998


def test_later_turns_get_each_episodes_own_seed_and_no_seeds_none(llama, tok):
    """One prompt, seed 3, two episodes calling after turns 1 and 2: turn 1 takes the prompt's seed (the
    engine draws the group from it), turns 2 and 3 (index 1, 2) the seeds by hand above."""
    engine = episode_engine(llama, tok, lambda p: (1, 2))
    engine.generate(PROMPTS[:1], 2, seeds=[3])
    assert engine.inner.calls == [[3], [3_000_108_000_298, 3_000_109_000_331],  # 3_000_010 * 1_000_033 + 1
                                   [3_000_108_000_299, 3_000_109_000_332]]
    engine = episode_engine(llama, tok, lambda p: (1, 2))
    torch.manual_seed(0)
    engine.generate(PROMPTS[:1], 2)  # rollout.seeding=global: no call takes seeds
    assert engine.inner.calls == [None, None, None]


def test_an_episode_does_not_change_when_the_others_end_sooner(llama, tok):
    """The episodes of "x" call after turns 1-3 in both batches; the others go as long in the first batch
    and stop after one turn in the second. The global stream is seeded differently before each call."""
    long = episode_engine(llama, tok, lambda p: (1, 2, 3))
    short = episode_engine(llama, tok, lambda p: (1, 2, 3) if p == "x" else ())
    torch.manual_seed(1)
    a = long.generate(PROMPTS, G, seeds=SEEDS)
    torch.manual_seed(2)
    b = short.generate(PROMPTS, G, seeds=SEEDS)
    rows = [2 * G, 2 * G + 1]  # the episodes of "x"
    assert episodes_of(a, rows) == episodes_of(b, rows)
    assert all(len(m) == 7 for _, _, m in episodes_of(a, rows))  # 4 model turns and 3 replies each
    assert len(short.inner.calls) == len(long.inner.calls) == 4
    assert len(short.inner.calls[1]) == G and len(long.inner.calls[1]) == len(PROMPTS) * G


@pytest.mark.parametrize("own", [False, True], ids=["shared prompt", "own prompts"])
def test_a_batch_split_in_two_calls_gives_the_same_episodes(llama, tok, own):
    """One call on the four prompts, or two calls of two (two ranks' shares): the same episodes, row for
    row, and the same sampler's log-probs (up to the float rounding of a batch's padding)."""
    engine = episode_engine(llama, tok, lambda p: (1, 2) if len(p) % 2 else (1,), own=own)
    torch.manual_seed(1)
    whole = engine.generate(PROMPTS, G, seeds=SEEDS)
    torch.manual_seed(5)
    first = engine.generate(PROMPTS[:2], G, seeds=SEEDS[:2])
    torch.manual_seed(6)
    second = engine.generate(PROMPTS[2:], G, seeds=SEEDS[2:])
    n = 2 * G
    assert episodes_of(whole, range(2 * n)) == episodes_of(first, range(n)) + episodes_of(second, range(n))
    assert whole.response_mask[:, 0].sum() == 2 * n  # every episode sampled
    assert sum(len(m) for m in whole.messages) > 2 * n  # tools were called: later turns ran
    for part, offset in ((first, 0), (second, n)):
        width = part.sample_logp.shape[1]
        torch.testing.assert_close(whole.sample_logp[offset:offset + n, :width], part.sample_logp,
                                   atol=1e-5, rtol=0)
