"""The calculator warm-up (examples/calculator_warmup/make_demos.py, docs/distillation.md): its problems are
training problems only; each exchange, rendered by covey's SFT data path, is token for token an episode of the
RL phase (the prompt, the call the episode runner parses and runs, the reply it appends), trains exactly the
assistant's turns, and ends in an answer the task's verifier scores 1; and a warm-up on those exchanges, then
GRPO with the calculator, runs both phases on the tiny model."""

from __future__ import annotations

import importlib.util
import shlex
from pathlib import Path

import pytest

from covey.cli.main import main
from covey.rewards.rules import correctness_reward, tool_use_reward
from covey.rollout.agents import Agent
from covey.rollout.tools import Toolbox, ToolCall, find_tool_calls, run_tool_calls, tool_call_format, tool_messages_ids
from covey.runtime.metrics import read_metrics
from covey.tasks.data import PromptStream
from covey.tasks.sft_data import calls_in_content, load_demos, render_demo, row_to_demo
from covey.tasks.tools import calculator
from covey.tasks.wordproblems import held_out, is_correct, wordproblem_splits
from tests.helpers import tiny_overrides

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "examples" / "calculator_warmup" / "make_demos.py"
_spec = importlib.util.spec_from_file_location("make_demos", SCRIPT)
make_demos = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(make_demos)


def split_tokens(tokens) -> list[tuple[int, list[int]]]:
    """The rendered ids as runs of equal marks: [(mark, ids), ...]."""
    runs: list[tuple[int, list[int]]] = []
    for i, m in zip(tokens.ids, tokens.trained):
        if runs and runs[-1][0] == m:
            runs[-1][1].append(i)
        else:
            runs.append((m, [i]))
    return runs


# --------------------------------------------------------------------------- the problems


@pytest.mark.parametrize("seed", [0, 1])
def test_the_problems_are_training_problems_never_held_out_ones(seed):
    """The default 200 problems are the first 200 of the run's own training set (task.train_size=600 at the same
    train.seed), every sum is on the training side of the seeded hash, and none of their prompts or sums is in
    the held-out set the run evaluates on (task.eval_size=200, the default)."""
    problems = make_demos.training_problems(make_demos.DEFAULT_COUNT, seed)
    train, held = wordproblem_splits(600, 200, seed)
    assert problems == train[:200] and len(set(problems)) == 200
    assert not any(held_out(ex.meta["expression"], seed) for ex in problems)
    assert all(held_out(ex.meta["expression"], seed) for ex in held)
    assert not {ex.prompt for ex in problems} & {ex.prompt for ex in held}
    assert not {ex.meta["expression"] for ex in problems} & {ex.meta["expression"] for ex in held}
    # a different train.seed hashes the sums differently: some of seed 0's problems are held out at seed 1
    assert any(held_out(ex.meta["expression"], 1 - seed) for ex in problems)


def test_expressions_and_answer_sentences():
    assert make_demos.spaced("3*12 - 7") == "3 * 12 - 7"
    assert make_demos.spaced("(56) / 8") == "56 / 8"
    assert make_demos.spaced("(3*12 - 7) / 4") == "(3 * 12 - 7) / 4"
    share = make_demos.Example("Emma has 56 pencils. She shares the pencils equally among 8 friends. How many "
                               "pencils does each friend get?", "7")
    have = make_demos.Example("Leo has 46 cookies. He finds 17 more cookies. How many cookies does Leo have now?",
                              "63")
    assert make_demos.answer_text(share) == "Each friend gets 7 pencils.\n#### 7"
    assert make_demos.answer_text(have) == "Leo has 63 cookies now.\n#### 63"


def test_a_reply_that_is_not_the_answer_stops_the_script(tiny_tokenizer):
    agent = Agent(tiny_tokenizer, [calculator], 10.0)
    wrong = make_demos.Example("Tom has 3 apples. How many apples does Tom have now?", "4", {"expression": "3"})
    with pytest.raises(make_demos.DemoError, match=r"calculator\('3'\) gave '3', but the answer .* is 4"):
        make_demos.exchange(agent, wrong)


# --------------------------------------------------------------------------- the exchanges as the RL phase sees them


def test_each_exchange_is_an_episode_of_the_rl_phase(tiny_tokenizer):
    check_episodes(tiny_tokenizer)


@pytest.mark.slow
def test_each_exchange_is_an_episode_of_the_default_model():
    """The same with SmolLM2-135M-Instruct's own tokenizer and chat template (the real warm-up's)."""
    check_episodes(make_demos.load_tokenizer(make_demos.resolve_model_path("default")))


def check_episodes(tokenizer) -> None:
    """Rendered by the SFT path (turn by turn: the tiny template, like SmolLM2's, has no generation tags and
    shows no tools), a row is [prompt | call turn | tool reply | answer turn | the template's last newline]: the
    prompt ids are the episode's prompt (Agent.prompts, no tool_demo, tokenized as the engines do), the reply
    span is what the episode runner appends after the call turn (tool_messages_ids), and only the two assistant
    turns (each through <|im_end|>) train. The call turn parses with covey's parser in this model's format into
    one calculator call whose real reply is the recorded tool message."""
    rows = make_demos.make_rows(tokenizer, count=12, seed=0)
    problems = make_demos.training_problems(12, 0)
    agent = Agent(tokenizer, [calculator], 10.0)
    fmt, end = tool_call_format(tokenizer), tokenizer.eos_token
    assert fmt == "tags" and end == "<|im_end|>"
    for i, (row, example) in enumerate(zip(rows, problems)):
        tokens = render_demo(tokenizer, row_to_demo(row, f"demos.jsonl:{i + 1}"), 4096)
        (m0, prompt), (m1, call_turn), (m2, reply), (m3, answer_turn), *rest = split_tokens(tokens)
        assert (m0, m1, m2, m3) == (0, 1, 0, 1)
        assert [(m, tokenizer.decode(ids)) for m, ids in rest] == [(0, "\n")]  # the template's, after the turn
        episode_prompt = agent.prompts([example])[0]
        assert prompt == tokenizer(episode_prompt, add_special_tokens=False)["input_ids"]
        call_text = tokenizer.decode(call_turn)
        expression = make_demos.spaced(example.meta["expression"])
        assert call_text == ('<tool_call>{"name": "calculator", "arguments": {"expression": "%s"}}</tool_call>%s'
                             % (expression, end))
        calls = find_tool_calls(call_text.removesuffix(end), fmt)
        assert calls == [ToolCall("calculator", {"expression": expression})]
        tool_message = run_tool_calls(Toolbox([calculator]), calls, timeout_s=5)
        assert tool_message == [row["messages"][-2]] == [{"role": "tool", "name": "calculator",
                                                           "content": example.answer}]
        history = [*episode_prompt.messages, {"role": "assistant", "content": call_text.removesuffix(end)},
                   *tool_message]
        assert reply == tool_messages_ids(tokenizer, history, agent.template_tools(example))
        assert tokenizer.decode(answer_turn) == make_demos.answer_text(example) + end
        assert row["tools"] == Toolbox([calculator]).schemas


def test_every_final_answer_scores_one(tiny_tokenizer):
    """The verifier of task.name=wordproblems (`is_correct`), the correctness reward on the episode as TRL
    passes it to reward functions (its messages after the prompt, the call in the assistant's content) and
    reward.tool_use all score each of the 200 default exchanges 1.0."""
    rows = make_demos.make_rows(tiny_tokenizer, count=make_demos.DEFAULT_COUNT, seed=0)
    problems = make_demos.training_problems(make_demos.DEFAULT_COUNT, 0)
    completions = [calls_in_content(tuple(row["messages"][-3:])) for row in rows]
    answers = [ex.answer for ex in problems]
    assert all(is_correct(row["messages"][-1]["content"], ex) for row, ex in zip(rows, problems))
    assert correctness_reward([None] * 200, completions, answer=answers) == [1.0] * 200
    assert tool_use_reward([None] * 200, completions) == [1.0] * 200


# --------------------------------------------------------------------------- the script and the warm-up


def test_the_script_writes_the_same_file_for_the_same_arguments(tiny_model_dir, tmp_path, capsys):
    args = ["--model", tiny_model_dir, "--count", "16", "--seed", "3"]
    assert make_demos.main(["--out", str(tmp_path / "a.jsonl"), *args]) == 0
    assert make_demos.main(["--out", str(tmp_path / "b.jsonl"), *args]) == 0
    assert "16 calculator exchanges" in capsys.readouterr().out
    assert (tmp_path / "a.jsonl").read_bytes() == (tmp_path / "b.jsonl").read_bytes()
    assert len(load_demos(tmp_path / "a.jsonl")) == 16
    assert make_demos.main(["--out", str(tmp_path / "c.jsonl"), "--model", tiny_model_dir, "--count", "0"]) == 2
    assert make_demos.main(["--out", str(tmp_path / "c.jsonl"), "--model", tiny_model_dir, "--steps", "5"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert err == ["make_demos: --count must be at least 1, got 0",
                   "make_demos: word problems take 1 to 4 steps, got 5"]
    assert not (tmp_path / "c.jsonl").exists()


def documented_commands() -> tuple[list[str], list[str]]:
    """The generator's and the train command's arguments of docs/distillation.md's tool warm-up, as written."""
    doc = (ROOT / "docs" / "distillation.md").read_text()
    section = doc.split("## A tool warm-up instead of demonstrations", 1)[1]
    block = section.split("```bash\n", 1)[1].split("```", 1)[0].replace("\\\n", " ")
    make, train = [shlex.split(line) for line in block.splitlines() if line.strip()]
    assert make[:2] == ["python", "examples/calculator_warmup/make_demos.py"] and train[:2] == ["covey", "train"]
    return make[2:], train[1:]


def test_the_documented_warm_up_then_grpo_with_the_calculator(tiny_model_dir, tmp_path, capsys):
    """The two commands of docs/distillation.md, as written, on the tiny model: the generator's, then `covey train`
    with the warm-up cut to 2 supervised steps and 2 GRPO steps after it. Steps 1-2 train on the exchanges (the
    first step's trained tokens are the assistant's tokens of the stream's first two conversations, the tool
    replies not among them), steps 3-4 are GRPO episodes with the calculator."""
    make, train = documented_commands()
    data = tmp_path / "calculator_demos.jsonl"
    make = [str(data) if a == "calculator_demos.jsonl" else a for a in make]
    assert make_demos.main([*make, "--model", tiny_model_dir]) == 0
    train = [f"sft.data={data}" if a == "sft.data=calculator_demos.jsonl" else a for a in train]
    assert {"rollout.tools=calculator", "sft.num_steps=16", "sft.batch_size=2", "train.seed=0"} <= set(train)
    small = {"sft.num_steps": 2, "train.steps": 2, "train.max_minutes": 0, "rollout.max_new_tokens": 16,
             "task.eval_size": 2, "model.threads": 1, "algo.micro_batch_size": 2}
    assert main([*train, *tiny_overrides(tiny_model_dir, tmp_path, **small)]) == 0
    out = capsys.readouterr().out
    assert "covey: sft data" in out and "32 conversations" in out
    assert "covey: phases: sft steps 1-2 on" in out and "then grpo steps 3-4" in out
    lines = read_metrics(tmp_path / "t")
    assert [r["step"] for r in lines] == [0, 1, 2, 3, 4, 4]
    tokens = [render_demo(make_demos.load_tokenizer(tiny_model_dir), d, 4096) for d in load_demos(data)]
    first = PromptStream(32, 0).next(2)
    assert lines[1]["sft/tokens"] == sum(sum(tokens[i].trained) for i in first) and lines[1]["sft/sequences"] == 2
    assert "episode/turns_mean" not in lines[2]
    for step in lines[3:5]:
        assert "sft/loss" not in step and "episode/turns_mean" in step and "reward/tool_use" in step
        assert "tools/calls" in step
