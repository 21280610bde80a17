"""DPO loss and pair selection on hand-derived numbers (reasoning in the comments)."""

import math

import pytest
import torch

from covey.algos import best_worst_pairs, dpo_loss, sequence_logprob

F64 = torch.float64


def test_sequence_logprob_ignores_masked_tokens():
    # row 0: -1 + -2 (third token masked) = -3; row 1: -0.5 only
    logp = torch.tensor([[-1.0, -2.0, -9.0], [-0.5, -7.0, -7.0]], dtype=F64)
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    assert sequence_logprob(logp, mask).tolist() == [-3.0, -0.5]


def test_dpo_loss_two_pairs_by_hand():
    # beta = 0.5
    # pair 0: logp_c - ref_c = -3 - (-4) = 1, logp_r - ref_r = -5 - (-5) = 0
    #         chosen reward 0.5, rejected 0, margin 0.5: l0 = -log sigmoid(0.5) = log(1 + e^-0.5)
    # pair 1: logp_c - ref_c = -2 - (-1) = -1, logp_r - ref_r = -1 - (-2) = 1
    #         chosen reward -0.5, rejected 0.5, margin -1: l1 = log(1 + e^1)
    # loss = (l0 + l1) / 2
    pc = torch.tensor([-3.0, -2.0], dtype=F64, requires_grad=True)
    pr = torch.tensor([-5.0, -1.0], dtype=F64, requires_grad=True)
    rc = torch.tensor([-4.0, -1.0], dtype=F64)
    rr = torch.tensor([-5.0, -2.0], dtype=F64)
    loss, m = dpo_loss(pc, pr, rc, rr, beta=0.5)
    l0, l1 = math.log1p(math.exp(-0.5)), math.log1p(math.exp(1.0))
    assert loss.item() == pytest.approx((l0 + l1) / 2)
    assert m["dpo/loss"] == pytest.approx((l0 + l1) / 2)
    assert m["dpo/reward_chosen"] == pytest.approx((0.5 - 0.5) / 2)
    assert m["dpo/reward_rejected"] == pytest.approx((0.0 + 0.5) / 2)
    assert m["dpo/margin"] == pytest.approx((0.5 - 1.0) / 2)
    assert m["dpo/pair_accuracy"] == 0.5
    # d l / d logp_c = -beta * sigmoid(-margin); d l / d logp_r = +beta * sigmoid(-margin); each / 2 pairs
    loss.backward()
    s0, s1 = 1 / (1 + math.exp(0.5)), 1 / (1 + math.exp(-1.0))
    assert pc.grad.tolist() == pytest.approx([-0.5 * s0 / 2, -0.5 * s1 / 2])
    assert pr.grad.tolist() == pytest.approx([0.5 * s0 / 2, 0.5 * s1 / 2])


def test_dpo_loss_no_gradient_into_reference_and_zero_margin_is_log2():
    # equal policy and reference: margin 0, loss = -log(1/2) = log 2
    pc = torch.tensor([-2.0], dtype=F64, requires_grad=True)
    rc = torch.tensor([-2.0], dtype=F64, requires_grad=True)
    loss, _ = dpo_loss(pc, pc * 0 - 3, rc, rc.detach() * 0 - 3, beta=0.1)
    assert loss.item() == pytest.approx(math.log(2))
    loss.backward()
    assert rc.grad is None


def test_dpo_loss_global_denominator_makes_micro_batches_add_up():
    # summing the losses of two halves with num_pairs=4 equals the loss of all four pairs
    g = torch.Generator().manual_seed(0)
    pc, pr, rc, rr = (torch.randn(4, generator=g, dtype=F64) for _ in range(4))
    whole, _ = dpo_loss(pc, pr, rc, rr, beta=0.3)
    halves = sum(dpo_loss(pc[s], pr[s], rc[s], rr[s], beta=0.3, num_pairs=4)[0]
                 for s in (slice(0, 1), slice(1, 4)))
    assert halves.item() == pytest.approx(whole.item())


def test_dpo_loss_large_margin_stays_finite():
    loss, _ = dpo_loss(torch.tensor([0.0]), torch.tensor([-1e4]), torch.tensor([0.0]), torch.tensor([0.0]), 1.0)
    assert loss.item() == pytest.approx(0.0)
    loss, _ = dpo_loss(torch.tensor([-1e4]), torch.tensor([0.0]), torch.tensor([0.0]), torch.tensor([0.0]), 1.0)
    assert loss.item() == pytest.approx(1e4)


def test_dpo_loss_rejects_nonpositive_beta():
    with pytest.raises(ValueError, match="beta"):
        dpo_loss(torch.zeros(1), torch.zeros(1), torch.zeros(1), torch.zeros(1), beta=0.0)


def test_best_worst_pairs_skips_uniform_groups_and_takes_first_on_ties():
    # group 0: scores 0, 1, 1 -> chosen index 1 (first max), rejected 0
    # group 1: all 0.5 -> no pair
    # group 2: 0.2, -1, 0.2 -> chosen 6 (first max), rejected 7
    scores = torch.tensor([0.0, 1.0, 1.0, 0.5, 0.5, 0.5, 0.2, -1.0, 0.2])
    groups = torch.tensor([0, 0, 0, 1, 1, 1, 2, 2, 2])
    chosen, rejected = best_worst_pairs(scores, groups)
    assert chosen.tolist() == [1, 6] and rejected.tolist() == [0, 7]
    chosen, rejected = best_worst_pairs(torch.zeros(4), torch.tensor([0, 0, 1, 1]))
    assert len(chosen) == 0 and len(rejected) == 0
