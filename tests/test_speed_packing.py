"""covey.packing: bin plan, block-diagonal mask and layout, checked on small hand-made cases."""

import torch

from covey.packing import block_mask, pack, plan_bins, unpack


def test_first_fit_decreasing_stays_within_a_prompt_and_capacity():
    fed = [5, 3, 4, 0, 2, 6]
    prompt = [0, 0, 0, 0, 1, 1]
    bins = plan_bins(fed, prompt, capacity=8)
    # longest first: 6 (p1) -> A; 5 (p0) -> B; 4 (p0) -> C (B would hold 9); 3 (p0) -> B; 2 (p1) -> A.
    # Row 3 feeds nothing and is left out.
    assert bins == [[5, 4], [0, 1], [2]]


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
    packed = pack(responses, lengths, starts, prompt_of_row, prompt_mask, pad_id=0)
    # fed: row 0 -> 10, 11; row 1 -> 20; row 2 -> 30, 31, 32 (the last token of each is never fed)
    assert packed.prompt_of_bin.tolist() == [1, 0]
    assert packed.input_ids.tolist() == [[30, 31, 32], [10, 11, 20]]
    assert packed.targets.tolist() == [[31, 32, 33], [11, 12, 21]]
    assert packed.position_ids.tolist() == [[2, 3, 4], [5, 6, 5]]
    values = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    assert unpack(values, packed, 3, 3).tolist() == [[4.0, 5.0, 0.0], [6.0, 0.0, 0.0], [1.0, 2.0, 3.0]]
