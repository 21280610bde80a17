"""Speculative decoding (covey/rollout/speculate.py): the rejection rule by hand, the sampled distribution
unchanged (a chi-square test), n-gram drafts, and the engine's greedy tokens and log-probs unchanged."""

from __future__ import annotations

import pytest
import torch

from covey.models.load import load_policy
from covey.rollout.fast import FastEngine, sample_inverse_cdf
from covey.rollout.speculate import Drafter, RecentNgrams, accepted_counts, residual_probs


def test_accepted_counts_by_hand():
    # V = 3; two rows, drafts of length 2 and 1 (m = 2); probs[i, j] is p_j, the distribution after fed
    # position j. Row 0: d1 = 1 with p_0(1) = 0.5, u_0 = 0.4 < 0.5: accepted; d2 = 2 with p_1(2) = 0.3,
    # u_1 = 0.6 >= 0.3: rejected -> 1 accepted. Row 1: d1 = 0 with p_0(0) = 0.2, u = 0.1 < 0.2: accepted;
    # its draft ends there (length 1) -> 1, whatever its padded second token and uniform.
    probs = torch.tensor([[[0.2, 0.5, 0.3], [0.1, 0.6, 0.3], [1 / 3, 1 / 3, 1 / 3]],
                          [[0.2, 0.5, 0.3], [0.9, 0.05, 0.05], [1 / 3, 1 / 3, 1 / 3]]])
    drafts = torch.tensor([[1, 2], [0, 0]])
    lengths = torch.tensor([2, 1])
    uniforms = torch.tensor([[0.4, 0.6], [0.1, 0.0]])
    assert accepted_counts(probs, drafts, lengths, uniforms, greedy=False).tolist() == [1, 1]
    # u_0 = 0.5 is not below p_0(1) = 0.5: row 0 rejects its first token (a count stops at the first rejection,
    # even though u_1 = 0.0 would accept d2)
    uniforms = torch.tensor([[0.5, 0.0], [0.1, 0.0]])
    assert accepted_counts(probs, drafts, lengths, uniforms, greedy=False).tolist() == [0, 1]
    # greedy: argmax p_0 = 1 = d1 (accept), argmax p_1 = 1 != 2 (reject) -> 1; row 1: argmax p_0 = 1 != 0 -> 0
    assert accepted_counts(probs, drafts, lengths, uniforms, greedy=True).tolist() == [1, 0]


def test_the_residual_removes_the_rejected_draft():
    probs = torch.tensor([[0.2, 0.5, 0.3], [0.1, 0.6, 0.3]])
    out = residual_probs(probs, [1, None])
    # row 0 without token 1; inverse-CDF sampling renormalises: 0.2 / 0.5 and 0.3 / 0.5
    assert torch.allclose(out, torch.tensor([[0.2, 0.0, 0.3], [0.1, 0.6, 0.3]]))
    assert residual_probs(probs, [None, None]) is probs


def target(prev: torch.Tensor) -> torch.Tensor:
    """A toy model over V = 4: the distribution of the next token given the previous one (rows of `prev`)."""
    table = torch.tensor([[0.1, 0.4, 0.3, 0.2], [0.25, 0.25, 0.4, 0.1], [0.6, 0.1, 0.1, 0.2],
                          [0.05, 0.15, 0.3, 0.5]])
    return table[prev]


def speculative_pairs(start: int, draft: list[int], trials: int, gen: torch.Generator) -> torch.Tensor:
    """The first two tokens after `start` of `trials` independent rows, each from one verification of `draft`
    (then plain sampling), as the slot loop does it: accept by u < p(d), draw the next token from the residual
    or, after a whole draft, from p. (trials, 2)."""
    m = len(draft)
    fed = torch.tensor([start, *draft])
    probs = target(fed)[None].expand(trials, m + 1, 4)
    drafts = torch.tensor(draft)[None].expand(trials, m)
    u = torch.rand((trials, m), generator=gen)
    a = accepted_counts(probs, drafts, torch.full((trials,), m), u, greedy=False)
    ban = [draft[k] if k < m else None for k in a.tolist()]
    nxt = sample_inverse_cdf(residual_probs(probs[torch.arange(trials), a], ban), torch.rand(trials, generator=gen))
    # the row's tokens: its accepted draft, then the drawn token, then plain samples
    seq = torch.cat([drafts, torch.zeros((trials, 2), dtype=torch.long)], 1)
    seq[torch.arange(trials), a] = nxt
    second = sample_inverse_cdf(target(seq[:, 0]), torch.rand(trials, generator=gen))
    return torch.stack([seq[:, 0], torch.where(a >= 1, seq[:, 1], second)], 1)


@pytest.mark.parametrize("draft", [[1, 2], [3, 3], [0], [2, 0, 1]])
def test_the_sampled_distribution_is_the_models_chi_square(draft):
    # joint law of the first two tokens after token 2: P(x, y) = p(x | 2) p(y | x), 16 cells. 100000 draws;
    # the chi-square statistic with 15 degrees of freedom exceeds 37.70 with probability 0.001.
    gen = torch.Generator().manual_seed(len(draft) * 7 + draft[0])
    trials = 100_000
    pairs = speculative_pairs(2, draft, trials, gen)
    counts = torch.zeros(16).index_add_(0, pairs[:, 0] * 4 + pairs[:, 1], torch.ones(trials)).view(4, 4)
    expected = trials * target(torch.tensor(2))[:, None] * target(torch.arange(4))
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < 37.70
    # the test can fail: accepting every draft token without the rejection rule is far off
    forced = torch.zeros(4, 4)
    forced[draft[0], draft[1] if len(draft) > 1 else 0] = trials
    assert float(((forced - expected) ** 2 / expected).sum()) > 1000


def test_drafts_come_from_the_group_then_from_recent_answers():
    recent = RecentNgrams(k=3)
    recent.add([7, 8, 9, 10, 11])
    # group 0's prompt is [1, 2, 3, 4]; rows 0 and 1 are its siblings, row 2 is group 1's (prompt [5, 6])
    d = Drafter(3, recent, [[1, 2, 3, 4], [5, 6]], [0, 0, 1])
    d.add_row(0, [2, 3, 4, 1, 2, 3])
    d.add_row(1, [9, 2, 3])
    # row 1 ends with (2, 3), found, most recent first, at row 1's own end and row 0's end (nothing follows
    # either yet), then row 0's first 2, 3 -> 4, 1, 2 (the prompt's 2, 3 -> 4 is older)
    assert d.draft(1, limit=8) == [4, 1, 2]
    assert d.draft(1, limit=2) == [4, 1]  # the row's remaining budget bounds a draft
    # row 2 (group 1) ends with its prompt's (5, 6) and nothing of its own: no occurrence in group 1, none in
    # recent answers -> no draft; after (8, 9) it takes the recent answers' continuation
    assert d.draft(2, limit=8) == []
    d.add_row(2, [8, 9])
    assert d.draft(2, limit=8) == [10, 11]
    # group 1 never sees group 0's tokens
    d.add_row(2, [4])
    assert d.draft(2, limit=8) == []


def test_a_call_stops_drafting_when_too_few_drafts_are_accepted():
    # PAYING_AFTER = 32 verified draft tokens, PAYING_SHARE = 0.5: 31 verified, none accepted -> still drafting
    # (too few to tell); 40 verified, 20 accepted (0.5) -> pays; 40 verified, 19 accepted (0.475) -> stops
    d = Drafter(4, RecentNgrams(4), [[1, 2]], [0])
    d.drafted, d.accepted = 31, 0
    assert d.paying()
    d.drafted, d.accepted = 40, 20
    assert d.paying()
    d.accepted = 19
    assert not d.paying()


@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    return load_policy(tiny_model_dir)


def engine(model, tok, temperature=0.9, **kw):
    e = FastEngine(model, tok, max_new_tokens=40, temperature=temperature, **kw)
    e.eos = sorted({tok.eos_token_id, *range(40, 60)})
    return e


PROMPTS = ["What is 2 + 3?", "hello there, how are you doing today", "x"]


@pytest.mark.parametrize("slots", [0, 2])
def test_greedy_tokens_are_unchanged_and_drafts_are_accepted(tiny, slots):
    model, tok = tiny
    budgets = [40, 13, 29, 7] * 3
    plain = engine(model, tok).generate(PROMPTS, 4, greedy=True, budgets=budgets)
    without = engine(model, tok, slots=slots)
    without.generate(PROMPTS, 4, greedy=True, budgets=budgets)
    e = engine(model, tok, slots=slots, speculate=4)
    fast = e.generate(PROMPTS, 4, greedy=True, budgets=budgets)
    assert torch.equal(plain.response_ids, fast.response_ids)
    assert torch.equal(plain.response_mask, fast.response_mask)
    assert torch.allclose(plain.sample_logp, fast.sample_logp, atol=1e-4)
    stats = e.slot_stats
    assert stats.drafted > 0 and 0 < stats.accepted <= stats.drafted  # the random model repeats itself
    # accepted drafts save forwards (the batch loop, slots=0: one forward per token of the longest row but its last)
    assert stats.steps < (without.slot_stats.steps or int(fast.response_mask.sum(1).max()) - 1)


def test_sampled_rows_keep_the_targets_log_probs(tiny):
    # every sampled token's log-prob, accepted draft or not, is log_softmax(logits / T) of a plain forward
    model, tok = tiny
    torch.manual_seed(3)
    e = engine(model, tok, temperature=0.1, slots=3, speculate=4)  # a cold random model repeats itself
    out = e.generate(PROMPTS, 4)
    assert 0 < e.slot_stats.accepted < e.slot_stats.drafted  # drafts accepted and rejected
    ids = torch.cat([out.prompt_ids, out.response_ids], 1)
    mask = torch.cat([out.prompt_mask, out.response_mask.long()], 1)
    positions = (mask.cumsum(1) - 1).clamp(min=0)
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask, position_ids=positions).logits.float()
    p = out.prompt_ids.shape[1]
    want = torch.log_softmax(logits[:, p - 1:-1] / 0.1, -1).gather(2, out.response_ids[..., None]).squeeze(2)
    m = out.response_mask.bool()
    assert torch.allclose(out.sample_logp[m], want[m], atol=1e-4)
