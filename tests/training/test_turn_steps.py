"""Process rewards per model turn through covey.train on the tiny model: the scripted first turn calls the
calculator (a random tiny model never writes a call), the model samples the second; each turn is a step
of grpo_process, and the advantages the update receives are the turns' group-normalised step rewards."""

from __future__ import annotations

import json
import math

import torch

import covey
from covey.config import load_config
from covey.training import rl
from tests.helpers import tiny_overrides
from tests.training.test_agents import script_first_turn


def expected_advantages(rollout, weight: float, eps: float) -> torch.Tensor:
    """A plain loop over the turns: step rewards (outcome x weight on the last turn), normalised by the
    mean and population std of their group's steps, summed over the steps ending at or after each token."""
    rewards = [[score for _, score in turns] for turns in rollout.turn_steps]
    for i, r in enumerate(rewards):
        r[-1] += weight * float(rollout.scores[i])
    out = torch.zeros(rollout.response_mask.shape, dtype=torch.float64)
    for g in set(rollout.group_ids.tolist()):
        rows = [i for i in range(len(rewards)) if rollout.group_ids[i] == g]
        flat = [v for i in rows for v in rewards[i]]
        mean = sum(flat) / len(flat)
        std = math.sqrt(sum((v - mean) ** 2 for v in flat) / len(flat))
        for i in rows:
            for (end, _), r in zip(rollout.turn_steps[i], rewards[i]):
                normalised = 0.0 if std == 0 else (r - mean) / (std + eps)
                out[i, :end + 1] += normalised
    return out * rollout.response_mask


def test_each_turn_is_a_step_and_its_advantage_reaches_the_update(tiny_model_dir, tmp_path, monkeypatch):
    call = '<tool_call>{"name": "calculator", "arguments": {"expression": "6 * 7"}}</tool_call>'
    script_first_turn(monkeypatch, call)
    seen = []
    real_update_policy = rl.update_policy

    def update_policy(target, rollout, *args, **kwargs):
        seen.append((rollout.advantages.clone(), rollout))
        return real_update_policy(target, rollout, *args, **kwargs)

    monkeypatch.setattr(rl, "update_policy", update_policy)
    cfg = load_config(None, tiny_overrides(tiny_model_dir, tmp_path, **{
        "task.name": "wordproblems", "rollout.tools": "calculator", "train.steps": 1, "rollout.max_turns": 2,
        "rollout.max_new_tokens": 96, "task.eval_size": 2, "algo.estimator": "grpo_process",
        "reward.step_source": "turns", "reward.process_outcome_weight": 1.0}))
    result = covey.train(cfg)
    step = [json.loads(line) for line in (result.run_dir / "metrics.jsonl").read_text().splitlines()][1]
    # 8 episodes: the scripted call answered (turn 1 scores 1), then a second turn that calls nothing
    # or calls past the turn limit (0): two steps each, mean turn score 1/2
    assert step["tools/calls"] == 8 and step["tools/errors"] == 0
    assert step["steps/per_sample"] == 2.0 and step["steps/score_mean"] == 0.5
    assert torch.isfinite(torch.tensor(step["optim/grad_norm"])) and step["optim/grad_norm"] > 0
    (advantages, rollout), = seen
    assert [[score for _, score in turns] for turns in rollout.turn_steps] == [[1.0, 0.0]] * 8
    environment = rollout.response_attended.bool() & ~rollout.response_mask.bool()
    assert environment.any() and (advantages[environment] == 0).all()
    expected = expected_advantages(rollout, weight=1.0, eps=cfg.algo.adv_eps)
    assert torch.allclose(advantages.double(), expected, atol=1e-5)
    # each episode's turn-1 tokens lead its turn-2 tokens by the normalised turn-1 reward, here > 0
    for row, turns in enumerate(rollout.turn_steps):
        (end_1, _), (end_2, _) = turns
        assert advantages[row, end_1] > advantages[row, end_2]
