"""Partial rollouts across steps (covey/training/partial.py): which groups a step trains on, what is carried and
how it goes on, the checks of rollout.partial.*, and exact resume with carried rows."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from covey.batch import Rollout
from covey.cli.main import main
from covey.config import ConfigError, load_config
from covey.config.schema import PartialConfig
from covey.models.tiny import tiny_tokenizer
from covey.runtime.dist import World
from covey.tasks.data import PromptStream
from covey.training.partial import CarryPool, row_seed, sample_partial
from covey.training.plan import make_plan
from tests.helpers import tiny_overrides
from tests.training.test_checkpoint import deterministic


class ScriptedEngine:
    """generate_until answers each row from a script: (new tokens, their log-probs, cut); records the calls."""

    def __init__(self, tok, scripts):
        self.tok, self.scripts, self.calls = tok, list(scripts), []

    def generate_until(self, prompts, quorum, *, budgets, seeds=None):
        self.calls.append(dict(prompts=[list(p) for p in prompts], groups=list(quorum.groups), needed=quorum.needed,
                               must=set(quorum.must), budgets=list(budgets), seeds=seeds))
        script = self.scripts.pop(0)
        width = max(max(len(t) for t, _, _ in script), 1)
        ids = torch.zeros((len(script), width), dtype=torch.long)
        mask, logp = torch.zeros((len(script), width)), torch.zeros((len(script), width))
        for n, (t, lp, _) in enumerate(script):
            ids[n, :len(t)], mask[n, :len(t)], logp[n, :len(t)] = torch.tensor(t), 1.0, torch.tensor(lp)
        cut = torch.tensor([c for _, _, c in script])
        return Rollout(prompt_ids=ids, prompt_mask=mask.long(), response_ids=ids, response_mask=mask,
                       group_ids=torch.tensor(quorum.groups), truncated=torch.zeros(len(script), dtype=torch.bool),
                       completions=[""] * len(script), example_index=list(range(len(script))), sample_logp=logp,
                       cut=cut)


def fake_run(tok, extra=1, max_age=2, seeding="global"):
    sampling = SimpleNamespace(prompts_per_step=1, group_size=2, max_new_tokens=6, seeding=seeding,
                               partial=PartialConfig(extra=extra, max_age=max_age))
    plan = SimpleNamespace(sampling=sampling, schedule=SimpleNamespace(seed=3))
    return SimpleNamespace(plan=plan, carried=CarryPool(), world=World(), tokenizer=tok,
                           stream=PromptStream(4, seed=0))


def test_a_step_trains_the_ended_groups_and_carries_the_rest_with_their_log_probs():
    tok = tiny_tokenizer()
    run = fake_run(tok)
    prompts = ["a b", "c d e", "f", "g h"]
    # step 1: B = 1 + extra 1 = 2 new groups (rows 0,1 of group 0; rows 2,3 of group 1); group 0 ends, group 1's
    # row 2 has ended and row 3 is cut after 2 tokens
    engine = ScriptedEngine(tok, [
        [([5, 6], [-0.5, -0.25], False), ([7], [-1.0], False), ([8, 9, 10], [-0.1, -0.2, -0.3], False),
         ([11, 12], [-2.0, -3.0], True)],
        # step 2: row 3 of group 1 goes on first (oldest first), then the new group 2's two rows: it ends with 2
        # more tokens; group 2 is cut
        [([13, 14], [-0.75, -0.5], False), ([15], [-1.5], True), ([], [], True)],
    ])
    rollout, metrics = sample_partial(run, engine, prompts)
    first = engine.calls[0]
    assert first["groups"] == [0, 0, 1, 1] and first["needed"] == 1 and first["must"] == set()
    assert first["budgets"] == [6, 6, 6, 6]
    assert rollout.group_ids.tolist() == [0, 0]  # group 0 only
    assert rollout.response_mask.sum(1).tolist() == [2, 1]
    assert torch.allclose(rollout.sample_logp, torch.tensor([[-0.5, -0.25], [-1.0, 0.0]]))
    assert metrics["partial/carried_groups"] == 1 and metrics["partial/carried_rows"] == 1
    assert metrics["partial/old_token_frac"] == 0.0  # every trained token was sampled in this step
    carried = run.carried.groups[0]
    assert carried.age == 1 and carried.ended == [True, False] and carried.tokens == [[8, 9, 10], [11, 12]]
    # step 2: 1 carried group, so B + extra - 1 = 1 new prompt; the carried row is fed its prompt and its tokens
    # and has 6 - 2 = 4 tokens of budget left
    rollout, metrics = sample_partial(run, engine, prompts)
    second = engine.calls[1]
    assert second["prompts"][0] == carried.prompt + [11, 12]
    assert second["budgets"] == [4, 6, 6] and second["groups"] == [0, 1, 1]
    assert rollout.group_ids.tolist() == [0, 0]
    assert rollout.response_ids[1, :4].tolist() == [11, 12, 13, 14]
    # the earlier tokens keep the log-probs they were sampled with: -2, -3 from step 1, then -0.75, -0.5
    assert torch.allclose(rollout.sample_logp[1, :4], torch.tensor([-2.0, -3.0, -0.75, -0.5]))
    # tokens sampled under the old weights: group 1 held 3 + 2 = 5 of its 3 + 4 = 7 trained tokens
    assert metrics["partial/old_token_frac"] == pytest.approx(5 / 7)
    assert metrics["partial/max_age"] == 1
    assert [g.age for g in run.carried.groups] == [1] and run.carried.groups[0].tokens == [[15], []]


def test_a_group_carried_max_age_times_must_end_and_seeds_follow_the_row():
    tok = tiny_tokenizer()
    run = fake_run(tok, extra=1, max_age=1, seeding="per_prompt")
    engine = ScriptedEngine(tok, [
        [([5], [-1.0], False), ([6], [-1.0], False), ([7], [-1.0], True), ([8], [-1.0], True)],
        [([9], [-1.0], False), ([10], [-1.0], False), ([11], [-1.0], False), ([12], [-1.0], True)],
    ])
    sample_partial(run, engine, ["a", "b", "c", "d"])
    draw = run.carried.groups[0].draw
    sample_partial(run, engine, ["a", "b", "c", "d"])
    second = engine.calls[1]
    assert second["must"] == {0}  # carried once, max_age 1: it ends in this call whatever its length
    assert second["seeds"][:2] == [row_seed(3, draw, 0, 1), row_seed(3, draw, 1, 1)]
    assert len(set(engine.calls[0]["seeds"])) == 4  # every row its own stream


def test_the_pool_round_trips_through_its_state():
    tok = tiny_tokenizer()
    run = fake_run(tok)
    engine = ScriptedEngine(tok, [[([5], [-1.0], False), ([6], [-1.0], False), ([7], [-0.5], True),
                                   ([], [], True)]])
    sample_partial(run, engine, ["a", "b", "c", "d"])
    copy = CarryPool()
    copy.load_state_dict(run.carried.state_dict())
    assert copy.groups == run.carried.groups and copy.groups[0].logps == [[-0.5], []]


@pytest.mark.parametrize("extra, message", [
    ({}, "needs algo.tis.cap > 0"),
    ({"algo.tis.cap": 2, "rollout.engine": "hf"}, "needs the fast engine's plain steps"),
    ({"algo.tis.cap": 2, "rollout.tools": "calculator"}, "needs single answers"),
    ({"algo.tis.cap": 2, "algo.estimator": "remax"}, "without a greedy baseline"),
    ({"algo.tis.cap": 2, "rollout.partial.max_age": 0}, "rollout.partial.max_age >= 1"),
])
def test_partial_rollouts_refuse_what_they_cannot_carry(extra, message):
    cfg = load_config(None, [f"{k}={v}" for k, v in {"rollout.partial.extra": 2, **extra}.items()])
    with pytest.raises(ConfigError, match=message):
        make_plan(cfg)


def test_resume_with_carried_rows_equals_the_uninterrupted_run(tiny_model_dir, tmp_path):
    # 2 prompts per step and 2 extra groups of 4 rows through 3 slots: each step stops once 2 groups have
    # ended, and the rows still going are carried; a checkpoint at step 2 holds them
    extra = {"optim.lr": 1e-3, "reward.functions": "tests.helpers:varied_reward", "rollout.partial.extra": 2,
             "rollout.partial.max_age": 2, "algo.tis.cap": 2, "rollout.slots": 3, "rollout.temperature": 1.0}

    def run(out, **kw):
        return main(["train", *tiny_overrides(tiny_model_dir, out, **{"model.threads": 1, **extra, **kw})])
    assert run(tmp_path / "long", **{"train.steps": 4}) == 0
    assert run(tmp_path / "short", **{"train.steps": 2}) == 0
    state = torch.load(tmp_path / "short" / "t" / "checkpoints" / "step-000002" / "trainer_state.pt",
                       weights_only=False)
    carried = state["extra"]["carried"]["groups"]
    assert carried and any(not all(g["ended"]) for g in carried)  # rows were carried across the checkpoint
    assert run(tmp_path / "short", **{"train.steps": 4, "train.resume": "auto"}) == 0
    long = deterministic(tmp_path / "long" / "t")
    assert deterministic(tmp_path / "short" / "t") == long
    steps = [r for r in long if "partial/old_token_frac" in r]
    assert any(r["partial/old_token_frac"] > 0 for r in steps)  # carried tokens were trained
