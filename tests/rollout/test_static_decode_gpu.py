"""The fast engine's static-cache decoding under CUDA graph capture (marked `gpu`: skipped without one;
run by scripts/gpu_check.sh and scripts/gpu_speed.sh). The eager CPU twin: test_static_decode.py.

Greedy tokens of the tiny model in float32 equal `generate`'s with graphs and with torch.compile's
kernels in them, and so do tiny Qwen3's (QK-norm) and Gemma 3's (sliding layers, the window's mask built
inside the graph); graphs are captured once and replayed in later calls; a weight update copied into a
bf16 sampling copy reaches the replayed graphs; the last greedy tokens equal the eager static loop's.
"""

import pytest
import torch

from covey.models.tiny import TINY_WINDOW, tiny_family_model, tiny_llama
from covey.rollout.fast import FastEngine
from covey.rollout.hf import HFEngine
from covey.rollout.local import DecodeOptions, local_engine
from covey.rollout.precision import low_precision_copy

pytestmark = pytest.mark.gpu

PROMPTS = ["What is 2 + 3?", "hello there, how are you doing today", "x"]


@pytest.fixture(scope="module")
def model(tok):
    return tiny_llama(len(tok)).cuda().eval()


def graph_engine(model, tok, mode="graphs", max_new=80, **kwargs):
    return FastEngine(model, tok, max_new_tokens=max_new, **DecodeOptions(mode).resolve("cuda"), **kwargs)


@pytest.mark.parametrize("mode", ["graphs", "compile"])
def test_greedy_tokens_under_graph_capture_equal_generate(mode, model, tok):
    hf = HFEngine(model, tok, max_new_tokens=80).generate(PROMPTS, 1, greedy=True)
    engine = graph_engine(model, tok, mode)
    ours = engine.generate(PROMPTS, 1, greedy=True)
    # 80 steps after ~12 prompt columns: two length buckets; compiled steps attend the whole capacity
    assert engine.static.runner.captures == (1 if mode == "compile" else 2)
    assert torch.equal(hf.response_ids, ours.response_ids)
    assert torch.equal(hf.response_mask, ours.response_mask)


def with_varied_norms(model):
    """Norm weights moved off their initial value, so a norm applied wrongly changes the tokens."""
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.add_(torch.randn(param.shape, generator=generator) * 0.3)
    return model.eval()


@pytest.mark.parametrize("family", ["qwen3", "gemma3"])
def test_qwen3_and_gemma3_greedy_tokens_under_graph_capture(family, tok):
    """Float32: 60 tokens, past Gemma's TINY_WINDOW, equal `generate`'s. bf16 (the sampling copy, fused
    projections): the graphs' tokens equal the eager static loop's, the same kernels; not compared with
    `generate`, whose bf16 rounding alone flips some near-tied greedy picks of these random models."""
    model = with_varied_norms(tiny_family_model(family, len(tok))).cuda()
    hf = HFEngine(model, tok, max_new_tokens=60).generate(PROMPTS, 1, greedy=True)
    assert torch.all(hf.response_mask.sum(1) > TINY_WINDOW)
    engine = graph_engine(model, tok, max_new=60)
    ours = engine.generate(PROMPTS, 1, greedy=True)
    assert engine.static.runner.captures >= 1
    assert torch.equal(hf.response_ids, ours.response_ids) and torch.equal(hf.response_mask, ours.response_mask)
    half = low_precision_copy(model, torch.bfloat16)
    graphs = graph_engine(half, tok, max_new=60)
    replayed = graphs.generate(PROMPTS, 1, greedy=True)
    eager = FastEngine(half, tok, max_new_tokens=60, static_cache=True).generate(PROMPTS, 1, greedy=True)
    assert graphs.static.runner.captures >= 1 and graphs.static.fused
    assert torch.equal(replayed.response_ids, eager.response_ids)


def test_graphs_are_reused_between_calls(model, tok):
    engine = graph_engine(model, tok, max_new=40)
    first = engine.generate(PROMPTS, 4)
    captured = engine.static.runner.captures
    again = engine.generate(PROMPTS[::-1], 4)
    assert engine.static.runner.captures == captured
    assert first.response_ids.shape[0] == again.response_ids.shape[0] == 12


def test_sampled_tokens_with_graphs_equal_the_eager_static_loop(model, tok):
    """The same kernels replayed: the same logits, hence the same tokens from the same uniforms."""
    graphs = graph_engine(model, tok, max_new=48, temperature=0.9)
    eager = FastEngine(model, tok, max_new_tokens=48, temperature=0.9, static_cache=True)
    eos = sorted({tok.eos_token_id, *range(40, 70)})  # rows finish at different steps, some after the first check
    graphs.eos, eager.eos = eos, eos
    torch.manual_seed(3)
    a = graphs.generate(PROMPTS, 8)
    torch.manual_seed(3)
    b = eager.generate(PROMPTS, 8)
    assert torch.equal(a.response_ids, b.response_ids)
    assert len(graphs.static.states) >= 2  # 24 rows in the 32 bucket, fewer as they finish
    # the sampler's log-probs, picked inside the replayed graphs, are the eager loop's
    assert a.sample_logp is not None and torch.allclose(a.sample_logp, b.sample_logp, atol=1e-5)
    assert torch.all(a.sample_logp[a.response_mask == 0] == 0)


def test_an_update_synced_into_the_bf16_copy_reaches_the_graphs(tok):
    policy = tiny_llama(len(tok)).cuda()
    engine = local_engine("fast", policy, tok, max_new_tokens=24, precision="bfloat16")  # auto: graphs on CUDA
    assert engine.inner.static is not None and engine.inner.static.runner.graphs_on
    before = engine.generate(PROMPTS, 1, greedy=True)
    captured = engine.inner.static.runner.captures
    with torch.no_grad():
        for p in policy.parameters():
            p.add_(torch.randn_like(p) * 0.5)
    engine.release_weights()  # kept: the graphs read the copy in place
    engine.sync_weights(policy)
    after = engine.generate(PROMPTS, 1, greedy=True)
    assert engine.inner.static.runner.captures == captured  # same addresses, same graphs
    fresh = FastEngine(low_precision_copy(policy, torch.bfloat16), tok, max_new_tokens=24, static_cache=True)
    assert torch.equal(after.response_ids, fresh.generate(PROMPTS, 1, greedy=True).response_ids)
    assert not torch.equal(after.response_ids, before.response_ids)


def test_a_training_run_on_cuda_decodes_with_graphs(tiny_model_dir, tmp_path):
    from covey.cli.main import main
    from tests.helpers import tiny_overrides
    assert main(["train", "grpo", *tiny_overrides(tiny_model_dir, tmp_path, **{
        "train.device": "cuda", "rollout.decode": "graphs", "rollout.max_new_tokens": 24, "algo.tis.cap": 2,
        "algo.tis.mode": "sequence_mask"})]) == 0  # importance sampling reads the graphs' log-probs
