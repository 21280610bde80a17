"""Scoring a sampled batch: the reward functions' inputs as TRL passes them, and the scores put on the Rollout."""

from __future__ import annotations

from covey.batch import Rollout
from covey.rewards.combine import TrainerState


def reward_inputs(rollout: Rollout, examples, state: TrainerState | None = None) -> tuple[list, list, dict]:
    """(prompts, completions, columns) as TRL passes them to reward functions: the prompts as the
    dataset gives them, completions as strings for string prompts and as one assistant message for
    chat prompts, the sampled ids, the trainer state, and every dataset column under its name
    (plus `answer`, the reference, and `completion_lengths`, in tokens)."""
    picked = [examples[i] for i in rollout.example_index]
    lengths = rollout.response_mask.sum(1).long().tolist()
    completions = [[{"role": "assistant", "content": text}] if ex.messages is not None else text
                   for ex, text in zip(picked, rollout.completions)]
    columns = {key: [ex.meta.get(key) for ex in picked] for key in (picked[0].meta if picked else ())}
    columns.setdefault("answer", [ex.answer for ex in picked])
    columns.update(completion_lengths=lengths, trainer_state=state or TrainerState(),
                   completion_ids=[ids[:n] for ids, n in zip(rollout.response_ids.tolist(), lengths)])
    return [ex.given_prompt for ex in picked], completions, columns


def score(rollout: Rollout, rewarder, examples, prompts, state: TrainerState | None = None) -> dict:
    """Fill rollout.scores; returns reward metrics (errors, drops and samples no function scored)."""
    given, completions, columns = reward_inputs(rollout, examples, state)
    scores = rewarder(given, completions, columns, formatted_prompts=[prompts[i] for i in rollout.example_index])
    rollout.scores, rollout.reward_parts, rollout.valid = scores.total, scores.parts, scores.valid
    return {"reward/errors": scores.errors, "reward/dropped": int((~scores.valid).sum()),
            "reward/unscored": scores.unscored}
