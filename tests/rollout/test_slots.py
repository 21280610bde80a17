"""Rows through slots (covey/rollout/slots.py): the same tokens, log-probs and random stream as the batch
loop, whatever the number of slots; slots refilled as rows finish; per-row budgets; cache packing."""

from __future__ import annotations

import pytest
import torch

from covey.models.load import load_policy
from covey.models.tiny import tiny_family_model, tiny_tokenizer
from covey.rollout.fast import FastEngine

PROMPTS = ["What is 2 + 3?", "hello there, how are you doing today", "x"]
EOS = range(40, 90)  # many stop tokens: rows end at different steps


@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    return load_policy(tiny_model_dir)


def engine(model, tok, slots=0, max_new=24, temperature=0.9):
    e = FastEngine(model, tok, max_new_tokens=max_new, temperature=temperature, slots=slots)
    e.eos = sorted({tok.eos_token_id, *EOS})
    return e


def run(e, seed=None, **kw):
    if seed is not None:
        torch.manual_seed(seed)
    out = e.generate(PROMPTS, 4, **kw)
    return out, torch.rand(1)  # the global stream after the call


@pytest.mark.parametrize("slots", [1, 2, 5, 12, 40])
def test_greedy_tokens_are_the_batch_loops_whatever_the_slot_count(tiny, slots):
    model, tok = tiny
    budgets = [24, 3, 17, 9] * 3  # the tiny model's greedy rows never stop by themselves
    batch, _ = run(engine(model, tok), greedy=True, budgets=budgets)
    slotted, _ = run(engine(model, tok, slots=slots), greedy=True, budgets=budgets)
    assert torch.equal(batch.response_ids, slotted.response_ids)
    assert torch.equal(batch.response_mask, slotted.response_mask)
    assert len(set(batch.response_mask.sum(1).tolist())) > 2  # rows of different lengths took turns


@pytest.mark.parametrize("slots", [1, 3, 7])
def test_seeded_samples_and_the_global_stream_are_the_batch_loops(tiny, slots):
    # row r's k-th token takes the k-th uniform of row r, drawn N at a time as the batch loop draws them:
    # the same tokens, and the global stream left where the batch loop leaves it
    model, tok = tiny
    batch, after_batch = run(engine(model, tok), seed=11)
    slotted, after_slots = run(engine(model, tok, slots=slots), seed=11)
    assert len(set(batch.response_mask.sum(1).tolist())) > 2  # rows ended at different steps
    assert torch.equal(batch.response_ids, slotted.response_ids)
    assert torch.allclose(batch.sample_logp, slotted.sample_logp, atol=1e-5)
    assert torch.equal(after_batch, after_slots)
    seeds = [5, 6, 7]
    a, _ = run(engine(model, tok), seeds=seeds)
    b, _ = run(engine(model, tok, slots=slots), seeds=seeds)
    assert torch.equal(a.response_ids, b.response_ids)


def test_rows_keep_their_budgets_and_slots_stay_busy(tiny):
    model, tok = tiny
    budgets = [3, 20, 1, 7] * 3
    batch, _ = run(engine(model, tok, max_new=20), greedy=True, budgets=budgets)
    e = engine(model, tok, slots=2, max_new=20)
    slotted, _ = run(e, greedy=True, budgets=budgets)
    assert torch.equal(batch.response_ids, slotted.response_ids)
    lengths = slotted.response_mask.sum(1)
    assert all(n <= b for n, b in zip(lengths.tolist(), budgets))
    assert bool(slotted.truncated[2]) or lengths[2] == 1  # a budget of 1: one token
    stats = e.slot_stats
    # each step feeds one token per busy slot; a row's last token is sampled but never fed
    assert stats.tokens == int(lengths.sum()) and stats.row_steps == stats.tokens - len(budgets)
    assert stats.row_steps >= 2 * (stats.steps - 20)  # two busy slots on all but the last row's steps


def test_a_full_buffer_is_packed_and_decoding_goes_on(tiny):
    # 12 rows of up to 60 tokens through 1 slot: about 12 x 30 steps in a buffer of prompt + 60 + 64 columns
    model, tok = tiny
    batch, _ = run(engine(model, tok, max_new=60), greedy=True)
    e = engine(model, tok, slots=1, max_new=60)
    slotted, _ = run(e, greedy=True)
    assert e.slot_stats.steps > 60 + 64 + 12
    assert torch.equal(batch.response_ids, slotted.response_ids)


def test_the_cache_holds_the_slots_rows_only(tiny):
    model, tok = tiny
    batch = engine(model, tok)
    run(batch, greedy=True)
    e = engine(model, tok, slots=3)
    run(e, greedy=True)
    # 3 slots of prompt + 24 + 64 columns against 12 rows of prompt + 24
    assert e.slot_stats.cache_bytes < batch.cache_bytes
    assert e.slot_stats.kv_bytes_per_token > 0


@pytest.mark.parametrize("family", ["qwen3_5", "gemma3"])
def test_families(family):
    # Qwen3.5's linear-attention states start each row from its prompt's; Gemma 3's sliding windows are
    # refused by the column loop, so its rows take the batch loop
    tok = tiny_tokenizer()
    model = tiny_family_model(family, len(tok)).eval()
    e = engine(model, tok, slots=3)
    assert e.uses_slots() == (family == "qwen3_5")
    batch, _ = run(engine(model, tok), greedy=True)
    slotted, _ = run(e, greedy=True)
    assert torch.equal(batch.response_ids, slotted.response_ids)


def test_every_engine_keeps_each_rows_budget(tiny):
    # the HF engine cannot stop one row early: it samples to the longest budget and cuts each row at its own,
    # which gives the fast engine's tokens (greedy) and marks a row cut at its budget truncated
    from covey.rollout.hf import HFEngine
    model, tok = tiny
    budgets = [5, 1, 9]  # greedy `generate` takes one row per prompt
    fast = FastEngine(model, tok, max_new_tokens=12).generate(PROMPTS, 1, greedy=True, budgets=budgets)
    hf = HFEngine(model, tok, max_new_tokens=12).generate(PROMPTS, 1, greedy=True, budgets=budgets)
    width = fast.response_ids.shape[1]
    assert torch.equal(hf.response_ids[:, :width], fast.response_ids) and not hf.response_mask[:, width:].any()
    assert torch.equal(hf.response_mask[:, :width], fast.response_mask)
    assert torch.equal(hf.truncated, fast.truncated) and hf.completions == fast.completions
    assert fast.response_mask.sum(1).tolist() == budgets  # the tiny model's greedy rows never end by themselves


def test_cut_to_budgets_by_hand(tiny):
    from covey.batch import Rollout
    from covey.rollout.base import cut_to_budgets
    _, tok = tiny
    pad, eos = tok.pad_token_id, tok.eos_token_id
    # row 0: 4 tokens, no end, budget 2 -> 2 kept, truncated; row 1: ends at its 2nd token, budget 3 -> kept
    ids = torch.tensor([[10, 11, 12, 13], [20, eos, pad, pad]])
    mask = torch.tensor([[1.0, 1, 1, 1], [1, 1, 0, 0]])
    rollout = Rollout(prompt_ids=torch.ones(2, 1, dtype=torch.long), prompt_mask=torch.ones(2, 1, dtype=torch.long),
                      response_ids=ids, response_mask=mask, group_ids=torch.tensor([0, 0]),
                      truncated=torch.tensor([True, False]), completions=["", ""], example_index=[0, 0],
                      sample_logp=torch.full((2, 4), -1.0) * mask)
    out = cut_to_budgets(rollout, [2, 3], tok)
    assert out.response_ids.tolist() == [[10, 11, pad, pad], [20, eos, pad, pad]]
    assert out.response_mask.tolist() == [[1, 1, 0, 0], [1, 1, 0, 0]]
    assert out.truncated.tolist() == [True, False]
    assert out.sample_logp.tolist() == [[-1, -1, 0, 0], [-1, -1, 0, 0]]
