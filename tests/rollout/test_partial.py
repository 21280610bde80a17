"""A call stopped at a quorum of groups (`FastEngine.generate_until`, rollout.partial): which rows end, which are
cut, and that a cut row continued from its tokens gives the tokens of the uncut call."""

from __future__ import annotations

import pytest
import torch

from covey.models.load import load_policy
from covey.rollout.base import Quorum
from covey.rollout.fast import FastEngine

EOS = range(40, 90)  # many stop tokens: sampled rows end at different steps


@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    return load_policy(tiny_model_dir)


def engine(model, tok, slots=2, top_k=0, eos=True):
    e = FastEngine(model, tok, max_new_tokens=24, temperature=0.9, top_k=top_k, slots=slots)
    e.eos = sorted({tok.eos_token_id, *EOS}) if eos else []
    return e


def ids(tok, text):
    return tok(text, add_special_tokens=False)["input_ids"]


def test_the_call_stops_once_enough_groups_have_ended_and_cuts_the_rest(tiny):
    model, tok = tiny
    a, b = ids(tok, "What is 2 + 3?"), ids(tok, "hello there")
    prompts = [a, a, b, b]  # group 0: two short rows, group 1: two long ones (budgets, no end of sequence)
    budgets = [3, 4, 20, 22]
    quorum = Quorum(groups=[0, 0, 1, 1], needed=1)
    out = engine(model, tok, eos=False).generate_until(prompts, quorum, budgets=budgets, seeds=[1, 2, 3, 4])
    # 2 slots: rows 0 and 1 start; row 0 ends with its 3rd token and row 2 takes its slot, drawing its first
    # token at once from the prompt's logits; at the next draw row 1 ends with its 4th token and row 2 takes its
    # 2nd: group 0 is over, the quorum is met, and row 3 never started
    assert out.cut.tolist() == [False, False, True, True]
    assert out.response_mask.sum(1).tolist() == [3, 4, 2, 0]
    assert out.truncated.tolist() == [True, True, False, False]  # at their budgets; cut rows are not truncated
    assert out.group_ids.tolist() == [0, 0, 1, 1]
    whole = engine(model, tok, eos=False).generate_until(prompts, Quorum(groups=[0, 0, 1, 1], needed=2),
                                                         budgets=budgets, seeds=[1, 2, 3, 4])
    assert not whole.cut.any() and whole.response_mask.sum(1).tolist() == budgets
    # a row's tokens come from its own seed: the cut row's two tokens are the uncut row's first two
    assert torch.equal(out.response_ids[:2, :4], whole.response_ids[:2, :4])
    assert torch.equal(out.response_ids[2, :2], whole.response_ids[2, :2])
    assert torch.allclose(out.sample_logp[2, :2], whole.sample_logp[2, :2], atol=1e-5)


def test_a_group_that_must_end_runs_past_the_quorum(tiny):
    model, tok = tiny
    a, b = ids(tok, "What is 2 + 3?"), ids(tok, "hello there")
    quorum = Quorum(groups=[0, 1], needed=1, must=frozenset({0}))
    e = engine(model, tok, eos=False)
    out = e.generate_until([a, b], quorum, budgets=[20, 2], seeds=[1, 2])
    # group 1 ends first (2 tokens) and meets the quorum, but group 0 must end: it runs to its budget
    assert out.cut.tolist() == [False, False]
    assert out.response_mask.sum(1).tolist() == [20, 2]
    # the slots' use: a decode step follows each draw but the last, 19 steps; the first feeds both rows, the
    # other 18 row 0 alone (row 1 ended at its 2nd draw): 2 + 18 = 20 busy of 2 x 19 slot-steps
    assert e.take_metrics()["rollout/busy_slot_frac"] == pytest.approx(20 / 38)
    assert e.take_metrics() == {}  # nothing since


def test_a_cut_row_continued_from_its_tokens_gives_the_uncut_rows_tokens(tiny):
    # top-k 1 makes every draw the argmax: a row's continuation, fed its own earlier tokens after the prompt,
    # must equal the tokens of the call that was never cut (the same weights)
    model, tok = tiny
    a = ids(tok, "What is 2 + 3?")
    e = engine(model, tok, top_k=1, eos=False)
    whole = e.generate_until([a], Quorum(groups=[0], needed=1), budgets=[16])
    first = e.generate_until([a, a], Quorum(groups=[0, 1], needed=1), budgets=[2, 16])
    assert first.cut.tolist() == [False, True]
    done = int(first.response_mask[1].sum())
    assert 0 < done < 16
    prefix = first.response_ids[1, :done].tolist()
    rest = e.generate_until([a + prefix], Quorum(groups=[0], needed=1), budgets=[16 - done])
    assert prefix + rest.response_ids[0, :16 - done].tolist() == whole.response_ids[0].tolist()
    lp = torch.cat([first.sample_logp[1, :done], rest.sample_logp[0, :16 - done]])
    assert torch.allclose(lp, whole.sample_logp[0], atol=1e-4)


def test_engines_without_a_slot_loop_refuse_a_quorum(tiny):
    from covey.rollout.hf import HFEngine
    model, tok = tiny
    with pytest.raises(NotImplementedError, match="rollout.partial needs the fast engine"):
        HFEngine(model, tok, max_new_tokens=4).generate_until([[1, 2]], Quorum(groups=[0], needed=1), budgets=[4])
