"""The fused head (model.fused_kernels on CUDA; registered by hand here on the CPU): log-probs, entropy and
gradients equal the unfused pass's, in the padded and the packed pass and through the LoRA reference view,
and no tensor of logits wider than one block of positions exists."""

import copy

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from covey.algos.logits import DEFAULT_CHUNK
from covey.models.kernels import fused_head, use_fused_head
from covey.models.load import load_policy
from covey.passes import logprobs
from tests.helpers import grouped_rollout


@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    model, tokenizer = load_policy(tiny_model_dir)
    fused = copy.deepcopy(model)
    use_fused_head(fused)
    return model.train(), fused.train(), tokenizer


def run(model, part, plain, monkeypatch):
    model.zero_grad(set_to_none=True)
    with monkeypatch.context() as patch:
        if plain:
            patch.setattr(logprobs, "packs", lambda model: False)
        logp, entropy, width = logprobs.policy_logprobs(model, part, 0.7, with_entropy=True)
    mask = part.response_mask[:, :width]
    weights = torch.linspace(-1.0, 1.0, logp.numel()).view_as(logp)
    ((logp * weights * mask).sum() + 0.1 * (entropy * mask).sum()).backward()
    return logp.detach() * mask, entropy.detach() * mask, {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("plain", [True, False])
def test_fused_head_equals_the_unfused_pass(tiny, monkeypatch, plain):
    model, fused, tokenizer = tiny
    assert fused_head(model) is None and fused_head(fused) is not None
    part = grouped_rollout(tokenizer)
    logp, entropy, grads = run(model, part, plain, monkeypatch)
    f_logp, f_entropy, f_grads = run(fused, part, plain, monkeypatch)
    torch.testing.assert_close(f_logp, logp, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(f_entropy, entropy, atol=1e-5, rtol=1e-5)
    for name in grads:
        torch.testing.assert_close(f_grads[name], grads[name], atol=1e-5, rtol=1e-4, msg=name)


class WidestLogits(TorchDispatchMode):
    """The most positions any new tensor of vocabulary width (last dimension V) holds during a pass (views,
    such as the transposed output weights, allocate nothing)."""

    def __init__(self, vocab):
        super().__init__()
        self.vocab, self.rows = vocab, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.is_view:
            return out
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor) and t.dim() >= 2 and t.shape[-1] == self.vocab:
                self.rows = max(self.rows, t.numel() // self.vocab)
        return out


def test_no_micro_batch_wide_logits(tiny, monkeypatch):
    # 6 rows x 7 response tokens: the unfused padded pass holds (6, 7, V) logits (42 positions: the outputs
    # before each response token, none after the last); the fused one at most a block of DEFAULT_CHUNK = 32
    model, fused, tokenizer = tiny
    part = grouped_rollout(tokenizer)
    vocab = model.config.vocab_size
    sizes = {}
    for name, m in (("unfused", model), ("fused", fused)):
        with WidestLogits(vocab) as probe:
            run(m, part, True, monkeypatch)
        sizes[name] = probe.rows
    assert sizes["unfused"] >= len(part) * 7
    assert sizes["fused"] <= DEFAULT_CHUNK < sizes["unfused"]


def test_lora_reference_view_reads_the_base_model(tiny):
    pytest.importorskip("peft")
    from covey.models.lora import add_adapters, frozen_reference
    model, _, tokenizer = tiny
    policy = add_adapters(copy.deepcopy(model), rank=4, alpha=8)
    with torch.no_grad():
        for name, p in policy.named_parameters():
            if "lora_B" in name:
                p.normal_()  # adapters that change the policy: the reference must not see them
    use_fused_head(policy)
    reference = frozen_reference(policy)
    assert fused_head(reference) is not None
    part = grouped_rollout(tokenizer)
    want = logprobs.batched_logprobs(model, part, 0.7, 4)  # the base model itself, unfused
    torch.testing.assert_close(logprobs.batched_logprobs(reference, part, 0.7, 4), want, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(logprobs.batched_logprobs(policy, part, 0.7, 4), want, atol=1e-3)
