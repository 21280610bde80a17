"""Chunked log-probs and entropy from logits: values, gradients, dtypes, and that no full copy is saved."""

import math

import pytest
import torch

from covey.algos import entropy_from_logits, logprobs_and_entropy, selective_log_softmax
from covey.algos.logits import DEFAULT_CHUNK

F64 = torch.float64


def case(seed=0, shape=(3, 4, 13), dtype=F64):
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(*shape, generator=g, dtype=F64) * 3).to(dtype).requires_grad_(True)
    tokens = torch.randint(0, shape[-1], shape[:-1], generator=g)
    return logits, tokens


def test_log_softmax_of_chosen_token_by_hand():
    # logits [0, ln 3] -> p = [1/4, 3/4]; chosen 1: log 0.75; chosen 0: log 0.25
    # temperature 2: z = [0, ln3 / 2] -> p1 = sqrt3 / (1 + sqrt3) = 0.633975
    logits = torch.tensor([[[0.0, math.log(3)], [0.0, math.log(3)]]], dtype=F64)
    out = selective_log_softmax(logits, torch.tensor([[1, 0]]))
    assert torch.allclose(out, torch.tensor([[math.log(0.75), math.log(0.25)]], dtype=F64))
    hot = selective_log_softmax(logits, torch.tensor([[1, 1]]), temperature=2.0)
    assert hot[0, 0].item() == pytest.approx(math.log(math.sqrt(3) / (1 + math.sqrt(3))))


@pytest.mark.parametrize("chunk", [1, 5, 1000])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_log_probs_and_gradient_match_full_log_softmax(chunk, temperature):
    logits, tokens = case()
    out = selective_log_softmax(logits, tokens, temperature=temperature, chunk_size=chunk)
    ref = torch.log_softmax(logits / temperature, -1).gather(-1, tokens[..., None]).squeeze(-1)
    assert torch.allclose(out, ref)
    w = torch.randn(out.shape, dtype=F64)
    g, = torch.autograd.grad((out * w).sum(), logits)
    rg, = torch.autograd.grad((ref * w).sum(), logits)
    assert torch.allclose(g, rg)


def test_gradcheck():
    logits, tokens = case(shape=(2, 3, 5))
    assert torch.autograd.gradcheck(lambda x: selective_log_softmax(x, tokens, 0.9, 2), (logits,))
    assert torch.autograd.gradcheck(lambda x: entropy_from_logits(x, 0.9, 2), (logits,))


def test_entropy_by_hand_and_against_reference():
    # p = [1/4, 3/4]: H = -(0.25 ln 0.25 + 0.75 ln 0.75) = 0.562335; uniform over 13: ln 13
    two = torch.tensor([[[0.0, math.log(3)]]], dtype=F64)
    assert entropy_from_logits(two).item() == pytest.approx(-(0.25 * math.log(0.25) + 0.75 * math.log(0.75)))
    assert entropy_from_logits(torch.zeros(1, 1, 13)).item() == pytest.approx(math.log(13), rel=1e-6)
    logits, _ = case()
    out = entropy_from_logits(logits, temperature=1.3, chunk_size=4)
    lp = torch.log_softmax(logits / 1.3, -1)
    ref = -(lp.exp() * lp).sum(-1)
    assert torch.allclose(out, ref)
    w = torch.randn(out.shape, dtype=F64)
    assert torch.allclose(torch.autograd.grad((out * w).sum(), logits)[0],
                          torch.autograd.grad((ref * w).sum(), logits)[0])


def test_fused_pair_by_hand():
    # logits [0, ln 3] -> p = [1/4, 3/4]; chosen 1: log 0.75; H = -(0.25 ln 0.25 + 0.75 ln 0.75) = 0.562335
    logits = torch.tensor([[[0.0, math.log(3)]]], dtype=F64)
    logp, entropy = logprobs_and_entropy(logits, torch.tensor([[1]]))
    assert logp.item() == pytest.approx(math.log(0.75))
    assert entropy.item() == pytest.approx(-(0.25 * math.log(0.25) + 0.75 * math.log(0.75)))
    logp_only, none = logprobs_and_entropy(logits, torch.tensor([[1]]), with_entropy=False)
    assert none is None and logp_only.item() == pytest.approx(math.log(0.75))


@pytest.mark.parametrize("chunk", [1, 5, 1000])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_fused_pair_values_and_gradients_match_full_log_softmax(chunk, temperature):
    # one pass gives both outputs; the gradient of any mix of them (or of one alone) is autograd's
    logits, tokens = case(seed=4)
    logp, entropy = logprobs_and_entropy(logits, tokens, temperature, chunk)
    lp = torch.log_softmax(logits / temperature, -1)
    ref_logp, ref_entropy = lp.gather(-1, tokens[..., None]).squeeze(-1), -(lp.exp() * lp).sum(-1)
    assert torch.allclose(logp, ref_logp) and torch.allclose(entropy, ref_entropy)
    w1, w2 = torch.randn(logp.shape, dtype=F64), torch.randn(logp.shape, dtype=F64)
    for mine, ref in (((logp * w1).sum() + (entropy * w2).sum(), (ref_logp * w1).sum() + (ref_entropy * w2).sum()),
                      ((logp * w1).sum(), (ref_logp * w1).sum()),
                      ((entropy * w2).sum(), (ref_entropy * w2).sum())):
        g, = torch.autograd.grad(mine, logits, retain_graph=True)
        rg, = torch.autograd.grad(ref, logits, retain_graph=True)
        assert torch.allclose(g, rg)
    assert torch.autograd.gradcheck(lambda x: logprobs_and_entropy(x, tokens[:2, :3], 0.9, 2),
                                    (logits[:2, :3].detach().requires_grad_(True),))


@pytest.mark.parametrize("temperature", [1.0, 0.5])
def test_float32_logits_are_not_changed_in_place(temperature):
    # the blocks are worked on in place: at temperature 1 a float32 block must still be copied first
    logits, tokens = case(dtype=torch.float32)
    before = logits.detach().clone()
    logp, entropy = logprobs_and_entropy(logits, tokens, temperature, chunk_size=5)
    (logp.sum() + entropy.sum()).backward()
    assert torch.equal(logits.detach(), before)


def test_bfloat16_logits_compute_in_float32():
    logits, tokens = case(dtype=torch.bfloat16)
    out = selective_log_softmax(logits, tokens)
    assert out.dtype == torch.float32
    ref = torch.log_softmax(logits.float(), -1).gather(-1, tokens[..., None]).squeeze(-1)
    assert torch.allclose(out, ref, atol=1e-5)
    out.sum().backward()
    assert logits.grad.dtype == torch.bfloat16 and torch.isfinite(logits.grad.float()).all()


def saved_numels(fn, logits):
    """numel of every tensor autograd saves for the backward of fn(logits), except logits itself."""
    sizes = []

    def pack(t):
        if t.data_ptr() != logits.data_ptr():
            sizes.append(t.numel())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn(logits)
    return sizes


def test_no_full_vocabulary_copy_is_saved():
    logits, tokens = case(shape=(4, 8, 50), dtype=torch.float32)
    rows = 4 * 8
    for fn in (lambda x: selective_log_softmax(x, tokens, temperature=0.7, chunk_size=4),
               lambda x: entropy_from_logits(x, temperature=0.7, chunk_size=4),
               lambda x: logprobs_and_entropy(x, tokens, temperature=1.0, chunk_size=4)):
        assert max(saved_numels(fn, logits)) <= rows   # only (N, L) tensors besides the logits
    # the naive version saves a full (N, L, V) log-softmax: the check above would catch it
    naive = saved_numels(lambda x: torch.log_softmax(x / 0.7, -1).gather(-1, tokens[..., None]), logits)
    assert max(naive) >= logits.numel()


def test_bad_arguments():
    logits, tokens = case()
    with pytest.raises(ValueError, match="temperature"):
        selective_log_softmax(logits, tokens, temperature=0.0)
    with pytest.raises(ValueError, match="tokens"):
        selective_log_softmax(logits, tokens[:, :2])
    with pytest.raises(ValueError, match="chunk_size"):
        entropy_from_logits(logits, chunk_size=0)


@pytest.mark.parametrize("chunk", [2, 1000])
def test_non_contiguous_view_is_walked_not_copied(chunk):
    # logits[:, :-1] (as a causal LM's output is sliced) is not viewable as (rows, V): it is processed
    # sequence by sequence; values and gradients must match the contiguous path
    full, _ = case(shape=(3, 5, 11))
    tokens = torch.randint(0, 11, (3, 4), generator=torch.Generator().manual_seed(3))
    view = full[:, :-1]
    assert not view.is_contiguous()
    w = torch.randn(3, 4, dtype=F64)
    for fn in (lambda x: selective_log_softmax(x, tokens, 0.8, chunk), lambda x: entropy_from_logits(x, 0.8, chunk)):
        out = fn(view)
        g, = torch.autograd.grad((out * w).sum(), full)
        copy = view.detach().contiguous().requires_grad_(True)
        ref = fn(copy)
        rg, = torch.autograd.grad((ref * w).sum(), copy)
        assert torch.allclose(out, ref) and torch.allclose(g[:, :-1], rg) and (g[:, -1] == 0).all()
        assert max(saved_numels(fn, view)) <= 12   # only (N, L) tensors are saved besides the view itself


def test_block_size_changes_no_bit_of_the_results():
    # each position's max, sums and gradient are computed within its own row, so how the rows are
    # cut into blocks (DEFAULT_CHUNK is a speed setting) must not change a single bit
    torch.manual_seed(7)
    logits = (torch.randn(3, 40, 300) * 3).to(torch.bfloat16).requires_grad_(True)
    tokens = torch.randint(0, 300, (3, 40))
    for view, chosen in ((logits, tokens), (logits[:, :-1], tokens[:, 1:])):  # walked as one block / by sequence
        results = []
        for chunk in (1, 7, DEFAULT_CHUNK, 256):
            logp, entropy = logprobs_and_entropy(view, chosen, 0.8, chunk)
            grad, = torch.autograd.grad(logp.sum() + 0.5 * entropy.sum(), logits)
            results.append((logp, entropy, grad))
        for other in results[1:]:
            assert all(torch.equal(a, b) for a, b in zip(results[0], other))
