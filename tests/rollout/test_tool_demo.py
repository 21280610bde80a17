"""Helping a model that does not call tools yet: the worked exchange shown before each question
(rollout.tool_demo) and the tool-use reward (reward.tool_use)."""

from __future__ import annotations

import json

import pytest

from covey.config import ConfigError, load_config
from covey.models.tiny import tiny_tokenizer
from covey.rewards.rules import get_rule_reward, tool_use_reward
from covey.rollout.agents import Agent, load_demo
from covey.rollout.tools import ToolError
from covey.tasks.base import Example
from covey.tasks.tools import CALCULATOR_DEMO, calculator
from covey.training.plan import make_plan


def test_tool_use_pays_for_an_episode_with_a_call_answered_without_an_error():
    """Four episodes: a call answered "16" -> 1; only an error of covey's ({"error": ...}) -> 0; only the
    calculator's refusal ("error: ...") -> 0; an error then an answer -> 1; and a plain text completion
    (single turn) -> 0."""
    call = {"role": "assistant", "content": "<tool_call>...</tool_call>"}
    answered = [call, {"role": "tool", "name": "calculator", "content": "16"}, {"role": "assistant", "content": "16"}]
    covey_error = [call, {"role": "tool", "name": "calculator", "content": '{"error": "timed out after 10 s"}'}]
    tool_error = [call, {"role": "tool", "name": "calculator", "content": "error: only numbers are allowed"}]
    retried = tool_error + answered
    rewards = tool_use_reward(["q"] * 5, [answered, covey_error, tool_error, retried, "the answer is 16"])
    assert rewards == [1.0, 0.0, 0.0, 1.0, 0.0]
    assert get_rule_reward("tool_use") is tool_use_reward


def test_the_builtin_demo_calls_the_calculator_and_its_result_is_the_calculators():
    demo = load_demo("builtin", ["calculator"])
    assert demo == CALCULATOR_DEMO
    for at, value in ((1, "16"), (5, "53")):  # each call's result is the calculator's, the answer says it
        call = json.loads(demo[at]["content"].removeprefix("<tool_call>").removesuffix("</tool_call>"))
        assert demo[at + 1]["content"] == calculator(**call["arguments"]) == value
        assert demo[at + 2]["content"].endswith(f"#### {value}")


def test_the_demo_sits_between_the_system_message_and_the_question():
    agent = Agent(tiny_tokenizer(), [calculator], timeout_s=1.0, demo=CALCULATOR_DEMO)
    prompt = agent.prompts([Example(prompt="What is 6 x 7?", answer="42")], system_prompt="Be brief.")[0]
    roles = [m["role"] for m in prompt.messages]
    assert roles == ["system", *["user", "assistant", "tool", "assistant"] * 2, "user"]
    assert prompt.messages[0]["content"].startswith("Be brief.") and prompt.messages[-1]["content"] == "What is 6 x 7?"
    assert prompt.index("Ana has 12 pens") < prompt.index("What is 6 x 7?")


def test_a_demo_file_is_read_and_a_bad_one_is_one_line(tmp_path):
    good = tmp_path / "demo.json"
    good.write_text(json.dumps(CALCULATOR_DEMO))
    assert load_demo(str(good), []) == CALCULATOR_DEMO
    assert load_demo("", ["calculator"]) == []
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps([{"role": "narrator", "content": "x"}]))
    with pytest.raises(ToolError, match="rollout.tool_demo=.*bad.json: expected a JSON list of messages"):
        load_demo(str(bad), [])
    with pytest.raises(ToolError, match="rollout.tool_demo=.*missing.json: FileNotFoundError"):
        load_demo(str(tmp_path / "missing.json"), [])
    with pytest.raises(ToolError, match="rollout.tool_demo=builtin: none of rollout.tools .*built in: calculator"):
        load_demo("builtin", ["mod:fn"])


@pytest.mark.parametrize("key", ["reward.tool_use=0.5", "rollout.tool_demo=builtin"])
def test_the_tool_helps_without_tools_are_refused_in_one_line(key):
    with pytest.raises(ConfigError, match=f"{key} needs tools: set rollout.tools or rollout.environment"):
        make_plan(load_config(None, [key]))
    make_plan(load_config(None, [key, "rollout.tools=calculator"]))


def test_reward_tool_use_is_a_term_of_the_run_at_its_weight():
    from covey.rewards.build import build_rewarder

    cfg = load_config(None, ["rollout.tools=calculator", "reward.tool_use=0.25"])
    terms = {t.name: t.weight for t in build_rewarder(make_plan(cfg).rewards).terms}
    assert terms["tool_use"] == 0.25 and terms["correctness"] == 1.0
