"""rollout.precision: sampling from a bf16 copy of the fp32 policy, refreshed after each update."""

import pytest
import torch

from covey.config import ConfigError, load_config, validate_world
from covey.models.load import load_policy
from covey.rollout.fast import FastEngine
from covey.rollout.local import local_engine
from covey.rollout.precision import LowPrecisionEngine, copy_weights, low_precision_copy
from covey.training import rl
from covey.training.loop import open_run, steps
from tests.helpers import tiny_overrides


@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    return load_policy(tiny_model_dir)


def test_copy_rounds_parameters_keeps_buffers_and_ties(tiny):
    model, _ = tiny
    twin = low_precision_copy(model, torch.bfloat16)
    assert all(p.dtype == torch.bfloat16 and not p.requires_grad for p in twin.parameters())
    # rotary frequencies stay fp32: rounded, every position's rotation would shift
    assert all(b.dtype == torch.float32 for name, b in twin.named_buffers() if "inv_freq" in name)
    assert twin.lm_head.weight is twin.model.embed_tokens.weight  # SmolLM2-style tied embeddings stay tied
    assert all(p.dtype == torch.float32 and p.requires_grad for p in model.parameters())  # policy untouched
    for p, q in zip(model.parameters(), twin.parameters()):
        assert torch.equal(p.detach().to(torch.bfloat16), q)


def test_sync_weights_brings_an_update_into_the_copy(tiny_model_dir):
    model, tok = load_policy(tiny_model_dir)
    engine = local_engine("fast", model, tok, max_new_tokens=4, precision="bfloat16")
    assert isinstance(engine, LowPrecisionEngine) and engine.samples_a_copy and not engine.inner.samples_a_copy
    with torch.no_grad():
        model.model.layers[0].mlp.up_proj.weight.add_(0.5)
    stale = engine.copy.model.layers[0].mlp.up_proj.weight
    assert not torch.equal(stale, model.model.layers[0].mlp.up_proj.weight.to(torch.bfloat16))
    engine.sync_weights(model)
    for p, q in zip(model.parameters(), engine.copy.parameters()):
        assert torch.equal(p.detach().to(torch.bfloat16), q)


def test_same_precision_shares_the_policy_module(tiny):
    model, tok = tiny
    engine = local_engine("fast", model, tok, max_new_tokens=4, precision="float32")
    assert isinstance(engine, FastEngine) and engine.model is model


def test_bf16_copy_samples_from_nearly_the_policy_distribution(tiny):
    """The copy is the same network rounded: its next-token distribution is within bf16 rounding of the
    policy's (a wrong weight or a rounded rotary table would be far off), and greedy decoding mostly agrees."""
    model, tok = tiny
    ids = tok(["What is 2 + 3? The answer is"], return_tensors="pt")["input_ids"]
    twin = low_precision_copy(model, torch.bfloat16)
    with torch.no_grad():
        p = torch.softmax(model(ids).logits.float(), -1)
        q = torch.softmax(twin(ids).logits.float(), -1)
    assert (p - q).abs().sum(-1).max() < 0.05  # total variation x 2, per position
    a = FastEngine(model, tok, max_new_tokens=8).generate(["What is 2 + 3?"], 1, greedy=True)
    b = FastEngine(twin, tok, max_new_tokens=8).generate(["What is 2 + 3?"], 1, greedy=True)
    assert a.response_ids.shape == b.response_ids.shape


def test_copy_weights_requires_the_same_structure(tiny):
    model, _ = tiny
    with pytest.raises(ValueError):
        copy_weights(torch.nn.Linear(2, 2), model)


def test_a_released_copy_is_refilled_by_sync_or_by_the_next_rollout(tiny_model_dir):
    model, tok = load_policy(tiny_model_dir)
    prompts = ["What is 2 + 3?", "What is 7 * 6?"]
    kept = local_engine("fast", model, tok, max_new_tokens=5, precision="bfloat16")
    torch.manual_seed(3)
    expected = kept.generate(prompts, 2)
    engine = local_engine("fast", model, tok, max_new_tokens=5, precision="bfloat16")
    engine.release_weights()
    assert all(p.numel() == 0 for p in engine.copy.parameters())
    assert engine.copy.lm_head.weight is engine.copy.model.embed_tokens.weight  # still tied
    torch.manual_seed(3)
    again = engine.generate(prompts, 2)  # no update in between: refilled from the policy as it is
    assert torch.equal(again.response_ids, expected.response_ids)
    engine.release_weights()
    with torch.no_grad():
        model.model.layers[0].mlp.up_proj.weight.add_(0.5)
    engine.sync_weights(model)
    for p, q in zip(model.parameters(), engine.copy.parameters()):
        assert torch.equal(p.detach().to(torch.bfloat16), q)


def test_training_samples_from_the_copy_and_evaluates_the_policy(tiny_model_dir, tmp_path, monkeypatch):
    cfg = load_config(None, tiny_overrides(tiny_model_dir, tmp_path, **{"rollout.precision": "bfloat16"}))
    session = open_run(cfg, evaluate_before=False)
    run, engine, eval_engine = session.run, session.feed.engine, session.feed.eval_engine
    assert isinstance(engine.inner, LowPrecisionEngine)
    assert eval_engine.inner.model is run.policy  # held-out accuracy in the policy's own precision
    held = []  # bf16 weights the copy holds while the policy updates: none, it was released after sampling
    update = rl.update
    monkeypatch.setattr(rl, "update", lambda *a: held.append(
        sum(p.numel() for p in engine.inner.copy.parameters())) or update(*a))
    metrics = next(steps(session))
    session.close()
    assert held == [0]
    assert metrics["time/sync_weights"] >= 0
    for p, q in zip(run.policy.parameters(), engine.inner.copy.parameters()):  # refreshed after the update
        assert torch.equal(p.detach().to(torch.bfloat16), q)


def test_a_sharded_policy_cannot_be_copied():
    cfg = load_config(None, ["rollout.precision=bfloat16", "rollout.prompts_per_step=4"])
    with pytest.raises(ConfigError, match="rollout.precision=bfloat16"):
        validate_world(cfg, 2)
    validate_world(load_config(None, ["rollout.prompts_per_step=4"]), 2)  # auto falls back to float32 there


@pytest.mark.parametrize("engine_name", ["fast", "hf"])
@pytest.mark.parametrize("precision, expected", [("bfloat16", "eager"), ("float32", "sdpa")])
def test_cpu_sampling_from_a_bf16_copy_runs_eager_attention(tiny_model_dir, engine_name, precision, expected):
    """SDPA's CPU flash kernel took 43% of a bf16 rollout (covey/models/attention.py): the bf16 copy decodes with eager
    attention, an fp32 policy keeps SDPA, and the model's setting is restored after."""
    model, tok = load_policy(tiny_model_dir)
    engine = local_engine(engine_name, model, tok, max_new_tokens=3, precision=precision)
    sampler = engine.copy if precision == "bfloat16" else model
    seen = []
    sampler.model.layers[0].self_attn.register_forward_pre_hook(
        lambda module, args: seen.append(sampler.config._attn_implementation))
    prompts = [tok.apply_chat_template([{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True)
               for q in ("What is 2 + 3?", "What is 7 * 6?")]
    out = engine.generate(prompts, 2)
    assert len(out) == 4 and seen and set(seen) == {expected}
    assert sampler.config._attn_implementation == "sdpa"
