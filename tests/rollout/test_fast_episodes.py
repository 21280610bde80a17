"""The fast engine's episode loop (covey/rollout/fast_episodes.py) on the tiny model with scripted tools:
the same greedy episodes as the turn-by-turn runner, rows that keep decoding while one waits for its
tool, cache packing, and the sampler's log-probs equal to a fresh forward over the whole episode."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from covey.models.load import load_policy
from covey.rollout import fast_episodes, slots
from covey.rollout.episodes import EpisodeOptions, run_episodes
from covey.rollout.fast import FastEngine

PROMPTS = ["What is 2 + 3?", "hello there, how are you doing today", "x"]


@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    return load_policy(tiny_model_dir)


class Host:
    """Calls a tool after the turns in `calls_after`; the reply's ids are `reply_ids`; `before_reply` runs
    in the tool's thread before it answers."""

    def __init__(self, calls_after=(1,), reply_ids=(7, 8, 9), before_reply=None, on_turn=None):
        self.calls_after, self.reply_ids, self.turn = set(calls_after), list(reply_ids), 0
        self.before_reply, self.on_turn = before_reply, on_turn

    def calls_in(self, text: str) -> list:
        self.turn += 1
        if self.on_turn:
            self.on_turn(self.turn)
        return [{"name": "calc", "arguments": {}}] if self.turn in self.calls_after else []

    def reply(self, calls) -> list[dict]:
        if self.before_reply:
            self.before_reply()
        return [{"role": "tool", "name": "calc", "content": "4"} for _ in calls]

    def append_ids(self, messages) -> list[int]:
        return list(self.reply_ids)


def hosts(n: int, **kw) -> list[Host]:
    """Episodes that call after turns 1 and 2, with replies of 1-4 ids (rows of different lengths)."""
    return [Host(calls_after=(1, 2), reply_ids=list(range(7, 8 + i % 4)), **kw) for i in range(n)]


def options(turns=3, turn_tokens=10, episode_tokens=40) -> EpisodeOptions:
    return EpisodeOptions(max_turns=turns, max_turn_tokens=turn_tokens, max_episode_tokens=episode_tokens)


def engine_for(model, tok, eos=range(40, 90), temperature=1.0) -> FastEngine:
    engine = FastEngine(model, tok, max_new_tokens=10, temperature=temperature)
    engine.eos = sorted({tok.eos_token_id, *eos})  # turns end at different steps
    return engine


def turn_by_turn(engine, prompts, group_size, host_list, opts):
    def sample(batch, g, budget):
        return engine.generate(batch, g, greedy=True, max_new_tokens=budget)
    return run_episodes(sample, engine.tokenizer, prompts, group_size, host_list, opts)


def test_greedy_episodes_equal_the_turn_by_turn_runners(tiny):
    """The loop continues each row in its cache; the runner encodes every id so far again each turn. The
    greedy tokens, masks, cut-offs and messages agree: the cache continuation is the same model."""
    model, tok = tiny
    # the random model's greedy turns repeat one token (33, 91 or 90 after these prompts): two of them stop
    engine = engine_for(model, tok, eos=[33, 90])
    ours, ours_metrics = engine.decode_episodes(PROMPTS, 2, hosts(6), options(), greedy=True)
    theirs, theirs_metrics = turn_by_turn(engine, PROMPTS, 2, hosts(6), options())
    assert ours.response_ids.shape == theirs.response_ids.shape
    assert torch.equal(ours.response_ids, theirs.response_ids)
    assert torch.equal(ours.response_mask, theirs.response_mask)
    assert torch.equal(ours.response_attention, theirs.response_attention)
    assert torch.equal(ours.truncated, theirs.truncated) and ours.messages == theirs.messages
    assert torch.equal(ours.prompt_ids, theirs.prompt_ids) and ours.example_index == theirs.example_index
    assert ours_metrics == theirs_metrics
    assert ours_metrics["episode/tool_calls_mean"] > 0  # the case exercised: episodes with appended replies


def test_a_row_waiting_for_its_tool_does_not_hold_the_others(tiny):
    """Episode 0's tool answers only once every other episode has finished its second turn. In the
    turn-by-turn runner the others wait for episode 0's reply before their second turn, so the tool would
    wait out its 20 s; in the loop they go on decoding and the tool answers at once."""
    model, tok = tiny
    engine = engine_for(model, tok, eos=range(len(tok)))  # every turn is one token: each ends with a call
    others_done = threading.Event()
    finished = []

    def on_turn(turn):
        if turn == 2:
            finished.append(turn)
            if len(finished) == 3:
                others_done.set()

    waited = []
    slow = Host(calls_after=(1,), before_reply=lambda: waited.append(others_done.wait(timeout=20)))
    others = [Host(calls_after=(1,), on_turn=on_turn) for _ in range(3)]
    start = time.monotonic()
    rollout, metrics = engine.decode_episodes(PROMPTS[:2], 2, [slow, *others], options(), greedy=True)
    assert waited == [True] and time.monotonic() - start < 15
    assert metrics["episode/turns_mean"] == 2 and metrics["episode/tool_calls_mean"] == 1
    # each episode: a token (EOS), the reply's 3 ids, a token: 5 ids, the model's 2 of them trained
    assert rollout.response_mask.sum(1).tolist() == [2.0] * 4
    assert rollout.response_attention.sum(1).tolist() == [5.0] * 4


def full_pass_logp(model, rollout, temperature: float) -> torch.Tensor:
    """(N, L) log-probs of the response ids by one forward over prompt and episode (what the trainer reads)."""
    ids = torch.cat([rollout.prompt_ids, rollout.response_ids], 1)
    mask = torch.cat([rollout.prompt_mask.float(), rollout.response_attended], 1)
    positions = (mask.cumsum(1) - 1).clamp(min=0).long()
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask.long(), position_ids=positions).logits.float()
    width = rollout.prompt_ids.shape[1]
    logp = torch.log_softmax(logits[:, width - 1:-1] / temperature, -1)
    return logp.gather(2, rollout.response_ids[:, :, None]).squeeze(2) * rollout.response_mask


@pytest.mark.parametrize("slack", [fast_episodes.SLACK, 1])
def test_sampled_episodes_log_probs_equal_a_fresh_forward_and_do_not_depend_on_tool_timing(tiny, monkeypatch, slack):
    """Sampled (temperature 0.8, per-prompt seeds) with one episode's tool slow: the sampler's log-probs
    of the model's tokens equal one forward over the whole episode (0 on the environment's), also when the
    cache is packed every few steps (slack 1); and the tokens are the same whichever tool is slow."""
    monkeypatch.setattr(fast_episodes, "SLACK", slack)
    model, tok = tiny
    engine = engine_for(model, tok, temperature=0.8)

    def run(slow_row: int):
        host_list = hosts(6)
        host_list[slow_row].before_reply = lambda: time.sleep(0.2)
        return engine.decode_episodes(PROMPTS, 2, host_list, options(), seeds=[3, 4, 5])[0]

    first, second = run(0), run(5)
    assert torch.equal(first.response_ids, second.response_ids)
    assert first.response_mask.sum() > first.response_mask.shape[0]  # turns of more than one token
    assert (first.response_attention - first.response_mask).sum() > 0  # and appended replies
    torch.testing.assert_close(first.sample_logp, full_pass_logp(model, first, 0.8), atol=2e-4, rtol=0)
    assert torch.all(first.sample_logp[first.response_mask == 0] == 0)


@pytest.mark.parametrize("slot_count", [1, 4])
def test_episodes_through_fewer_slots_are_the_same_episodes(tiny, slot_count):
    """Six sampled episodes (per-prompt seeds, tools that answer at different times) through 1 or 4 slots,
    each slot taking the next episode when its own ends: the same tokens, replies and log-probs as all six
    at once (one decode loop for answers and episodes: covey/rollout/slots.py)."""
    model, tok = tiny
    outs = []
    for count in (0, slot_count):
        engine = FastEngine(model, tok, max_new_tokens=10, temperature=0.8, slots=count)
        engine.eos = sorted({tok.eos_token_id, *range(40, 90)})
        host_list = hosts(6, before_reply=lambda: time.sleep(0.01))
        outs.append(engine.decode_episodes(PROMPTS, 2, host_list, options(), seeds=[3, 4, 5])[0])
    together, slotted = outs
    assert torch.equal(together.response_ids, slotted.response_ids)
    assert torch.equal(together.response_attention, slotted.response_attention)
    torch.testing.assert_close(together.sample_logp, slotted.sample_logp, atol=1e-5, rtol=0)
    assert (together.response_attention - together.response_mask).sum() > 0  # replies were appended


def test_packing_the_cache_keeps_the_greedy_episodes(tiny, monkeypatch):
    """Slack 1: the buffer fills and is packed many times, with waiting rows' holes; same tokens."""
    model, tok = tiny
    engine = engine_for(model, tok, eos=[33, 90])
    wide, _ = engine.decode_episodes(PROMPTS, 2, hosts(6, before_reply=lambda: time.sleep(0.05)), options(),
                                     greedy=True)
    monkeypatch.setattr(fast_episodes, "SLACK", 1)
    packed, _ = engine.decode_episodes(PROMPTS, 2, hosts(6, before_reply=lambda: time.sleep(0.05)), options(),
                                       greedy=True)
    assert torch.equal(wide.response_ids, packed.response_ids)
    assert torch.equal(wide.response_attention, packed.response_attention)


def test_pack_cache_moves_each_rows_valid_columns_to_the_right_in_order():
    """Two rows, 5 filled columns: row 0 valid at 0, 2, 3; row 1 at 1, 4. Width 3: row 0 -> [0, 2, 3],
    row 1 -> [pad, 1, 4] (its slot 0 reads column 0 and is masked)."""
    from transformers.cache_utils import Cache

    from covey.rollout.fast import BufferLayer

    layer = BufferLayer(capacity=6)
    keys = torch.arange(2 * 5, dtype=torch.float).view(2, 1, 5, 1)  # row r, column c: 5r + c
    layer.update(keys, keys.clone())
    cache = Cache(layers=[layer])
    mask = torch.tensor([[1, 0, 1, 1, 0, 0], [0, 1, 0, 0, 1, 0]])
    packed = slots.pack_cache(cache, mask)
    assert packed.tolist() == [[1, 1, 1, 0, 0, 0], [0, 1, 1, 0, 0, 0]]
    assert layer.filled == 3
    assert layer.keys[0, 0, :, 0].tolist() == [0.0, 2.0, 3.0]
    assert layer.keys[1, 0, 1:, 0].tolist() == [6.0, 9.0]


def test_the_bf16_sampling_copy_runs_episodes_after_its_weights_were_released(tiny):
    """The training loop frees the bf16 copy's weights between rollouts; the episode loop refills them, as
    `generate` does, and samples from the copy (the bf16 lean step): greedy episodes with turns and replies."""
    from covey.rollout.precision import LowPrecisionEngine

    model, tok = tiny
    engine = LowPrecisionEngine(FastEngine, model, tok, torch.bfloat16, max_new_tokens=10)
    engine.inner.eos = [tok.eos_token_id, 33, 90]
    engine.release_weights()
    assert engine.continues_episodes
    rollout, metrics = engine.decode_episodes(PROMPTS, 2, hosts(6), options(), greedy=True)
    assert not engine.released and metrics["episode/tool_calls_mean"] > 0
    assert rollout.sample_logp is not None and rollout.response_mask.sum() > 0
