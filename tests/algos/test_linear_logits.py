"""Log-probs and entropy from hidden states and the output layer (no full logits): by hand, and equal
to the unfused path (the output layer, then logprobs_and_entropy) in values and gradients."""

import math

import pytest
import torch
import torch.nn.functional as F

from covey.algos import linear_logprobs_and_entropy, logprobs_and_entropy

F64 = torch.float64


def test_log_prob_entropy_and_gradients_by_hand():
    # h = [1, 0], W = [[0, 0], [ln 3, 0]], b = 0: z = W h = [0, ln 3], p = [1/4, 3/4]
    # chosen token 1: log p = ln 0.75; entropy H = -(1/4 ln 1/4 + 3/4 ln 3/4) = 0.562335
    # d log p_1 / dz = onehot(1) - p = [-1/4, 1/4]
    #   dW = (dz) h^T = [[-1/4, 0], [1/4, 0]];  dh = W^T dz = [-1/4 * 0 + 1/4 * ln 3, 0] = [ln3 / 4, 0];  db = dz
    h = torch.tensor([[[1.0, 0.0]]], dtype=F64, requires_grad=True)
    w = torch.tensor([[0.0, 0.0], [math.log(3), 0.0]], dtype=F64, requires_grad=True)
    b = torch.zeros(2, dtype=F64, requires_grad=True)
    logp, entropy = linear_logprobs_and_entropy(h, w, b, torch.tensor([[1]]))
    assert logp.item() == pytest.approx(math.log(0.75))
    assert entropy.item() == pytest.approx(-(0.25 * math.log(0.25) + 0.75 * math.log(0.75)))
    assert entropy.item() == pytest.approx(0.562335, abs=1e-6)
    logp.sum().backward()
    assert torch.allclose(w.grad, torch.tensor([[-0.25, 0.0], [0.25, 0.0]], dtype=F64))
    assert torch.allclose(h.grad, torch.tensor([[[math.log(3) / 4, 0.0]]], dtype=F64))
    assert torch.allclose(b.grad, torch.tensor([-0.25, 0.25], dtype=F64))


def case(seed=0, n=3, length=5, d=6, v=11, bias=True):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(n, length, d, generator=g, dtype=F64).requires_grad_(True)
    w = torch.randn(v, d, generator=g, dtype=F64).requires_grad_(True)
    b = torch.randn(v, generator=g, dtype=F64).requires_grad_(True) if bias else None
    return h, w, b, torch.randint(0, v, (n, length), generator=g)


@pytest.mark.parametrize("chunk", [1, 4, 100])
@pytest.mark.parametrize("bias", [True, False])
def test_equals_the_unfused_path_values_and_gradients(chunk, bias):
    h, w, b, tokens = case(bias=bias)
    logp, entropy = linear_logprobs_and_entropy(h, w, b, tokens, temperature=0.7, chunk_size=chunk)
    ref_logp, ref_entropy = logprobs_and_entropy(F.linear(h, w, b), tokens, temperature=0.7)
    assert torch.allclose(logp, ref_logp) and torch.allclose(entropy, ref_entropy)
    gl, ge = torch.randn(logp.shape, dtype=F64), torch.randn(logp.shape, dtype=F64)
    params = [x for x in (h, w, b) if x is not None]
    got = torch.autograd.grad((logp * gl).sum() + (entropy * ge).sum(), params)
    want = torch.autograd.grad((ref_logp * gl).sum() + (ref_entropy * ge).sum(), params)
    for a, c in zip(got, want):
        assert torch.allclose(a, c)


def test_log_probs_alone_and_frozen_weights():
    # no entropy asked: None; a frozen output layer (w without grad) gives the hidden states' gradient only
    h, w, b, tokens = case()
    w, b = w.detach(), b.detach()
    logp, entropy = linear_logprobs_and_entropy(h, w, b, tokens, chunk_size=2, with_entropy=False)
    assert entropy is None
    ref = logprobs_and_entropy(F.linear(h, w, b), tokens, with_entropy=False)[0]
    g, = torch.autograd.grad(logp.sum(), h)
    rg, = torch.autograd.grad(ref.sum(), h)
    assert torch.allclose(g, rg)


def test_bf16_autocast_matches_the_unfused_autocast_path():
    # under bf16 autocast both paths multiply in bf16 and read the logits in float32
    h, w, b, tokens = (x.detach().float() if x.is_floating_point() else x for x in case(v=64))
    h.requires_grad_(True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logp, entropy = linear_logprobs_and_entropy(h, w, b, tokens, chunk_size=4)
        ref_logp, ref_entropy = logprobs_and_entropy(F.linear(h, w, b), tokens)
    assert logp.dtype == torch.float32
    assert torch.allclose(logp, ref_logp) and torch.allclose(entropy, ref_entropy)
    g, = torch.autograd.grad(logp.sum(), h)
    rg, = torch.autograd.grad(ref_logp.sum(), h)
    assert torch.allclose(g, rg, atol=1e-2)


def test_bad_arguments_name_themselves():
    h, w, b, tokens = case()
    with pytest.raises(ValueError, match="temperature"):
        linear_logprobs_and_entropy(h, w, b, tokens, temperature=0)
    with pytest.raises(ValueError, match="must match hidden"):
        linear_logprobs_and_entropy(h, w, b, tokens[:, :2])
