"""Step rewards of process supervision (`grpo_process`): steps cut from the decoded responses, mapped
to the policy tokens where they end, scored by the PRM or the exact verifier (Lightman et al. 2023,
arXiv:2305.20050; process supervision in GRPO: Shao et al. 2024, arXiv:2402.03300); or, in tool-calling
episodes, one step per model turn, scored as the episode ran (reward.step_source=turns, docs/agents.md)."""

from __future__ import annotations

import torch

from covey.rewards.learned import decode_separator, step_token_ends
from covey.tasks.multistep import label_steps


def process_step_inputs(rollout, tokenizer, prompts, examples, prm, source: str, separator: str) -> tuple[dict, dict]:
    """Step rewards for `grpo_process`: AdvantageInput fields (step_scores/ends/mask) and metrics.

    Steps are cut from each response's decoded text; each step's end is mapped to
    the policy token where it ends. source=prm: P(step correct) from the PRM;
    source=exact: the multi-step verifier's 0/1 labels. When exact labels exist
    the PRM's step accuracy on the batch is reported too (prm/step_accuracy).
    source=turns: the episodes' model turns (`turn_step_inputs`).
    """
    if source == "turns":
        return turn_step_inputs(rollout)
    sep = decode_separator(separator)
    texts, ends = [], []
    for ids, mask in zip(rollout.response_ids, rollout.response_mask):
        text, e = step_token_ends(tokenizer, ids[mask.bool()].tolist(), sep)
        texts.append(text)
        ends.append(e)
    picked = [examples[i] for i in rollout.example_index]
    exact = [label_steps(ex, t, sep)[1] for ex, t in zip(picked, texts)] if "ops" in picked[0].meta else None
    if source == "prm":
        scores = prm.step_probabilities([prompts[i] for i in rollout.example_index], texts)
    else:
        scores = [[float(v) for v in labels] for labels in exact]
    inputs, metrics = padded_steps([s[:len(e)] for s, e in zip(scores, ends)], ends, rollout.scores.dtype)
    if exact is not None and source == "prm":
        metrics.update(prm_batch_metrics(scores, exact))
    return inputs, metrics


def turn_step_inputs(rollout) -> tuple[dict, dict]:
    """One step per model turn of each episode (`rollout.turn_steps`, recorded by the episode runners): its
    end the index of the turn's last sampled token, its score the environment's `turn_reward()` or else
    1.0 for a turn whose tool calls were all answered without an error (`tool_turn_score`). The tools'
    tokens are no step: they lie between turns, are 0 in `response_mask`, and get no advantage."""
    if rollout.turn_steps is None:
        raise ValueError("reward.step_source=turns needs episodes: this rollout has no model turns recorded")
    scores = [[score for _, score in turns] for turns in rollout.turn_steps]
    ends = [[end for end, _ in turns] for turns in rollout.turn_steps]
    return padded_steps(scores, ends, rollout.scores.dtype)


def padded_steps(scores: list[list[float]], ends: list[list[int]], dtype: torch.dtype) -> tuple[dict, dict]:
    """Per-response step scores and ends as AdvantageInput fields (N, S), padded with step_mask 0, and
    the step metrics (steps/per_sample, steps/score_mean)."""
    width = max([len(e) for e in ends] + [1])
    step_scores, step_ends = torch.zeros(len(ends), width), torch.zeros(len(ends), width, dtype=torch.long)
    step_mask = torch.zeros(len(ends), width, dtype=torch.bool)
    for i, (s, e) in enumerate(zip(scores, ends)):
        n = len(e)
        step_scores[i, :n] = torch.tensor(s[:n], dtype=step_scores.dtype)
        step_ends[i, :n] = torch.tensor(e, dtype=torch.long)
        step_mask[i, :n] = True
    metrics = {"steps/per_sample": float(step_mask.sum(1).float().mean()) if len(ends) else 0.0,
               "steps/score_mean": float(step_scores[step_mask].mean()) if step_mask.any() else 0.0}
    return {"step_scores": step_scores.to(dtype), "step_ends": step_ends, "step_mask": step_mask}, metrics


def prm_batch_metrics(probabilities: list[list[float]], labels: list[list[int]]) -> dict:
    """The PRM against the exact step labels on a batch (a step is called right when p > 0.5):
    accuracy, precision (share of the steps it calls right that are right) and the false-positive
    rate (share of wrong steps called right). When right steps are rare, precision is what decides
    whether its step rewards teach: a 10% false-positive rate against 10% right steps puts half of
    the reward on wrong steps while accuracy still reads 90%."""
    pairs = [(p > 0.5, bool(y)) for ps, ys in zip(probabilities, labels) for p, y in zip(ps, ys)]
    called_right = [y for called, y in pairs if called]
    wrong = [called for called, y in pairs if not y]
    out = {"prm/step_accuracy": sum(called == y for called, y in pairs) / max(len(pairs), 1)}
    if called_right:
        out["prm/step_precision"] = sum(called_right) / len(called_right)
    if wrong:
        out["prm/step_false_positive_rate"] = sum(wrong) / len(wrong)
    return out


def add_outcome_to_last_step(step_scores: torch.Tensor, step_mask: torch.Tensor, outcome: torch.Tensor,
                             weight: float) -> torch.Tensor:
    """Step rewards with `weight * outcome` added to each response's last step.

    Step rewards alone say nothing about finishing: one right step and a stop scores as
    well as a whole right solution (a policy found that, docs/rewards.md). The outcome
    reward on the last step is what a complete, right answer earns on top. A response
    with no step keeps no reward (it has no step to carry one).
    """
    out = step_scores.clone()
    n_steps = step_mask.sum(1)
    rows = (n_steps > 0).nonzero().squeeze(1)
    out[rows, n_steps[rows] - 1] += weight * outcome[rows].to(out.dtype)
    return out
