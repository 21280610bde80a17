"""The fast engine on a static KV cache (covey/rollout/static_decode.py), run eagerly on the CPU: the
tokens of the plain loop, greedy ones equal to `generate`'s (Llama, Qwen2, Qwen3, Gemma 3 with its sliding
layers), and their log-probs for importance sampling; row buckets, fused projections, reused buffers; the
families it refuses; the config keys that select it. The same decoding under CUDA graph capture:
test_static_decode_gpu.py.
"""

import pytest
import torch

from covey.config import ConfigError, load_config
from covey.models.hf_compat import position_ids
from covey.models.tiny import TINY_WINDOW, tiny_family_config, tiny_family_model, tiny_llama
from covey.rollout import static_decode
from covey.rollout.fast import FastEngine
from covey.rollout.hf import HFEngine
from covey.rollout.local import DecodeOptions, local_engine
from covey.rollout.precision import LowPrecisionEngine, low_precision_copy
from covey.rollout.static_step import supports_static_decode, views_of
from covey.training.loop import open_run, steps
from tests.helpers import tiny_overrides

PROMPTS = ["What is 2 + 3?", "hello there, how are you doing today", "x"]


def tiny_qwen2(vocab: int):
    """A random Qwen2 (biases on q/k/v, none on o) of the tiny Llama's size."""
    from transformers import Qwen2Config, Qwen2ForCausalLM
    torch.manual_seed(1)
    config = Qwen2Config(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                         tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=2)
    return Qwen2ForCausalLM(config).eval()


def with_varied_norms(model, seed: int = 0):
    """Every norm weight moved off its initial value (ones, or Gemma's zeros), so that a norm applied
    wrongly (Gemma's 1 + w, the QK-norms) changes the tokens; in eval mode."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.add_(torch.randn(param.shape, generator=generator) * 0.3)
    return model.eval()


def family_model(name: str, vocab: int):
    """A tiny model of a family the static step covers, its norms varied; `qwen3_wide_heads`: head_dim 32 with
    4 heads of a width 64 (not hidden / heads); `gemma3_softcap`: final logits softcapped, the full layers'
    rotary table linearly scaled."""
    if name in ("qwen3", "gemma3"):
        return with_varied_norms(tiny_family_model(name, vocab))
    from transformers import AutoModelForCausalLM
    config = tiny_family_config(name.split("_")[0], vocab)
    if name == "qwen3_wide_heads":
        config.head_dim = 32
    else:
        config.final_logit_softcapping = 3.0
        config.rope_parameters["full_attention"] = {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6}
    torch.manual_seed(0)
    return with_varied_norms(AutoModelForCausalLM.from_config(config))


def frequent_eos(engine, tok):
    """Many stop tokens, so rows finish at different steps (rows move to smaller buckets)."""
    engine.eos = sorted({tok.eos_token_id, *range(40, 90)})
    return engine


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_greedy_tokens_equal_generate(family, llama, tok):
    """80 new tokens after left-padded prompts: the attended columns cross a LENGTH_STEP bucket."""
    model = llama if family == "llama" else tiny_qwen2(len(tok))
    assert supports_static_decode(model)
    hf = HFEngine(model, tok, max_new_tokens=80).generate(PROMPTS, 1, greedy=True)
    engine = FastEngine(model, tok, max_new_tokens=80, static_cache=True)
    ours = engine.generate(PROMPTS, 1, greedy=True)
    assert engine.static.steps > 0  # the static loop ran, not the plain one
    assert torch.equal(hf.response_ids, ours.response_ids)
    assert torch.equal(hf.response_mask, ours.response_mask) and hf.completions == ours.completions


@pytest.mark.parametrize("family", ["qwen3", "qwen3_wide_heads", "gemma3", "gemma3_softcap"])
def test_greedy_tokens_equal_generate_for_qwen3_and_gemma3(family, tok):
    """Left-padded prompts of different lengths (the longest longer than the window), 60 new tokens: Gemma's
    sliding layers attend only the last TINY_WINDOW positions, the attended columns cross a LENGTH_STEP bucket.
    The frozen model (fused q/k/v and gate/up) gives the same tokens."""
    model = family_model(family, len(tok))
    assert supports_static_decode(model)
    hf = HFEngine(model, tok, max_new_tokens=60).generate(PROMPTS, 1, greedy=True)
    assert hf.prompt_mask.sum(1).max() > TINY_WINDOW and torch.all(hf.response_mask.sum(1) > 3 * TINY_WINDOW)
    engine = FastEngine(model, tok, max_new_tokens=60, static_cache=True)
    ours = engine.generate(PROMPTS, 1, greedy=True)
    assert engine.static.steps > 0 and not engine.static.fused
    assert torch.equal(hf.response_ids, ours.response_ids) and torch.equal(hf.response_mask, ours.response_mask)
    model.requires_grad_(False)
    frozen = FastEngine(model, tok, max_new_tokens=60, static_cache=True)
    assert torch.equal(frozen.generate(PROMPTS, 1, greedy=True).response_ids, hf.response_ids)
    assert frozen.static.fused


@pytest.mark.parametrize("rope", [
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256, "rope_theta": 10000.0},
    {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 256, "rope_theta": 10000.0}])
def test_rope_types_with_fixed_tables_equal_generate(rope, tok):
    """The step reads the rotary module's own frequencies and scaling: yarn's scaled cos/sin, llama3's bands."""
    from transformers import AutoModelForCausalLM
    config = tiny_family_config("llama", len(tok))
    config.rope_parameters = rope
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    assert supports_static_decode(model)
    hf = HFEngine(model, tok, max_new_tokens=30).generate(PROMPTS, 1, greedy=True)
    ours = FastEngine(model, tok, max_new_tokens=30, static_cache=True).generate(PROMPTS, 1, greedy=True)
    assert torch.equal(hf.response_ids, ours.response_ids)


@pytest.mark.parametrize("family", ["qwen3", "gemma3", "gemma3_softcap"])
def test_sampled_logprobs_equal_a_plain_forward(family, tok):
    """Float32: each sampled token's log-prob the static step returns (at the sampler's temperature) is a plain
    forward's over prompt + response, past the window, within 1e-5 (softcapping, monotone, shows here only)."""
    model = family_model(family, len(tok))
    engine = FastEngine(model, tok, max_new_tokens=32, temperature=0.8, static_cache=True)
    torch.manual_seed(7)
    out = engine.generate(PROMPTS, 2)
    assert engine.static.steps > 0 and torch.all(out.response_mask.sum(1) > TINY_WINDOW)
    mask, width = out.attention_mask, out.prompt_ids.shape[1]
    with torch.no_grad():
        logits = model(input_ids=out.input_ids, attention_mask=mask, position_ids=position_ids(mask)).logits
    forward = torch.log_softmax(logits[:, width - 1:-1].float() / 0.8, -1)
    forward = forward.gather(2, out.response_ids.unsqueeze(2)).squeeze(2) * out.response_mask
    assert torch.allclose(out.sample_logp, forward, atol=1e-5, rtol=0)


@pytest.mark.parametrize("max_new", [1, 2, 16, 17])
def test_greedy_tokens_at_lengths_around_a_check(max_new, llama, tok):
    """The first token is picked outside the step, later ones inside it and read back at checks
    (every CHECK_EVERY tokens) and at the end: one token, one step, a check at the last step, one after."""
    hf = HFEngine(llama, tok, max_new_tokens=max_new).generate(PROMPTS, 1, greedy=True)
    engine = FastEngine(llama, tok, max_new_tokens=max_new, static_cache=True)
    ours = engine.generate(PROMPTS, 1, greedy=True)
    assert engine.static.steps == max_new - 1
    assert torch.equal(hf.response_ids, ours.response_ids) and torch.equal(hf.response_mask, ours.response_mask)


def test_sampled_tokens_equal_the_plain_loop_as_rows_finish(llama, tok):
    """Same uniforms, same tokens; 12 rows start in the 16-row bucket and move to 8 as they finish."""
    plain = frequent_eos(FastEngine(llama, tok, max_new_tokens=60, temperature=0.9), tok)
    static = frequent_eos(FastEngine(llama, tok, max_new_tokens=60, temperature=0.9, static_cache=True), tok)
    torch.manual_seed(3)
    a = plain.generate(PROMPTS, 4)
    torch.manual_seed(3)
    b = static.generate(PROMPTS, 4)
    assert torch.equal(a.response_ids, b.response_ids) and torch.equal(a.truncated, b.truncated)
    assert len(set(a.response_mask.sum(1).tolist())) > 2  # rows finished at different steps
    assert set(static.static.states) == {16, 8}  # the buckets used
    assert torch.all(b.response_ids[b.response_mask == 0] == tok.pad_token_id)


def test_sampler_logprobs_equal_the_plain_loops_and_the_trainers(llama, tok):
    """The static path records each sampled token's log-prob at the sampler's logits / temperature, as the
    plain loop does (float rounding apart: its step is the model's forward in fewer kernels), and in float32
    they are the trainer's log-probs of the same tokens; padding carries 0."""
    from covey.passes.logprobs import batched_logprobs
    plain = frequent_eos(FastEngine(llama, tok, max_new_tokens=40, temperature=0.8), tok)
    static = frequent_eos(FastEngine(llama, tok, max_new_tokens=40, temperature=0.8, static_cache=True), tok)
    torch.manual_seed(5)
    a = plain.generate(PROMPTS, 3)
    torch.manual_seed(5)
    b = static.generate(PROMPTS, 3)
    assert torch.equal(a.response_ids, b.response_ids) and b.sample_logp is not None
    assert torch.allclose(a.sample_logp, b.sample_logp, atol=1e-4)
    assert torch.all(b.sample_logp[b.response_mask == 0] == 0) and torch.all(b.sample_logp <= 0)
    trainer = batched_logprobs(llama, b, 0.8, 4)
    assert torch.allclose(trainer, b.sample_logp, atol=1e-4)


def test_per_prompt_seeds_give_the_plain_loops_samples(llama, tok):
    plain = FastEngine(llama, tok, max_new_tokens=10)
    static = FastEngine(llama, tok, max_new_tokens=10, static_cache=True)
    a = plain.generate(PROMPTS[:2], 3, seeds=[11, 12])
    b = static.generate(PROMPTS[:2], 3, seeds=[11, 12])
    assert torch.equal(a.response_ids, b.response_ids)


def test_buffers_are_reused_between_calls_and_grow_for_longer_prompts(llama, tok):
    engine = FastEngine(llama, tok, max_new_tokens=8, static_cache=True)
    engine.generate(PROMPTS, 2)
    first = engine.static.states[8]
    engine.generate(PROMPTS[::-1], 2)
    assert engine.static.states[8] is first and first.capacity == static_decode.CAPACITY_STEP
    long_prompt = " ".join(["hello there"] * 80)
    hf = HFEngine(llama, tok, max_new_tokens=8).generate([long_prompt], 1, greedy=True)
    ours = engine.generate([long_prompt], 1, greedy=True)
    assert torch.equal(hf.response_ids, ours.response_ids)
    assert engine.static.states[8] is not first and engine.static.states[8].capacity > first.capacity


def test_a_frozen_copy_decodes_with_fused_projections_that_sync_updates(llama, tok):
    """The bf16 sampling copy's q/k/v and gate/up become views of one matrix each; copying an update
    into the copy (sync_weights) updates the fused matrices; the copy is never released."""
    policy = tiny_llama(len(tok))
    engine = local_engine("fast", policy, tok, max_new_tokens=12, precision="bfloat16",
                          decode=DecodeOptions("static"))
    assert isinstance(engine, LowPrecisionEngine) and engine.keeps_weights
    before = engine.generate(PROMPTS, 1, greedy=True)
    attn = engine.copy.model.layers[1].self_attn
    qkv = engine.inner.static.fused[(1, "qkv")][0]
    assert views_of(qkv, [attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight])
    engine.release_weights()  # a no-op: the static cache reads the copy in place
    assert all(p.numel() for p in engine.copy.parameters())
    with torch.no_grad():
        for p in policy.parameters():
            p.add_(torch.randn_like(p) * 0.5)
    engine.sync_weights(policy)
    after = engine.generate(PROMPTS, 1, greedy=True)
    fresh = FastEngine(low_precision_copy(policy, torch.bfloat16), tok, max_new_tokens=12, static_cache=True)
    assert torch.equal(after.response_ids, fresh.generate(PROMPTS, 1, greedy=True).response_ids)
    assert not torch.equal(after.response_ids, before.response_ids)


def test_models_it_does_not_cover_take_the_plain_loop(tok):
    model = tiny_llama(len(tok))
    model.config.rope_parameters = {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}
    assert not supports_static_decode(model)  # tables that change with the length
    engine = FastEngine(model, tok, max_new_tokens=4, static_cache=True)
    engine.generate(PROMPTS, 1)
    assert engine.static.steps == 0


@pytest.mark.parametrize("family", ["gpt_oss", "qwen3_5", "qwen3_moe", "qwen2_window", "mistral_window", "smollm3"])
def test_families_it_does_not_reproduce_are_refused(family, tok):
    """Experts, linear-attention layers, sliding windows outside Gemma 3, layers without rotary embeddings."""
    assert not supports_static_decode(tiny_family_model(family, len(tok)))


@pytest.mark.parametrize("family, change", [
    ("qwen3", {"layer_types": ["sliding_attention", "full_attention"] * 2}),
    ("qwen3", {"rope_parameters": {"rope_type": "longrope", "rope_theta": 10000.0}}),
    ("gemma3", {"attn_logit_softcapping": 50.0}), ("gemma3", {"use_bidirectional_attention": True}),
    ("gemma3", {"hidden_activation": "gelu"}),
    ("gemma3", {"rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
                                    "full_attention": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e6}}}),
])
def test_options_the_step_does_not_reproduce_are_refused(family, change, tok):
    model = tiny_family_model(family, len(tok))
    assert supports_static_decode(model)
    for key, value in change.items():
        setattr(model.config, key, value)
    assert not supports_static_decode(model)


def test_decode_options_resolve_by_device():
    plain = {"static_cache": False, "cuda_graphs": False, "compile_decode": False, "persistent": True, "slots": 0,
             "speculate": 0}
    assert DecodeOptions().resolve("cpu") == plain  # the CPU keeps its plain loop
    assert DecodeOptions("static").resolve("cpu") == {**plain, "static_cache": True}
    assert DecodeOptions("compile").resolve("cpu") == {**plain, "static_cache": True, "compile_decode": True}
    assert DecodeOptions().resolve("cuda") == {**plain, "static_cache": True, "cuda_graphs": True}
    assert DecodeOptions("compile", persistent=False).resolve("cuda") == {
        "static_cache": True, "cuda_graphs": True, "compile_decode": True, "persistent": False, "slots": 0,
        "speculate": 0}
    assert DecodeOptions("plain").resolve("cuda") == plain
    # slots decode with plain steps: auto on a GPU is then plain
    assert DecodeOptions(slots=4).resolve("cuda") == {**plain, "slots": 4}
    assert DecodeOptions(speculate=4).resolve("cuda") == {**plain, "speculate": 4}  # drafts verify in that loop
    with pytest.raises(ValueError, match="rollout.decode=graphs captures CUDA graphs"):
        DecodeOptions("graphs").resolve("cpu")
    with pytest.raises(ValueError, match="rollout.decode='fastest'"):
        DecodeOptions("fastest").resolve("cpu")


@pytest.mark.parametrize("keys, message", [
    (["rollout.decode=fastest"], "rollout.decode='fastest' is not one of"),
    (["rollout.engine=hf", "rollout.decode=static"], "rollout.engine=hf does not use it"),
    (["rollout.engine=hf", "rollout.decode=compile"], "rollout.engine=hf does not use it"),
])
def test_config_key_is_checked(keys, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, keys)
    load_config(None, ["rollout.engine=hf", "rollout.decode=plain"])


def test_a_training_step_samples_on_the_static_cache(tiny_model_dir, tmp_path):
    """With importance sampling on (algo.tis.cap): the static path hands the sampler's log-probs over."""
    cfg = load_config(None, tiny_overrides(tiny_model_dir, tmp_path, **{"rollout.decode": "static",
                                                                        "algo.tis.cap": 2}))
    session = open_run(cfg, evaluate_before=False)
    engine, eval_engine = session.feed.engine, session.feed.eval_engine
    fast = engine.inner  # the fast engine, on whole parameters (GatheredGeneration)
    assert fast.static is not None and fast.static.persistent
    metrics = next(steps(session))
    session.close()
    assert fast.static.steps > 0 and metrics["optim/grad_norm"] >= 0
    # fp32 sampling from the trained weights: every ratio pi_old / pi_sampler is 1 up to rounding
    assert metrics["tis/weight_mean"] == pytest.approx(1.0, abs=1e-3) and metrics["tis/capped_frac"] == 0.0
    assert abs(metrics["sampler/log_ratio_mean"]) < 1e-4
    assert eval_engine.inner is engine.inner  # fp32 sampling: one engine for both
