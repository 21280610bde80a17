"""Loss aggregation: hand numbers per mode, micro-batch invariance, multi-process totals."""

import pytest
import torch

from covey.algos import (
    AGGREGATIONS,
    Normalizer,
    PolicyInputs,
    PolicyLossOptions,
    aggregate,
    entropy_from_logits,
    kl_loss,
    make_normalizer,
    policy_loss,
    selective_log_softmax,
    step_totals,
    value_loss,
)

F64 = torch.float64

# row 0: 3 tokens summing to 6; row 1: 1 token (4); row 2: empty (its 99 is masked garbage)
X = torch.tensor([[1.0, 2.0, 3.0], [4.0, 7.0, 7.0], [99.0, 99.0, 99.0]], dtype=F64)
M = torch.tensor([[1, 1, 1], [1, 0, 0], [0, 0, 0]], dtype=torch.bool)


@pytest.mark.parametrize("mode,expected", [
    ("token_mean", (1 + 2 + 3 + 4) / 4),            # 10 / 4 tokens = 2.5
    ("seq_mean_token_mean", (6 / 3 + 4 / 1) / 2),   # (2 + 4) / 2 non-empty sequences = 3
    ("seq_mean_token_sum", (6 + 4) / 2),            # 5
    ("constant", 10 / (2 * 4)),                     # Dr. GRPO: 10 / (2 sequences * max_len 4) = 1.25
])
def test_aggregation_modes_by_hand(mode, expected):
    norm = make_normalizer(mode, M, max_len=4)
    assert (norm.total_tokens, norm.num_seqs, norm.max_len) == (4.0, 2.0, 4.0)
    assert aggregate(X, M, norm).item() == pytest.approx(expected)


def test_normalizer_validation():
    with pytest.raises(ValueError, match="valid: token_mean"):
        make_normalizer("mean", M)
    with pytest.raises(ValueError, match="max_len"):
        Normalizer.from_totals("constant", 4, 2, 0)
    assert make_normalizer("constant", M).max_len == 3.0  # default: L
    assert aggregate(X, torch.zeros_like(M), make_normalizer("token_mean", torch.zeros_like(M))).item() == 0.0


def toy_batch(n=6, length=5, hidden=4, vocab=7, seed=0):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.tensor([5, 1, 3, 0, 4, 2])[:n]
    return dict(
        h=torch.randn(n, length, hidden, generator=g, dtype=F64),
        tokens=torch.randint(0, vocab, (n, length), generator=g),
        mask=torch.arange(length)[None] < lengths[:, None],
        adv=torch.randn(n, length, generator=g, dtype=F64),
        old_values=torch.randn(n, length, generator=g, dtype=F64),
        returns=torch.randn(n, length, generator=g, dtype=F64),
        w0=torch.randn(hidden, vocab, generator=g, dtype=F64),
        v0=torch.randn(hidden, generator=g, dtype=F64),
        ref_w=torch.randn(hidden, vocab, generator=g, dtype=F64),
    )


def micro_loss(b, idx, w, v, norm, opts):
    """Everything a training step sums: clipped policy loss + KL loss + entropy bonus + value loss."""
    logits = b["h"][idx] @ w
    tokens, mask = b["tokens"][idx], b["mask"][idx]
    logp = selective_log_softmax(logits, tokens, chunk_size=3)
    old = selective_log_softmax(b["h"][idx] @ (b["w0"] * 1.3), tokens)   # ratios far from 1: clipping happens
    ref = selective_log_softmax(b["h"][idx] @ b["ref_w"], tokens)
    loss, _ = policy_loss("ppo_clip", PolicyInputs(logp, old, b["adv"][idx], mask), norm, opts)
    kl, _ = kl_loss(logp, ref, mask, norm, 0.1, "k3")
    ent = aggregate(entropy_from_logits(logits, chunk_size=2), mask, norm)
    values = b["h"][idx] @ v
    vloss, _ = value_loss(values, b["old_values"][idx], b["returns"][idx], mask, norm, 0.2)
    return loss + kl - 0.01 * ent + vloss


@pytest.mark.parametrize("mode", AGGREGATIONS)
@pytest.mark.parametrize("ratio_level", ["token", "sequence"])
def test_micro_batch_invariance(mode, ratio_level):
    b = toy_batch()
    n = b["mask"].shape[0]
    opts = PolicyLossOptions(ratio_level=ratio_level, dual_clip=3.0)
    norm = make_normalizer(mode, b["mask"], max_len=8)
    results = {}
    for size in (1, 2, n):
        w = b["w0"].clone().requires_grad_(True)
        v = b["v0"].clone().requires_grad_(True)
        total = 0.0
        for idx in torch.arange(n).split(size):
            loss = micro_loss(b, idx, w, v, norm, opts)
            loss.backward()
            total += loss.item()
        results[size] = (total, w.grad.clone(), v.grad.clone())
    full_loss, full_gw, full_gv = results[n]
    assert full_gw.abs().sum() > 0 and full_gv.abs().sum() > 0
    for size in (1, 2):
        total, gw, gv = results[size]
        assert total == pytest.approx(full_loss, rel=1e-12, abs=1e-12)
        assert torch.allclose(gw, full_gw, rtol=1e-10, atol=1e-12)
        assert torch.allclose(gv, full_gv, rtol=1e-10, atol=1e-12)


def test_wrong_local_normaliser_would_break_invariance():
    # the test above can fail: normalising each micro-batch by its own tokens changes the token_mean loss
    b = toy_batch()
    idx = torch.arange(6).split(2)
    full = aggregate(b["adv"], b["mask"], make_normalizer("token_mean", b["mask"])).item()
    local = sum(aggregate(b["adv"][i], b["mask"][i], make_normalizer("token_mean", b["mask"][i])).item() for i in idx)
    assert local != pytest.approx(full)


@pytest.mark.parametrize("mode", AGGREGATIONS)
def test_multi_process_totals_reproduce_full_batch_gradient(mode):
    # 2 "processes" with unequal token counts; DDP/FSDP average gradients, so the mean over processes
    # of their gradients must equal the single-process full-batch gradient.
    b = toy_batch()
    parts = [torch.tensor([0, 1, 2]), torch.tensor([3, 4, 5])]
    totals = sum(step_totals(b["mask"][p]) for p in parts)               # the all-reduce (SUM)
    norm = Normalizer.from_totals(mode, totals[0], totals[1], 8, num_processes=2)
    opts = PolicyLossOptions()
    grads = []
    for p in parts:
        w = b["w0"].clone().requires_grad_(True)
        v = b["v0"].clone().requires_grad_(True)
        micro_loss(b, p, w, v, norm, opts).backward()
        grads.append(w.grad)
    w = b["w0"].clone().requires_grad_(True)
    v = b["v0"].clone().requires_grad_(True)
    micro_loss(b, torch.arange(6), w, v, make_normalizer(mode, b["mask"], max_len=8), opts).backward()
    assert torch.allclose((grads[0] + grads[1]) / 2, w.grad, rtol=1e-10, atol=1e-12)


def test_make_normalizer_with_num_processes_scales_local_totals():
    # local mask has 4 tokens in 2 sequences; with 3 processes the global totals are estimated as 12 and 6
    norm = make_normalizer("token_mean", M, num_processes=3)
    assert (norm.total_tokens, norm.num_seqs, norm.num_processes) == (12.0, 6.0, 3)
    # each process's loss is scaled by num_processes: 3 * 10 / 12 = 2.5, the local token mean
    assert aggregate(X, M, norm).item() == pytest.approx(2.5)


def test_mask_truncated_leaves_truncated_rows_out_of_the_loss_and_its_normaliser():
    from covey.algos import mask_truncated
    # per-token terms 1 2 | 3 4 5 | 6 ; row 1 was cut at the token budget (no end token)
    values = torch.tensor([[1.0, 2.0, 0.0], [3.0, 4.0, 5.0], [6.0, 0.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    kept = mask_truncated(mask, torch.tensor([False, True, False]))
    assert kept.tolist() == [[1, 1, 0], [0, 0, 0], [1, 0, 0]]
    # token_mean: (1 + 2 + 6) / 3 tokens = 3.0, where all rows give 21 / 6 = 3.5
    assert float(aggregate(values, kept, make_normalizer("token_mean", kept))) == pytest.approx(3.0)
    assert float(aggregate(values, mask, make_normalizer("token_mean", mask))) == pytest.approx(3.5)
