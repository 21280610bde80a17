"""covey.rollout.lean_decode: a decode step in plain ops gives the bf16 model's own logits, bit for bit.

The tiny Llama has grouped-query attention (4 query heads over 2 key/value heads), so the
grouped score product is exercised; left-padded prompts of different lengths exercise the
mask and the per-row rotary positions.
"""

import copy

import pytest
import torch

from covey.models.hf_compat import with_cache
from covey.models.load import load_policy
from covey.models.tiny import tiny_llama
from covey.rollout.fast import FastEngine, buffer_cache
from covey.rollout.lean_decode import lean_step, rms_norm, rotary_tables, supports_lean_step
from covey.rollout.precision import low_precision_copy

PROMPTS = ["What is 2 + 3?", "hello there, how are you doing today", "x"]


@pytest.fixture(scope="module")
def tiny_bf16(tiny_model_dir):
    model, tok = load_policy(tiny_model_dir)
    return low_precision_copy(model, torch.bfloat16).eval(), tok


def prefill(model, ids, mask, capacity):
    cache = buffer_cache(model, capacity)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    out = model(input_ids=ids, attention_mask=mask, position_ids=positions, **with_cache(cache), use_cache=True)
    return cache, out.logits[:, -1]


def test_lean_steps_give_the_models_own_logits(tiny_bf16):
    model, tok = tiny_bf16
    model.config._attn_implementation = "eager"
    enc = tok(PROMPTS, return_tensors="pt", padding=True, add_special_tokens=False)
    ids, mask = enc["input_ids"], enc["attention_mask"]
    assert not mask.all()  # left padding present
    n, width = ids.shape
    with torch.inference_mode():
        cache_hf, logits = prefill(model, ids, mask, width + 6)
        cache_lean = copy.deepcopy(cache_hf)
        step = logits.float().argmax(-1)
        start = mask.sum(-1)
        for t in range(6):
            key_mask = torch.cat([mask, mask.new_ones(n, t + 1)], dim=1)
            ours = lean_step(model, step, start + t, key_mask, cache_lean)
            theirs = model(input_ids=step.unsqueeze(1), attention_mask=key_mask,
                           position_ids=(start + t).unsqueeze(1), **with_cache(cache_hf), use_cache=True).logits[:, -1]
            assert ours.dtype == torch.bfloat16
            assert torch.equal(ours, theirs), f"step {t}"
            for a, b in zip(cache_lean.layers, cache_hf.layers):
                assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)
            step = ours.float().argmax(-1)


def test_padding_is_masked_out(tiny_bf16):
    """A padded key position changes nothing, whatever it holds: its weight is exactly 0."""
    model, _ = tiny_bf16
    torch.manual_seed(0)
    ids = torch.randint(3, 100, (1, 5))
    mask = torch.tensor([[0, 0, 1, 1, 1]])
    with torch.inference_mode():
        cache, _ = prefill(model, ids, mask, 8)
        other = copy.deepcopy(cache)
        for layer in other.layers:  # garbage in the padded positions' keys and values
            layer.key_buf[:, :, :2] = 1e4
            layer.value_buf[:, :, :2] = -1e4
        key_mask = torch.tensor([[0, 0, 1, 1, 1, 1]])
        a = lean_step(model, torch.tensor([7]), torch.tensor([3]), key_mask, cache)
        b = lean_step(model, torch.tensor([7]), torch.tensor([3]), key_mask, other)
    assert torch.equal(a, b)


def test_rms_norm_and_rotary_tables_by_hand():
    model = tiny_llama(vocab_size=32, hidden_size=8, num_heads=2, num_kv_heads=1)
    norm = model.model.norm
    norm.weight.data = torch.tensor([1.0, 2.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0])
    # x = (2, 2, 2, 2, 2, 2, 2, 2): mean square 4, rsqrt(4 + 1e-6) ~ 0.5, so x / 2 = 1, times the weight
    out = rms_norm(norm, torch.full((1, 8), 2.0))
    assert torch.allclose(out, torch.tensor([[1.0, 2.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0]]), atol=1e-6)
    # head_dim 4, theta 10000: inv_freq = (1, 10000^-0.5 = 0.01); position 2 -> angles (2, 0.02, 2, 0.02)
    cos, sin = rotary_tables(model.model.rotary_emb, torch.tensor([2]), torch.float32)
    angles = torch.tensor([[2.0, 0.02, 2.0, 0.02]])
    assert torch.allclose(cos, angles.cos()) and torch.allclose(sin, angles.sin())


def test_engine_tokens_are_unchanged_by_the_lean_step(tiny_bf16):
    model, tok = tiny_bf16
    assert supports_lean_step(model)
    outs = []
    for lean in (True, False):
        engine = FastEngine(model, tok, max_new_tokens=16, temperature=0.9, lean=lean)
        engine.eos = sorted({tok.eos_token_id, *range(40, 90)})  # rows finish at different steps
        torch.manual_seed(11)
        outs.append(engine.generate(PROMPTS, 3))
    assert torch.equal(outs[0].response_ids, outs[1].response_ids)
    assert len(set(outs[0].response_mask.sum(1).tolist())) > 1


def test_only_eager_plain_llamas_take_the_lean_step(tiny_model_dir):
    fp32, _ = load_policy(tiny_model_dir)
    assert not supports_lean_step(fp32)  # float32 on a CPU runs SDPA: the HF forward
    bf16 = low_precision_copy(fp32, torch.bfloat16)
    assert supports_lean_step(bf16)
    bf16.config.rope_parameters = {**bf16.config.rope_parameters, "rope_type": "dynamic"}
    assert not supports_lean_step(bf16)  # its inv_freq changes with the sequence length
    bf16 = low_precision_copy(fp32, torch.bfloat16)
    bf16.config.attention_bias = True
    assert not supports_lean_step(bf16)
