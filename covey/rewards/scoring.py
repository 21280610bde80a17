"""Scoring a sampled batch: the reward functions' inputs as TRL passes them, and the scores put on the Rollout."""

from __future__ import annotations

import math

from covey.batch import Rollout
from covey.rewards.combine import TrainerState
from covey.rewards.judge import judge_metrics


def example_columns(picked: list) -> dict:
    """Every dataset column of the examples under its own name, plus `answer` (the reference)."""
    columns = {key: [ex.meta.get(key) for ex in picked] for key in (picked[0].meta if picked else ())}
    columns.setdefault("answer", [ex.answer for ex in picked])
    return columns


def as_completions(picked: list, texts: list[str]) -> list:
    """Strings for string prompts, one assistant message each for chat prompts (TRL's shapes)."""
    return [[{"role": "assistant", "content": text}] if ex.messages is not None else text
            for ex, text in zip(picked, texts)]


def reward_inputs(rollout: Rollout, examples, state: TrainerState | None = None) -> tuple[list, list, dict]:
    """(prompts, completions, columns) as TRL passes them to reward functions: the prompts as the
    dataset gives them, completions as strings for string prompts and as one assistant message for
    chat prompts, the sampled ids, the trainer state, and every dataset column under its name
    (plus `answer`, the reference, and `completion_lengths`, in tokens). An episode's completion is
    its messages (assistant and tool turns), its ids every id after the prompt (the tools' too), its
    length the tokens the model sampled."""
    picked = [examples[i] for i in rollout.example_index]
    lengths = rollout.response_mask.sum(1).long().tolist()
    spans = rollout.response_attended.sum(1).long().tolist()
    columns = example_columns(picked)
    columns.update(completion_lengths=lengths, trainer_state=state or TrainerState(),
                   completion_ids=[ids[:n] for ids, n in zip(rollout.response_ids.tolist(), spans)])
    if rollout.environments is not None:  # TRL's `environments`: each episode's live environment instance
        columns["environments"] = list(rollout.environments)
    if rollout.environment_rewards is not None:  # each episode's environment get_reward(), read by the term
        columns["environment_reward"] = [None if math.isnan(v) else v for v in rollout.environment_rewards.tolist()]
    completions = rollout.messages if rollout.messages is not None else as_completions(picked, rollout.completions)
    return [ex.given_prompt for ex in picked], completions, columns


def placeholder_inputs(example, max_steps: int, episodes: bool = False) -> tuple[list, list, dict]:
    """The inputs of one call on `example` before any model exists: the completion 'The answer is
    <its reference answer>.', one id per word (there is no tokenizer yet), trainer_state at step 0.
    `episodes`: the run calls tools, so the completion is an episode's messages (one assistant turn)."""
    text = f"The answer is {example.answer}."
    columns = example_columns([example])
    columns.update(completion_lengths=[len(text.split())], completion_ids=[[0] * len(text.split())],
                   trainer_state=TrainerState(global_step=0, max_steps=max_steps))
    completions = [[{"role": "assistant", "content": text}]] if episodes else as_completions([example], [text])
    return [example.given_prompt], completions, columns


def score(rollout: Rollout, rewarder, examples, prompts, state: TrainerState | None = None,
          watch: bool = False) -> dict:
    """Fill rollout.scores; returns reward metrics (errors, drops and samples no function scored).
    `watch`: a training batch, counted by the rewarder's FailureStreaks (reward.max_failed_steps)."""
    given, completions, columns = reward_inputs(rollout, examples, state)
    scores = rewarder(given, completions, columns, formatted_prompts=[prompts[i] for i in rollout.example_index])
    rollout.scores, rollout.reward_parts, rollout.valid = scores.total, scores.parts, scores.valid
    if watch:
        rewarder.streaks.record(scores, (state or TrainerState()).global_step, rewarder)
    return {"reward/errors": scores.errors, "reward/dropped": int((~scores.valid).sum()),
            "reward/unscored": scores.unscored, **judge_metrics(scores.parts)}
