"""covey.rollout.fast.FastEngine: same tokens as `generate` where they can be, same distribution where not.

Sampling uses a different random stream from `torch.multinomial` (inverse CDF, one
uniform per row), so sampled tokens are compared with the engine's own plain mode
(no prefix sharing, no row dropping) under one seed, and the distribution with HF's.
"""

import pytest
import torch
from transformers import GenerationConfig

from covey.models.load import load_policy
from covey.rollout import fast
from covey.rollout.fast import FastEngine, sample_inverse_cdf
from covey.rollout.hf import HFEngine

PROMPTS = ["What is 2 + 3?", "hello there, how are you doing today", "x"]


@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    return load_policy(tiny_model_dir)


def frequent_eos(engine, tokenizer):
    """Many stop tokens, so rows finish at different steps (exercises row dropping)."""
    engine.eos = sorted({tokenizer.eos_token_id, *range(40, 90)})
    return engine


def test_greedy_matches_hf_generate(tiny):
    model, tok = tiny
    hf = HFEngine(model, tok, max_new_tokens=12).generate(PROMPTS, 1, greedy=True)
    ours = FastEngine(model, tok, max_new_tokens=12).generate(PROMPTS, 1, greedy=True)
    assert torch.equal(hf.response_ids, ours.response_ids)
    assert torch.equal(hf.response_mask, ours.response_mask)
    assert torch.equal(hf.prompt_ids, ours.prompt_ids) and hf.completions == ours.completions


def test_prefix_shared_equals_plain_generation_under_one_seed(tiny):
    model, tok = tiny
    shared = frequent_eos(FastEngine(model, tok, max_new_tokens=24, temperature=0.9), tok)
    plain = frequent_eos(FastEngine(model, tok, max_new_tokens=24, temperature=0.9, share_prefix=False), tok)
    torch.manual_seed(3)
    a = shared.generate(PROMPTS, 4)
    torch.manual_seed(3)
    b = plain.generate(PROMPTS, 4)
    assert torch.equal(a.response_ids, b.response_ids)
    lengths = a.response_mask.sum(1)
    assert len(set(lengths.tolist())) > 2  # rows finished at different steps
    assert torch.equal(a.group_ids, torch.arange(3).repeat_interleave(4))


def test_dropping_finished_rows_changes_no_token(tiny, monkeypatch):
    model, tok = tiny
    engine = frequent_eos(FastEngine(model, tok, max_new_tokens=24), tok)
    outs = []
    for drop in (True, False):
        monkeypatch.setattr(fast, "DROP_FINISHED", drop)
        torch.manual_seed(5)
        outs.append(engine.generate(PROMPTS, 4).response_ids)
    assert torch.equal(outs[0], outs[1])


def test_after_eos_is_padding_and_decoding_stops_when_all_finished(tiny):
    model, tok = tiny
    engine = frequent_eos(FastEngine(model, tok, max_new_tokens=200), tok)
    torch.manual_seed(0)
    out = engine.generate(PROMPTS, 2)
    assert out.response_ids.shape[1] < 200 and not out.truncated.any()
    assert torch.all(out.response_ids[out.response_mask == 0] == tok.pad_token_id)


def test_per_prompt_seeds_reproduce_a_group_alone_or_in_a_batch(tiny):
    model, tok = tiny
    engine = FastEngine(model, tok, max_new_tokens=10)
    both = engine.generate(PROMPTS[:2], 3, seeds=[11, 12])
    alone = engine.generate(PROMPTS[1:2], 3, seeds=[12])
    width = alone.response_ids.shape[1]
    assert torch.equal(both.response_ids[3:, :width], alone.response_ids)


@pytest.mark.parametrize("temperature, top_k, top_p", [(1.0, 0, 1.0), (0.7, 0, 1.0), (1.3, 20, 1.0),
                                                       (0.8, 0, 0.9), (1.0, 50, 0.8)])
def test_warped_distribution_is_hf_generates(tiny, temperature, top_k, top_p):
    """The probabilities sampled from are those of HF's own logits processors for these settings."""
    model, tok = tiny
    engine = FastEngine(model, tok, max_new_tokens=4, temperature=temperature, top_k=top_k, top_p=top_p)
    config = GenerationConfig(do_sample=True, temperature=temperature, top_k=top_k, top_p=top_p)
    processors = model._get_logits_processor(config)
    logits = torch.randn(6, 512) * 3
    expected = torch.softmax(processors(torch.zeros(6, 1, dtype=torch.long), logits.clone()), -1)
    torch.testing.assert_close(engine.next_token_probs(logits), expected)


def test_inverse_cdf_sampler_has_exact_frequencies():
    """On a uniform grid of K draws, each token is picked round(K * p) times (+-1); p = 0 never."""
    probs = torch.tensor([[0.1, 0.0, 0.25, 0.65], [0.0, 0.0, 1.0, 0.0]])
    grid = (torch.arange(1000) + 0.5) / 1000
    picks = torch.stack([sample_inverse_cdf(probs, torch.full((2,), float(u))) for u in grid])
    for row in range(2):
        counts = torch.bincount(picks[:, row], minlength=4).float()
        assert torch.all((counts - 1000 * probs[row]).abs() <= 1)


def test_first_token_distribution_matches_model(tiny):
    """Pearson chi-square of 4000 first tokens against the model's softmax: df = V-1, sd = sqrt(2 df)."""
    model, tok = tiny
    engine = FastEngine(model, tok, max_new_tokens=1, temperature=0.5)
    torch.manual_seed(0)
    n = 4000
    out = engine.generate(PROMPTS[:1], n)
    with torch.no_grad():
        logits = model(**tok(PROMPTS[:1], return_tensors="pt", add_special_tokens=False)).logits[0, -1]
    expected = n * torch.softmax(logits.double() / 0.5, -1)
    counts = torch.bincount(out.response_ids[:, 0], minlength=len(expected)).double()
    chi2, df = float(((counts - expected) ** 2 / expected).sum()), len(expected) - 1
    assert chi2 < df + 6 * (2 * df) ** 0.5
