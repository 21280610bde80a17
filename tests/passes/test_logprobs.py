"""Packed, prefix-shared training forward (covey.passes.logprobs.packed_logprobs) equals the padded pass."""

import pytest
import torch

from covey.models.attention import attention_implementation
from covey.models.load import load_policy
from covey.passes import logprobs, packing
from tests.helpers import grouped_rollout


@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    model, tokenizer = load_policy(tiny_model_dir)
    return model.train(), tokenizer


def logprobs_and_grads(model, part, plain: bool, monkeypatch, temperature=0.7):
    model.zero_grad(set_to_none=True)
    with monkeypatch.context() as patch:
        if plain:
            patch.setattr(logprobs, "packs", lambda model: False)
        logp, entropy, width = logprobs.policy_logprobs(model, part, temperature, with_entropy=True)
    mask = part.response_mask[:, :width]
    weights = torch.linspace(-1.0, 1.0, logp.numel()).view_as(logp)
    ((logp * weights * mask).sum() + 0.1 * (entropy * mask).sum()).backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    return logp.detach() * mask, entropy.detach() * mask, grads


@pytest.mark.parametrize("attention, capacity", [("sdpa", 256), ("sdpa", 1), ("eager", 256), ("eager", 2)])
def test_packed_pass_equals_padded_pass_values_and_gradients(tiny, monkeypatch, attention, capacity):
    """capacity 1: one response per packed row; eager: the additive form of the block mask."""
    model, tokenizer = tiny
    model.set_attn_implementation(attention)
    monkeypatch.setattr(packing, "MIN_CAPACITY" if attention == "sdpa" else "EAGER_CAPACITY", capacity)
    part = grouped_rollout(tokenizer)
    try:
        logp_s, ent_s, grads_s = logprobs_and_grads(model, part, False, monkeypatch)
        logp_p, ent_p, grads_p = logprobs_and_grads(model, part, True, monkeypatch)
    finally:
        model.set_attn_implementation("sdpa")
    torch.testing.assert_close(logp_s, logp_p, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ent_s, ent_p, atol=1e-5, rtol=1e-5)
    assert grads_s.keys() == grads_p.keys()
    for name in grads_p:
        torch.testing.assert_close(grads_s[name], grads_p[name], atol=1e-5, rtol=1e-4, msg=name)


@pytest.mark.parametrize("multiple", [16, 5])
def test_packed_width_padded_to_a_multiple_changes_no_value_or_gradient(tiny, monkeypatch, multiple):
    """Under bf16 autocast the packed width is rounded up (few distinct shapes for oneDNN): the extra
    padding positions attend only to themselves and nothing reads them."""
    model, tokenizer = tiny
    part = grouped_rollout(tokenizer)
    logp_a, ent_a, grads_a = logprobs_and_grads(model, part, False, monkeypatch)
    widths = []

    def padded_pack(*args, **kwargs):
        packed = packing.pack(*args, **{**kwargs, "width_multiple": multiple})
        widths.append(packed.input_ids.shape[1])
        return packed

    monkeypatch.setattr(logprobs, "pack", padded_pack)
    logp_b, ent_b, grads_b = logprobs_and_grads(model, part, False, monkeypatch)
    assert widths and all(w % multiple == 0 for w in widths)
    torch.testing.assert_close(logp_a, logp_b, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ent_a, ent_b, atol=1e-5, rtol=1e-5)
    for name in grads_a:
        torch.testing.assert_close(grads_a[name], grads_b[name], atol=1e-5, rtol=1e-4, msg=name)


def test_rows_in_any_order_and_distinct_prompts(tiny, monkeypatch):
    """Interleaved groups are matched row by row; distinct prompts each get their own packed rows."""
    model, tokenizer = tiny
    part = grouped_rollout(tokenizer, groups=3, group_size=2)
    shuffled = part.select(torch.tensor([3, 0, 5, 1, 4, 2]))
    first, inverse = logprobs.shared_prompts(shuffled.prompt_ids, shuffled.prompt_mask)
    assert torch.equal(shuffled.prompt_ids[first][inverse], shuffled.prompt_ids)
    with torch.no_grad():
        logp_s, _, width = logprobs.policy_logprobs(model, shuffled, 1.0)
        monkeypatch.setattr(logprobs, "packs", lambda model: False)
        logp_p, _, _ = logprobs.policy_logprobs(model, shuffled, 1.0)
    mask = shuffled.response_mask[:, :width]
    torch.testing.assert_close(logp_s * mask, logp_p * mask, atol=1e-5, rtol=1e-5)
    distinct = part.select(torch.tensor([0, 2, 4]))
    with torch.no_grad():
        logp_s, _, width = logprobs.policy_logprobs(model, distinct, 1.0)
        monkeypatch.undo()
        logp_p, _, _ = logprobs.policy_logprobs(model, distinct, 1.0)
    mask = distinct.response_mask[:, :width]
    torch.testing.assert_close(logp_s * mask, logp_p * mask, atol=1e-5, rtol=1e-5)


def test_batched_reference_logprobs_unchanged(tiny, monkeypatch):
    model, tokenizer = tiny
    part = grouped_rollout(tokenizer, groups=2, group_size=4)
    shared = logprobs.batched_logprobs(model, part, 1.0, micro_batch_size=4)
    monkeypatch.setattr(logprobs, "packs", lambda model: False)
    plain = logprobs.batched_logprobs(model, part, 1.0, micro_batch_size=4)
    torch.testing.assert_close(shared, plain, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("precision, weights, multiple", [
    ("none", torch.float32, 1), ("bfloat16", torch.float32, logprobs.BF16_WIDTH_MULTIPLE),
    ("none", torch.bfloat16, logprobs.BF16_WIDTH_MULTIPLE)])
def test_packed_width_is_bucketed_whenever_the_pass_runs_in_bf16(tiny_model_dir, monkeypatch, precision, weights,
                                                                 multiple):
    """bf16 autocast or bf16 weights: oneDNN would keep memory for every width (covey/passes/packing.py)."""
    model, tokenizer = load_policy(tiny_model_dir, dtype=weights)
    seen = []
    monkeypatch.setattr(logprobs, "pack", lambda *a, **k: seen.append(k["width_multiple"]) or packing.pack(*a, **k))
    with torch.no_grad():
        logprobs.policy_logprobs(model, grouped_rollout(tokenizer), 1.0, precision=precision)
    assert seen == [multiple]


@pytest.mark.parametrize("precision, weights, expected", [
    ("none", torch.float32, "sdpa"), ("bfloat16", torch.float32, "eager"), ("none", torch.bfloat16, "eager")])
def test_bf16_packed_pass_on_cpu_runs_eager_attention_then_restores_the_model(tiny_model_dir, monkeypatch, precision,
                                                                               weights, expected):
    """CPU bf16: eager attention (faster than SDPA's flash kernel with a block mask); the model keeps SDPA after,
    and the values match the padded pass within bf16 rounding."""
    model, tokenizer = load_policy(tiny_model_dir, dtype=weights)
    seen = []
    model.model.layers[0].self_attn.register_forward_pre_hook(
        lambda module, args: seen.append(model.config._attn_implementation))
    part = grouped_rollout(tokenizer)
    with torch.no_grad():
        packed, _, width = logprobs.policy_logprobs(model, part, 1.0, precision=precision)
        assert seen == [expected, expected] and model.config._attn_implementation == "sdpa"
        monkeypatch.setattr(logprobs, "packs", lambda model: False)
        padded, _, _ = logprobs.policy_logprobs(model, part, 1.0, precision=precision)
    mask = part.response_mask[:, :width]
    torch.testing.assert_close(packed * mask, padded * mask, atol=0.1, rtol=0.02)


def test_attention_implementation_is_restored_after_an_error(tiny):
    model, _ = tiny
    with pytest.raises(RuntimeError, match="boom"):
        with attention_implementation(model, "eager"):
            assert model.config._attn_implementation == "eager"
            raise RuntimeError("boom")
    assert model.config._attn_implementation == "sdpa"
