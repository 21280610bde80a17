"""Reward functions written the way TRL's documentation writes them train unchanged.

Unit tests on the Rewarder (keyword-only calls, None as "not scored"), on what the loop passes
(`reward_inputs`: prompts as given, conversational completions, every column under its own name,
completion_ids, trainer_state), then one run on the tiny model with TRL-style functions on a
chat-format dataset whose answer column is `solution`, and one with TRL's math_verify accuracy reward
weighted by `reward_weights`.
"""

from __future__ import annotations

import json
import math
import re

import pytest

import covey
from covey.rewards.combine import Rewarder, RewardTerm, TrainerState
from covey.rewards.scoring import reward_inputs
from covey.tasks.files import load_file
from tests.helpers import grouped_rollout, tiny_overrides

CALLS: list[dict] = []


# --- reward functions in the spirit of TRL's documentation (keyword-only, **kwargs) ---

def reward_len(completions, **kwargs):
    """TRL's quickstart: prefer completions close to 20 characters."""
    return [-abs(20 - len(completion[0]["content"] if isinstance(completion, list) else completion))
            for completion in completions]


def format_reward(completions, **kwargs):
    """TRL's format example: the reply (a chat message) must start with a capital letter and end with '.'."""
    pattern = r"^[A-Z].*\.$"
    contents = [completion[0]["content"] for completion in completions]
    return [1.0 if re.match(pattern, content, re.S) else 0.0 for content in contents]


def solution_reward(completions, solution, **kwargs):
    """TRL's accuracy idea on a dataset column named `solution`, by substring; None where there is no solution."""
    out = []
    for completion, sol in zip(completions, solution):
        if sol == "":
            out.append(None)  # not applicable: TRL's None
        else:
            out.append(1.0 if sol.lower() in completion[0]["content"].lower() else 0.0)
    return out


def accuracy_reward(completions, solution, **kwargs):
    """TRL's math accuracy reward as its documentation writes it: math_verify's parse and verify with
    their default timeouts, which use signal.alarm and so work only in the main thread."""
    from math_verify import parse, verify
    rewards = []
    for completion, sol in zip(completions, solution):
        gold = parse(sol)
        answer = parse(completion[0]["content"])
        rewards.append(float(verify(gold, answer)))
    return rewards


def correctness(completions, **kwargs):
    """A user function named like covey's correctness term: reported as reward/user:correctness."""
    return [1.0] * len(completions)


def recording_reward(prompts, completions, completion_ids, trainer_state, **kwargs):
    CALLS.append({"prompts": prompts, "completions": completions, "ids": completion_ids,
                  "step": trainer_state.global_step, "max_steps": trainer_state.max_steps,
                  "columns": sorted(kwargs)})
    return [0.0] * len(completions)


# --- the Rewarder ---

def test_functions_are_called_with_keywords_only():
    rewarder = Rewarder([RewardTerm("reward_len", reward_len, 1.0)])
    out = rewarder(["q", "q"], ["x" * 20, "x" * 25], {"answer": ["1", "1"]})
    assert out.total.tolist() == [0.0, -5.0] and out.errors == 0


def test_none_is_not_scored_and_adds_nothing():
    # accuracy: sample 0 right (1), sample 1 wrong (0), sample 2 None; length: -(|20 - n|)
    completions = [[{"role": "assistant", "content": c}] for c in ("Paris is it", "Rome", "Berlin?")]
    terms = [RewardTerm("solution_reward", solution_reward, 1.0), RewardTerm("reward_len", reward_len, 0.5)]
    out = Rewarder(terms)(["q"] * 3, completions, {"solution": ["paris", "paris", ""]})
    acc = out.parts["solution_reward"]
    assert acc[:2].tolist() == [1.0, 0.0] and math.isnan(acc[2])
    # totals: 1 + 0.5*(-9) = -3.5; 0 + 0.5*(-16) = -8; (None) + 0.5*(-13) = -6.5
    assert out.total.tolist() == [-3.5, -8.0, -6.5]
    assert out.errors == 0 and out.unscored == 0 and out.valid.all()


def test_a_sample_no_function_scores_gets_0_and_is_counted():
    out = Rewarder([RewardTerm("solution_reward", solution_reward, 2.0)])(
        ["q"] * 2, [[{"role": "assistant", "content": "Paris"}]] * 2, {"solution": ["paris", ""]})
    assert out.total.tolist() == [2.0, 0.0] and out.unscored == 1 and out.errors == 0


# --- what the loop passes ---

def test_reward_inputs_follow_trl(tmp_path, tiny_tokenizer):
    data = tmp_path / "chat.jsonl"
    rows = [{"prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Capital of France?"}],
             "solution": "Paris", "topic": "geo"},
            {"prompt": "Capital of Italy?", "solution": "Rome", "topic": "geo"}]
    data.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    examples, _ = load_file(data, answer_key="solution")
    rollout = grouped_rollout(tiny_tokenizer, groups=2, group_size=2)
    rollout.example_index = [0, 0, 1, 1]
    rollout.completions = ["Paris.", "Lyon.", "Rome.", "Milan."]
    prompts, completions, columns = reward_inputs(rollout, examples, TrainerState(global_step=3, max_steps=10))
    assert prompts[0] == rows[0]["prompt"] and prompts[2] == "Capital of Italy?"  # as the dataset gives them
    assert completions[0] == [{"role": "assistant", "content": "Paris."}] and completions[2] == "Rome."
    assert columns["solution"] == ["Paris", "Paris", "Rome", "Rome"] and columns["topic"] == ["geo"] * 4
    assert columns["answer"] == ["Paris", "Paris", "Rome", "Rome"]  # covey's name for the reference, too
    lengths = rollout.response_mask.sum(1).long().tolist()
    assert columns["completion_lengths"] == lengths
    assert [len(ids) for ids in columns["completion_ids"]] == lengths  # EOS included, padding not
    assert columns["completion_ids"][0] == rollout.response_ids[0, :lengths[0]].tolist()
    assert columns["trainer_state"].global_step == 3 and columns["trainer_state"].max_steps == 10


def test_chat_prompts_without_a_chat_template_fail_in_one_line(tmp_path, tiny_tokenizer):
    from covey.tasks.data import format_prompts
    data = tmp_path / "chat.jsonl"
    data.write_text(json.dumps({"prompt": [{"role": "user", "content": "hi"}], "answer": "1"}) + "\n")
    examples, _ = load_file(data)
    tiny_tokenizer.chat_template = None
    with pytest.raises(ValueError, match="prompts are chat messages but the model's tokenizer has no chat template"):
        format_prompts(tiny_tokenizer, examples)


@pytest.mark.parametrize("prompt, problem", [
    ([], "is an empty list of messages"),
    ([{"role": "user"}], "message 0 must be"),
    ([{"role": "robot", "content": "x"}], "message 0 must be"),
    ([{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}], "the last message must be the user's"),
])
def test_bad_chat_prompts_name_file_and_line(tmp_path, prompt, problem):
    from covey.tasks.files import DataError
    data = tmp_path / "chat.jsonl"
    data.write_text(json.dumps({"prompt": "ok", "answer": "1"}) + "\n"
                    + json.dumps({"prompt": prompt, "answer": "1"}) + "\n")
    with pytest.raises(DataError, match=f"chat.jsonl:2: field 'prompt'.*{re.escape(problem)}"):
        load_file(data)


# --- a run ---

def test_trl_style_functions_train_unchanged(tiny_model_dir, tmp_path):
    data = tmp_path / "capitals.jsonl"
    pairs = [("France", "Paris"), ("Italy", "Rome"), ("Spain", "Madrid"), ("Japan", "Tokyo"),
             ("Egypt", "Cairo"), ("Peru", "Lima"), ("Chile", ""), ("Kenya", "Nairobi")]
    data.write_text("".join(json.dumps({"prompt": [{"role": "user", "content": f"Capital of {c}?"}],
                                        "solution": s or "", "answer": s or "none"}) + "\n" for c, s in pairs))
    CALLS.clear()
    cfg = covey.load_config("grpo", tiny_overrides(tiny_model_dir, tmp_path, **{
        "task.name": "file", "task.path": str(data), "task.eval_size": 2, "reward.correctness": 0,
        "eval.metric": "reward", "eval.reward_threshold": 0.5, "train.samples_every": 1}))
    result = covey.train(cfg, reward_funcs=[reward_len, format_reward, solution_reward, recording_reward])
    rows = [json.loads(line) for line in (result.run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "reward/mean" in r]
    assert len(steps) == 2 and all("accuracy" not in r for r in steps)  # no verifier in the reward: no accuracy
    for r in steps:
        assert {"reward/reward_len", "reward/format_reward", "reward/recording_reward", "reward/unscored"} <= set(r)
    assert result.accuracy_before is None and "eval/reward_pass" in result.eval_after
    train_calls = [c for c in CALLS if len(c["prompts"]) == 8]  # 2 prompts x 4 samples
    assert [c["step"] for c in train_calls[:2]] == [0, 1] and train_calls[0]["max_steps"] == 2
    first = train_calls[0]
    assert isinstance(first["prompts"][0], list) and first["prompts"][0][0]["role"] == "user"
    assert first["completions"][0][0]["role"] == "assistant"
    assert all(isinstance(i, int) for ids in first["ids"] for i in ids)
    assert {"solution", "answer", "completion_lengths"} <= set(first["columns"])


def test_trls_math_verify_accuracy_reward_scores_without_errors(tiny_model_dir, tmp_path):
    pytest.importorskip("math_verify")
    data = tmp_path / "sums.jsonl"
    data.write_text("".join(json.dumps({"prompt": [{"role": "user", "content": f"What is {a} + {b}?"}],
                                        "answer": str(a + b), "solution": f"${a + b}$"}) + "\n"
                            for a, b in [(2, 3), (4, 4), (7, 1), (5, 6), (9, 9), (3, 8)]))
    cfg = covey.load_config("grpo", tiny_overrides(tiny_model_dir, tmp_path, **{
        "task.name": "file", "task.path": str(data), "task.eval_size": 2, "train.steps": 1}))
    result = covey.train(cfg, reward_funcs=[accuracy_reward, correctness], reward_weights=[1.0, 0.5])
    step = [r for r in (json.loads(line) for line in (result.run_dir / "metrics.jsonl").read_text().splitlines())
            if "reward/mean" in r][0]
    assert step["reward/errors"] == 0 and step["reward/user:correctness"] == 1.0
    assert 0.0 <= step["reward/accuracy_reward"] <= 1.0
    # the built-in correctness (weight 1), TRL's accuracy reward (weight 1), the user's correctness (weight 0.5)
    assert step["reward/mean"] == pytest.approx(step["reward/correctness"] + step["reward/accuracy_reward"] + 0.5)
