"""Paged KV (covey/rollout/paged.py): the batch loop's tokens, log-probs and random stream whatever the block
budget, preemption included; shared prompt blocks and the blocks in use counted by hand."""

from __future__ import annotations

import pytest
import torch

from covey.models.load import load_policy
from covey.rollout.base import Quorum
from covey.rollout.fast import FastEngine
from covey.rollout.paged import BLOCK, Blocks, PagedDecoder, Running
from covey.rollout.precision import low_precision_copy

PROMPTS = ["What is 2 + 3?", "hello there, how are you doing today", "x"]
EOS = range(40, 90)  # many stop tokens: sampled rows end at different steps
BUDGETS = [40, 3, 17, 9] * 3


@pytest.fixture(scope="module")
def tiny_bf16(tiny_model_dir):
    """The tiny Llama in bf16: the lean step runs, so slots decode in blocks."""
    model, tok = load_policy(tiny_model_dir)
    return low_precision_copy(model, torch.bfloat16).eval(), tok


def engine(model, tok, slots=0, paged=True):
    e = FastEngine(model, tok, max_new_tokens=40, temperature=0.9, slots=slots, paged=paged)
    e.eos = sorted({tok.eos_token_id, *EOS})
    return e


def run(e, greedy, seed=3, prompts=PROMPTS, group=4, budgets=BUDGETS):
    torch.manual_seed(seed)
    out = e.generate(prompts, group, greedy=greedy, budgets=budgets)
    return out, torch.rand(1)  # the global stream after the call


def test_blocks_hand_out_the_lowest_free_id_and_count_sharers():
    blocks = Blocks(3)
    assert [blocks.take(), blocks.take(), blocks.take(), blocks.take()] == [0, 1, 2, None]
    blocks.share([1])  # a prompt's block taken by one row: two holders
    blocks.release([0, 1])
    assert blocks.used == 2 and blocks.available == 1  # 1 still held by its row, 2 by its owner
    assert blocks.take() == 0  # the freed id, not a new one
    blocks.release([1, 2, 0])
    assert blocks.used == 0 and blocks.top == 3


def test_rows_attend_in_groups_of_similar_length():
    # blocks per row 5, 1, 3, 2, 6 -> longest first 6 (row 4), 5 (0), 3 (2), 2 (3), 1 (1); a group ends before
    # a row with at most half its first row's blocks: 6 | 3 (2 x 3 <= 6), 3 | 1 (2 x 1 <= 3), 2 stays with 3
    decoder = PagedDecoder(None, 1, None)
    decoder.batch = [Running(r, list(range(n)), 16 * n - 1, 0) for r, n in enumerate([5, 1, 3, 2, 6])]
    decoder.device = "cpu"
    assert decoder.length_groups() == [[4, 0], [2, 3], [1]]
    assert decoder.table([2, 3]).tolist() == [[0, 1, 2], [0, 1, 0]]  # padded with the row's first block


@pytest.mark.parametrize("slots", [1, 2, 5, 11])
@pytest.mark.parametrize("greedy", [True, False])
def test_paged_rows_are_the_batch_loops(tiny_bf16, slots, greedy):
    model, tok = tiny_bf16
    batch, after_batch = run(engine(model, tok), greedy)
    e = engine(model, tok, slots=slots)
    assert "KV blocks" in e.decode_path()
    paged, after_paged = run(e, greedy)
    assert e.slot_stats.block_columns > 0  # the paged decoder ran
    assert torch.equal(batch.response_ids, paged.response_ids)
    assert torch.equal(batch.response_mask, paged.response_mask)
    assert torch.allclose(batch.sample_logp, paged.sample_logp, atol=1e-5)
    assert torch.equal(after_batch, after_paged)
    assert len(set(batch.response_mask.sum(1).tolist())) > 2  # rows of different lengths


def test_a_row_preempted_for_blocks_goes_on_with_its_tokens(tiny_bf16):
    # one full-length row's blocks beyond the prompts: 12 rows of up to 40 tokens run out of blocks, the rows
    # admitted last leave the batch and are encoded again from their prompt and tokens when blocks free up
    model, tok = tiny_bf16
    budgets = [40] * 12
    batch, _ = run(engine(model, tok), True, budgets=budgets)
    e = engine(model, tok, slots=1)
    paged, _ = run(e, True, budgets=budgets)
    assert e.slot_stats.preempted >= 3
    assert torch.equal(batch.response_ids, paged.response_ids)
    assert torch.equal(batch.response_mask, paged.response_mask)


def test_a_prompts_full_blocks_are_shared_and_its_last_block_copied(tiny_bf16):
    # one prompt of 37 tokens: blocks 0, 1 full (32 positions), block 2 holds 5. Its 4 rows share blocks 0
    # and 1 and each copies block 2 into its own; once all 4 have started, the prompt's hold on block 2 ends.
    # Budget 2: a row's first token is drawn from the prompt's logits, its second after one step.
    # That step: 2 shared + 4 own blocks = 6 x 16 = 96 positions in use, 4 x (37 + 1) = 152 tokens in flight.
    # 3 slots (more rows than slots: blocks): 3 prompt blocks + 3 x 3 = 12 in all, so all 4 rows start at once
    # (a row starts while more blocks are free than rows run: 9 >= 1, 8 >= 2, 7 >= 3, 6 >= 4).
    model, tok = tiny_bf16
    e = engine(model, tok, slots=3)
    e.eos = [tok.eos_token_id]
    prompt = list(range(100, 137))
    out = e.generate([prompt], 4, greedy=True, budgets=[2] * 4)
    s = e.slot_stats
    assert out.response_mask.sum().item() == 8 and s.steps == 1
    assert (s.block_columns, s.token_columns) == (6 * BLOCK, 152)
    assert s.position_bytes == 2 * 2 * 2 * 16 * 2  # k and v x 2 layers x 2 key/value heads x 16 dims x bf16
    assert s.kv_bytes_per_token == pytest.approx(256 * 96 / 152)
    # each row's own view: 3 blocks (2 shared, 1 copied) = 48 positions, 38 of them its tokens
    assert e.take_metrics()["rollout/busy_slot_frac"] == pytest.approx(152 / (4 * 48))


def test_blocks_hold_less_than_per_slot_buffers_on_long_tailed_rows(tiny_bf16):
    model, tok = tiny_bf16
    budgets = [40, 2, 3, 2] * 3
    stats = {}
    for paged in (True, False):
        e = engine(model, tok, slots=6, paged=paged)
        out, _ = run(e, True, budgets=budgets)
        stats[paged] = e.slot_stats
    # per-slot buffers: 6 rows x (prompt + 40 + slack 64) columns; blocks: the tokens each row wrote
    assert stats[True].cache_bytes * 2 < stats[False].cache_bytes
    assert stats[True].tokens == stats[False].tokens == out.response_mask.sum()
    assert stats[True].kv_bytes_per_token < stats[False].kv_bytes_per_token


def test_a_quorum_call_ends_the_groups_it_needs_with_the_slot_loops_tokens(tiny_bf16):
    # blocks start more rows at once than 3 slots do, so other rows may be cut; a row that ends in both
    # calls has the same tokens (its k-th token takes its own k-th uniform)
    model, tok = tiny_bf16
    prompts = [PROMPTS[i // 4] for i in range(12)]
    quorum = Quorum(groups=tuple(i // 4 for i in range(12)), needed=2, must=frozenset({0}))
    out = {}
    for paged in (True, False):
        e = engine(model, tok, slots=3, paged=paged)
        torch.manual_seed(5)
        out[paged] = e.generate_until(prompts, quorum, budgets=[40, 3, 17, 9] * 3)
        assert (e.slot_stats.block_columns > 0) == paged  # blocks, or the slots' buffers
        ended = ~out[paged].cut
        assert ended[:4].all() and sum(bool(ended[g * 4:g * 4 + 4].all()) for g in range(3)) >= 2
    both = ~out[True].cut & ~out[False].cut
    assert both.sum() >= 8
    assert torch.equal(out[True].response_ids[both], out[False].response_ids[both])
