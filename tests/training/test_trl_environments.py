"""TRL 1.16's tool and environment conventions, as a TRL user writes them: reward functions that read the
live environments, a dict of named environments, one tool function alone; and each thing that cannot work
refused before the model loads, in one line naming the tool, environment or reward function.

The refusals run with a model path that does not exist: a case caught after the model load would end
with the model's error instead of its own."""

from __future__ import annotations

import json

import pytest

import covey
from covey.cli.main import main
from covey.config import load_config
from covey.models.tiny import tiny_tokenizer
from covey.rewards.combine import RewardError
from covey.rollout.agents import Agent
from covey.rollout.environments import check_agent, environments_of
from covey.tasks.base import Example
from examples.number_guess.guess_env import GuessEnv
from tests.helpers import tiny_overrides
from tests.training.test_agents import script_first_turn

GUESS = '<tool_call>{"name": "guess", "arguments": {"number": 50}}</tool_call>'
NO_MODEL = "/no/such/model"


def found(environments, **kwargs):
    """TRL's documented form: the reward read off each episode's environment instance."""
    return [1.0 if env.found else 0.0 for env in environments]


class EchoEnv:
    """A second environment with a tool of its own name."""

    def reset(self, **row):
        self.said = ""

    def echo(self, text: str) -> str:
        """Repeat a text.

        Args:
            text: What to repeat.
        """
        self.said = text
        return text


class SizedEnv:
    def __init__(self, size: int):
        self.size = size

    def reset(self, **row):
        return None


class NoRewardEnv:
    def reset(self, **row):
        return None

    def poke(self) -> str:
        """Poke the environment."""
        return "ok"


def guess_config(model_dir, out_dir, **keys):
    return load_config(None, tiny_overrides(model_dir, out_dir, **{
        "task.name": "file", "task.path": "examples/number_guess/train.jsonl", "train.steps": 1,
        "rollout.max_turns": 2, "rollout.max_new_tokens": 96, "task.eval_size": 2, "reward.correctness": 0.0,
        "eval.metric": "reward", **keys}))


def test_a_reward_function_reads_the_episodes_environments(tiny_model_dir, tmp_path, monkeypatch):
    # every episode guesses 50 first: found where the secret is 50; GuessEnv's own get_reward is then 1.0 there
    # (one guess), so TRL's reward read off the instances equals the environment's reward, episode by episode
    script_first_turn(monkeypatch, GUESS)
    result = covey.train(guess_config(tiny_model_dir, tmp_path), reward_funcs=[found], environment_factory=GuessEnv)
    step = [json.loads(line) for line in (result.run_dir / "metrics.jsonl").read_text().splitlines()][1]
    assert step["tools/calls"] == 8
    assert step["reward/found"] == step["reward/environment"]


def test_named_environments_pick_by_the_environment_column_and_show_their_own_tools():
    tok = tiny_tokenizer()
    environments = environments_of({"guess": GuessEnv, "echo": EchoEnv})
    rows = [Example("Find it.", "0", meta={"environment": "guess", "secret": 7}),
            Example("Say hi.", "hi", meta={"environment": "echo"})]
    check_agent([], environments, rows)
    agent = Agent(tok, [], 5.0, environments)
    prompts = agent.prompts(rows)
    assert '"guess"' in prompts[0] and '"echo"' not in prompts[0]  # the system prompt lists its tools only
    assert '"echo"' in prompts[1] and '"guess"' not in prompts[1]
    _, hosts = agent.episodes(prompts, 2)
    assert [type(h.toolbox.environment).__name__ for h in hosts] == ["GuessEnv"] * 2 + ["EchoEnv"] * 2
    assert hosts[0].toolbox.environment is not hosts[1].toolbox.environment  # one instance per episode


def test_one_tool_function_alone_is_taken_as_tools(tiny_model_dir, tmp_path, capsys):
    from tests.training.test_agents import get_weather
    cfg = load_config(None, tiny_overrides(NO_MODEL, tmp_path, **{"task.name": "wordproblems"}))
    with pytest.raises(ValueError, match="model path not found"):  # reached the model: the tool was taken
        covey.train(cfg, tools=get_weather)


def data_with(tmp_path, rows: list[dict]):
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def refused(argv: list[str], tmp_path, capsys, **keys) -> str:
    code = main(["train", *argv, *tiny_overrides(NO_MODEL, tmp_path, **keys)])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1, err
    assert "model path not found" not in err
    return err


GUESS_ROWS = {"task.name": "file", "task.path": "examples/number_guess/train.jsonl", "eval.metric": "reward"}


@pytest.mark.parametrize("argv, expected", [
    (["rollout.tools=calculater"], "tool 'calculater' is not a built-in tool (did you mean calculator?)"),
    (["rollout.tools=no_such_file.py:f"], "tool 'no_such_file.py:f': cannot import"),
    (["rollout.tools=tests.training.test_trl_environments:echoo"], "has no callable 'echoo' (did you mean EchoEnv?)"),
    (["rollout.environment=examples/number_guess/guess_env.py:GuesEnv"],
     "guess_env.py has no callable 'GuesEnv' (did you mean GuessEnv?)"),
    (["rollout.environment=tests.training.test_trl_environments:SizedEnv"],
     "environment SizedEnv: covey calls SizedEnv() with no arguments"),
])
def test_tool_and_environment_faults_are_named_before_loading(argv, expected, tmp_path, capsys):
    keys = GUESS_ROWS if argv[0].startswith("rollout.environment") else {"task.name": "wordproblems"}
    err = refused(argv, tmp_path, capsys, **keys)
    assert expected in err and "reward function" not in err


def test_a_factory_that_needs_arguments_says_how_to_bind_them(tmp_path):
    cfg = guess_config(NO_MODEL, tmp_path)
    with pytest.raises(ValueError, match=r"functools.partial\(SizedEnv, size=\.\.\.\)"):
        covey.train(cfg, environment_factory=SizedEnv)


def test_a_run_with_no_reward_source_is_refused(tmp_path):
    # no reward function, correctness 0, and an environment without get_reward: nothing scores a sample
    cfg = guess_config(NO_MODEL, tmp_path)
    with pytest.raises(RewardError, match="no reward source"):
        covey.train(cfg, environment_factory=NoRewardEnv)


def test_a_row_naming_an_unknown_environment_is_refused_with_its_number(tmp_path):
    rows = [{"prompt": "Find it.", "secret": 3, "environment": "guess"},
            {"prompt": "Say hi.", "secret": 1, "environment": "eccho"}]
    cfg = load_config(None, tiny_overrides(NO_MODEL, tmp_path, **{
        "task.name": "file", "task.path": data_with(tmp_path, rows), "eval.metric": "reward",
        "reward.correctness": 0.0, "task.eval_size": 1, "train.seed": 0}))
    with pytest.raises(ValueError, match=r"training example \d: a training example has environment='eccho'"):
        covey.train(cfg, environment_factory={"guess": GuessEnv, "echo": EchoEnv})
