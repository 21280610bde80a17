"""covey.passes.packing: bin plan, block-diagonal mask and layout, checked on small hand-made cases."""

import torch

from covey.passes.packing import EAGER_CAPACITY, MIN_CAPACITY, block_mask, pack, plan_bins, row_capacity, unpack


def test_bins_are_per_prompt_within_capacity_and_even():
    fed = [5, 3, 4, 0, 2, 6]
    prompt = [0, 0, 0, 0, 1, 1]
    # prompt 0 feeds 12 > 8: two bins, longest first into the emptiest: 5 -> A, 4 -> B, 3 -> B (7).
    # prompt 1 feeds 8: one bin. Row 3 feeds nothing and is left out.
    assert plan_bins(fed, prompt, capacity=8) == [[0], [2, 1], [5, 4]]
    # one more bin when the even split still overflows: 7 + 7 + 2 in bins of 8
    assert plan_bins([7, 7, 2], [0, 0, 0], capacity=8) == [[0], [1], [2]]


def test_block_mask_by_hand():
    """Row: block 7 (2 tokens), block 9 (1 token), one pad slot; prompt of 3 with a left pad."""
    block = torch.tensor([[7, 7, 9, -1]])
    prompt_mask = torch.tensor([[0, 1, 1]])
    expected = torch.tensor([
        # prompt   | packed tokens
        [0, 1, 1,   1, 0, 0, 0],   # block 7, token 0
        [0, 1, 1,   1, 1, 0, 0],   # block 7, token 1
        [0, 1, 1,   0, 0, 1, 0],   # block 9, token 0: not block 7
        [0, 0, 0,   0, 0, 0, 1],   # padding: itself only
    ], dtype=torch.bool)
    assert torch.equal(block_mask(block, prompt_mask)[0, 0], expected)


def test_pack_layout_positions_targets_and_unpack():
    responses = torch.tensor([[10, 11, 12, 0], [20, 21, 0, 0], [30, 31, 32, 33]])
    lengths = torch.tensor([3, 2, 4])
    starts = torch.tensor([5, 5, 2])   # real prompt lengths
    prompt_of_row = torch.tensor([0, 0, 1])
    prompt_mask = torch.tensor([[1, 1, 1, 1, 1], [0, 0, 0, 1, 1]])
    packed = pack(responses, lengths, starts, prompt_of_row, prompt_mask)
    # fed: row 0 -> 10, 11; row 1 -> 20; row 2 -> 30, 31, 32 (the last token of each is never fed)
    assert packed.prompt_of_bin.tolist() == [0, 1]
    assert packed.input_ids.tolist() == [[10, 11, 20], [30, 31, 32]]
    assert packed.targets.tolist() == [[11, 12, 21], [31, 32, 33]]
    assert packed.position_ids.tolist() == [[5, 6, 5], [2, 3, 4]]
    values = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    assert unpack(values, packed, 3, 3).tolist() == [[1.0, 2.0, 0.0], [3.0, 0.0, 0.0], [4.0, 5.0, 6.0]]


def test_row_capacity_keeps_rows_short_for_eager_attention():
    # eager attention builds the masked (T, P + T) scores of a row: its rows hold fewer tokens
    assert row_capacity("eager") == EAGER_CAPACITY < MIN_CAPACITY == row_capacity("sdpa")
    responses = torch.tensor([[10, 11, 12, 0], [20, 21, 0, 0], [30, 31, 32, 33]])
    lengths, starts = torch.tensor([3, 2, 4]), torch.tensor([5, 5, 5])
    one_prompt, prompt_mask = torch.tensor([0, 0, 0]), torch.ones(1, 5, dtype=torch.long)
    # fed 2 + 1 + 3 = 6 tokens: one row by default; capacity 3 (the longest fed) -> rows [3], [2, 1]
    assert pack(responses, lengths, starts, one_prompt, prompt_mask).input_ids.shape == (1, 6)
    short = pack(responses, lengths, starts, one_prompt, prompt_mask, min_capacity=1)
    assert short.input_ids.tolist() == [[30, 31, 32], [10, 11, 20]]
