"""Tool-calling episodes through covey.train on the tiny model. A random tiny model never writes a tool
call, so each episode's first turn is scripted (the call a trained model would write, as sampled ids);
everything after it is covey's: the call parsed and run, the reply rendered by the chat template and
appended as ids, the model's second turn sampled from those ids, rewards, the update."""

from __future__ import annotations

import json

import torch

import covey
from covey.batch import Rollout
from covey.config import load_config
from covey.rollout.fast import FastEngine
from covey.rollout.fast_episodes import EpisodeRows
from tests.helpers import tiny_overrides

SEEN: list = []
SECRETS: list = []
REAL_GENERATE = FastEngine.generate
REAL_SAMPLE = EpisodeRows.sample


def get_weather(city: str) -> str:
    """Get the current weather of a city.

    Args:
        city: The name of the city.
    """
    return f"Sunny in {city}, 21 degrees"


def messages_reward(completions, **kwargs):
    """Records what TRL passes a reward function for an episode: its messages."""
    SEEN.append(completions)
    SECRETS.append(kwargs.get("secret"))
    return [float(len(c)) for c in completions]


def calculator_config(model_dir, out_dir, *extra: str, **keys):
    """Word problems with the calculator on the tiny model: one step, two turns, room for a scripted call."""
    return load_config(None, [*tiny_overrides(model_dir, out_dir, **{
        "task.name": "wordproblems", "rollout.tools": "calculator", "train.steps": 1, "rollout.max_turns": 2,
        "rollout.max_new_tokens": 96, "task.eval_size": 2, **keys}), *extra])


def scripted_first_turn(real_generate, call: str):
    """FastEngine.generate with every first turn (text prompts) answered by `call`, ended by EOS."""

    def generate(self, prompts, group_size, **kwargs):
        if not isinstance(prompts[0], str):  # a continuation: the model samples it
            return real_generate(self, prompts, group_size, **kwargs)
        tok = self.tokenizer
        ids = tok(call, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        enc = tok(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
        index = torch.arange(len(prompts)).repeat_interleave(group_size)
        n = len(index)
        return Rollout(prompt_ids=enc["input_ids"][index], prompt_mask=enc["attention_mask"][index],
                       response_ids=torch.tensor([ids] * n), response_mask=torch.ones(n, len(ids)),
                       group_ids=index.clone(), truncated=torch.zeros(n, dtype=torch.bool),
                       completions=[call] * n, example_index=index.tolist())
    return generate


def scripted_first_sample(call: str):
    """EpisodeRows.sample (the fast engine's episode loop) with every first turn's tokens those of `call`
    and EOS, their log-probs the model's own."""

    def sample(self, ids, logits):
        picked, _ = REAL_SAMPLE(self, ids, logits)
        tok = self.engine.tokenizer
        script = tok(call, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        for j, r in enumerate(ids):
            row = self.rows[r]
            if row.episode.turns == 0:
                picked[j] = script[len(row.turn)]
        logp = torch.log_softmax(logits / self.engine.temperature, -1)[torch.arange(len(ids)), picked]
        return picked, logp.tolist()
    return sample


def script_first_turn(monkeypatch, call: str) -> None:
    """Every episode's first turn is `call`, on both of the fast engine's paths (one episode loop, or turns
    through generate)."""
    monkeypatch.setattr(FastEngine, "generate", scripted_first_turn(REAL_GENERATE, call))
    monkeypatch.setattr(EpisodeRows, "sample", scripted_first_sample(call))


def test_a_trl_tool_function_runs_unchanged_through_covey_train(tiny_model_dir, tmp_path, monkeypatch):
    call = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
    script_first_turn(monkeypatch, call)
    SEEN.clear()
    SECRETS.clear()
    cfg = load_config(None, tiny_overrides(tiny_model_dir, tmp_path, **{
        "train.steps": 1, "rollout.max_turns": 2, "rollout.max_new_tokens": 96, "reward.correctness": 0.0,
        "train.samples_every": 1, "task.eval_size": 2}))
    result = covey.train(cfg, reward_funcs=[messages_reward], tools=[get_weather])
    step = [json.loads(line) for line in (result.run_dir / "metrics.jsonl").read_text().splitlines()][1]
    # 2 prompts x 4 samples: every episode called the tool once, and read its reply in a second turn
    assert step["tools/calls"] == 8 and step["tools/errors"] == 0 and step["episode/tool_calls_mean"] == 1.0
    assert step["episode/turns_mean"] == 2.0 and 0 < step["episode/env_token_frac"] < 1
    assert torch.isfinite(torch.tensor(step["optim/grad_norm"]))
    episode = SEEN[1][0]  # TRL's shape: the episode's messages, assistant and tool (SEEN[0]: the check call)
    assert [m["role"] for m in episode] == ["assistant", "tool", "assistant"]
    assert episode[0]["content"] == call
    assert episode[1] == {"role": "tool", "name": "get_weather", "content": "Sunny in Paris, 21 degrees"}
    sample = json.loads((result.run_dir / "samples.jsonl").read_text().splitlines()[0])
    assert [m["role"] for m in sample["messages"]] == ["assistant", "tool", "assistant"]


def test_the_calculator_answers_word_problems_and_a_bad_call_is_an_error_not_a_crash(tiny_model_dir, tmp_path,
                                                                                      monkeypatch):
    call = '<tool_call>{"name": "calculator", "arguments": {"expression": "6 * 7"}}</tool_call>'
    script_first_turn(monkeypatch, call)
    SEEN.clear()
    SECRETS.clear()
    cfg = calculator_config(tiny_model_dir, tmp_path / "ok")
    covey.train(cfg, reward_funcs=[messages_reward])
    assert SEEN[1][0][1] == {"role": "tool", "name": "calculator", "content": "42"}
    bad = '<tool_call>{"name": "calculator", "arguments": {"formula": "6 * 7"}}</tool_call>'  # no such argument
    script_first_turn(monkeypatch, bad)
    SEEN.clear()
    SECRETS.clear()
    cfg = calculator_config(tiny_model_dir, tmp_path / "bad")
    result = covey.train(cfg, reward_funcs=[messages_reward])
    reply = SEEN[1][0][1]
    assert reply["role"] == "tool" and "error" in json.loads(reply["content"])
    step = [json.loads(line) for line in (result.run_dir / "metrics.jsonl").read_text().splitlines()][1]
    assert step["tools/calls"] == 8 and step["tools/errors"] == 8



def test_a_trl_environment_runs_unchanged_and_its_reward_scores_the_episode(tiny_model_dir, tmp_path, monkeypatch):
    """examples/number_guess: one GuessEnv per episode, reset(**row) reads the row's secret and its text
    joins the prompt, `guess` is the tool, get_reward() is the episode's reward (reward/environment)."""
    from examples.number_guess.guess_env import GuessEnv
    call = '<tool_call>{"name": "guess", "arguments": {"number": 50}}</tool_call>'
    script_first_turn(monkeypatch, call)
    SEEN.clear()
    SECRETS.clear()
    cfg = load_config(None, tiny_overrides(tiny_model_dir, tmp_path, **{
        "task.name": "file", "task.path": "examples/number_guess/train.jsonl", "train.steps": 1,
        "rollout.max_turns": 2, "rollout.max_new_tokens": 96, "task.eval_size": 2, "train.samples_every": 1}))
    result = covey.train(cfg, reward_funcs=[messages_reward], environment_factory=GuessEnv)
    step = [json.loads(line) for line in (result.run_dir / "metrics.jsonl").read_text().splitlines()][1]
    assert step["tools/calls"] == 8 and step["tools/errors"] == 0
    at = [len(seen) for seen in SEEN].index(8)  # the training step's 8 episodes (held-out ones are 2)
    expected = ["correct" if s == 50 else "higher" if s > 50 else "lower" for s in SECRETS[at]]
    assert [episode[1]["content"] for episode in SEEN[at]] == expected  # each episode reset with its row
    # guessed 50 at once: 1.0 where the secret was 50, else 0 (not found); the mean over the 8 episodes
    found = sum(episode[1]["content"] == "correct" for episode in SEEN[at])
    assert step["reward/environment"] == found / 8
    sample = json.loads((result.run_dir / "samples.jsonl").read_text().splitlines()[0])
    assert sample["messages"][1]["name"] == "guess"


def test_process_supervision_of_one_answer_with_tools_is_refused_at_start():
    import pytest

    from covey.config import ConfigError
    from covey.training.plan import make_plan
    with pytest.raises(ConfigError, match="reward.step_source=exact scores the reasoning steps of one answer"):
        make_plan(load_config(None, ["rollout.tools=calculator", "algo.estimator=grpo_process",
                                     "reward.step_source=exact", "task.name=multistep"]))


def test_covey_eval_of_a_tool_run_runs_its_episodes(tiny_model_dir, tmp_path, monkeypatch, capsys):
    """`covey eval RUN_DIR --replies` of a run with rollout.tools evaluates whole episodes with the run's
    tools, and each reply record holds the episode's messages."""
    from covey.cli.main import main
    from covey.rollout.hf import HFEngine
    call = '<tool_call>{"name": "calculator", "arguments": {"expression": "6 * 7"}}</tool_call>'
    script_first_turn(monkeypatch, call)
    monkeypatch.setattr(HFEngine, "generate", scripted_first_turn(HFEngine.generate, call))
    cfg = calculator_config(tiny_model_dir, tmp_path, **{"rollout.eval_max_new_tokens": 96})
    result = covey.train(cfg)
    replies = tmp_path / "replies.jsonl"
    assert main(["eval", str(result.run_dir), "--replies", str(replies)]) == 0
    records = [json.loads(line) for line in replies.read_text().splitlines()]
    assert len(records) == 2 and all(r["messages"][1] == {"role": "tool", "name": "calculator", "content": "42"}
                                     for r in records)
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["eval/n"] == 2


def test_a_tool_run_resumes_exactly(tiny_model_dir, tmp_path, monkeypatch):
    """Two steps in one go, and one step then a resume to two: the same second step (timings aside)."""
    call = '<tool_call>{"name": "calculator", "arguments": {"expression": "6 * 7"}}</tool_call>'
    script_first_turn(monkeypatch, call)

    def run(folder, steps: int, *extra: str) -> list[dict]:
        cfg = calculator_config(tiny_model_dir, tmp_path / folder, *extra,
                                **{"train.steps": steps, "train.save_every": 1})
        result = covey.train(cfg)
        return [json.loads(line) for line in (result.run_dir / "metrics.jsonl").read_text().splitlines()]

    def steady(row: dict) -> dict:
        # sampler/*: the sampler's own log-probs round with the rows each decode step holds, which depends on
        # when the tools answered (1e-9 in log_ratio_mean); the tokens, rewards, losses and updates are exact
        return {k: v for k, v in row.items() if not k.startswith(("time/", "throughput/", "memory/", "sampler/"))}

    whole = run("whole", 2)
    run("parts", 1)
    resumed = run("parts", 2, "train.resume=auto")
    second = [r for r in resumed if r["step"] == 2 and "final" not in r]
    assert steady(second[0]) == steady([r for r in whole if r["step"] == 2 and "final" not in r][0])
    assert second[0]["tools/calls"] == 8


def last_turn_reward(completions, **kwargs):
    """A reward written for episodes: it reads the last message of each completion."""
    return [float("42" in c[-1]["content"]) for c in completions]


def test_a_reward_written_for_episodes_passes_the_check_before_training(tiny_model_dir, tmp_path, monkeypatch):
    """On string prompts (word problems) single-turn completions are strings, but with tools they are
    messages: the call before training hands the function the shape training will."""
    call = '<tool_call>{"name": "calculator", "arguments": {"expression": "6 * 7"}}</tool_call>'
    script_first_turn(monkeypatch, call)
    cfg = calculator_config(tiny_model_dir, tmp_path)
    assert covey.train(cfg, reward_funcs=[last_turn_reward]).steps == 1
