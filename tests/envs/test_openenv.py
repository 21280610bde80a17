"""task.source=openenv:...: an OpenEnv environment wrapped as covey's environment (covey/envs/openenv.py).

The mapping (tool schema from the action schema, a call to a step, an observation to the reply, rewards and
done) is tested on sessions scripted here, without OpenEnv; the rest on a guess-the-number game written here as
an OpenEnv Environment, run in this process and served by openenv-core on loopback (a free port, shut down
after), and trained through covey's tool loop on the tiny model. Those tests skip without openenv-core, which
is not in the `test` extra (it pulls fastmcp, gradio and more): pip install 'covey[openenv]'."""

from __future__ import annotations

import json
import socket
import threading
import time
from contextlib import contextmanager
from typing import Literal, Optional

import pytest

import covey
from covey.config import ConfigError, load_config
from covey.envs.openenv import (
    OpenEnvEnvironment,
    Outcome,
    environment_type,
    observation_text,
    openenv_factory,
    python_type,
)
from covey.rollout.tools import Toolbox, ToolCall, ToolError, run_tool_calls
from covey.training.plan import make_plan
from tests.helpers import tiny_overrides
from tests.training.test_agents import script_first_turn

try:
    from openenv.core.env_server import Action, Environment, Observation, State, create_fastapi_app
    from pydantic import Field
except ImportError:
    Environment = None
needs_openenv = pytest.mark.skipif(Environment is None, reason="needs openenv-core: pip install 'covey[openenv]'")

if Environment is not None:

    class GuessAction(Action):
        """Guess the secret number."""
        number: int = Field(description="A whole number between 1 and 100.")

    class GuessObservation(Observation):
        feedback: str = ""

    class GuessEnvironment(Environment):
        """A secret number (the row's `secret` column); each guess is answered higher, lower or correct, and
        pays 1 when correct (the episode is then done)."""
        SUPPORTS_CONCURRENT_SESSIONS = True

        def reset(self, seed=None, episode_id=None, secret: int = 50, **kwargs) -> GuessObservation:
            self.secret, self.guesses = int(secret), 0
            return GuessObservation(feedback="Call step with a number until the answer is correct.")

        def step(self, action: GuessAction, timeout_s=None, **kwargs) -> GuessObservation:
            self.guesses += 1
            if action.number == self.secret:
                return GuessObservation(feedback="correct", reward=1.0, done=True)
            return GuessObservation(feedback="higher" if action.number < self.secret else "lower", reward=0.0)

        @property
        def state(self) -> State:
            return State(step_count=self.guesses)

    class UntypedEnvironment(GuessEnvironment):
        def step(self, action, timeout_s=None, **kwargs):
            return super().step(action)


# --------------------------------------------------------------------------- the mapping, on scripted sessions


class ScriptedSession:
    """A session answering reset and each step from a script of (fields, reward, done); records what it got."""

    def __init__(self, script: list[tuple[dict, float | None, bool]], log: list):
        self.script, self.log = list(script), log

    def reset(self, row: dict) -> Outcome:
        self.log.append(("reset", row))
        return Outcome({"board": "start"})

    def step(self, arguments: dict) -> Outcome:
        self.log.append(("step", arguments))
        return Outcome(*self.script.pop(0))

    def close(self) -> None:
        self.log.append(("close",))


ACTION = {"title": "MoveAction", "description": "Move a piece\n   on the board.", "type": "object",
          "properties": {"metadata": {"type": "object", "description": "Additional metadata"},
                         "square": {"type": "integer", "description": "Where to."},
                         "piece": {"enum": ["king", "pawn"], "description": "Which piece."},
                         "note": {"anyOf": [{"type": "string"}, {"type": "null"}], "default": None},
                         "path": {"type": "array", "items": {"type": "integer"}, "description": "Squares passed."}},
          "required": ["square", "piece"]}


def scripted(script, log):
    return environment_type("openenv:scripted", ACTION, lambda: ScriptedSession(script, log))


def test_the_step_tool_takes_the_actions_fields_and_hides_metadata():
    env = scripted([], [])()
    (schema,) = Toolbox([], environment=env).schemas
    function = schema["function"]
    assert function["name"] == "step" and function["description"] == "Move a piece on the board."
    assert function["parameters"]["properties"] == {
        "square": {"type": "integer", "description": "Where to."},
        "piece": {"type": "string", "enum": ["king", "pawn"], "description": "Which piece."},
        "note": {"type": "string", "nullable": True, "description": "note"},
        "path": {"type": "array", "items": {"type": "integer"}, "description": "Squares passed."}}
    assert function["parameters"]["required"] == ["square", "piece"]


@pytest.mark.parametrize("prop, expected", [
    ({"type": "number"}, float), ({"type": "boolean"}, bool), ({"type": "object"}, dict),
    ({"enum": [1, 2]}, Literal[1, 2]), ({"anyOf": [{"type": "integer"}, {"type": "null"}]}, Optional[int]),
    ({"$ref": "#/$defs/Point"}, dict), ({"type": "array"}, list),
])
def test_json_schema_types_become_type_hints(prop, expected):
    assert python_type(prop, {"Point": {"type": "object", "properties": {"x": {"type": "integer"}}}}) == expected


def test_a_call_is_a_step_and_its_observation_the_reply():
    log = []
    env = scripted([({"board": "e4"}, 0.25, False), ({"board": "e5", "check": True}, None, False)], log)()
    assert env.reset(prompt="Play.", level=2) == "\n\nstart"  # after a blank line: covey appends it to the prompt
    assert log[-1] == ("reset", {"prompt": "Play.", "level": 2})  # every column of the row goes to reset
    toolbox = Toolbox([], environment=env)
    replies = run_tool_calls(toolbox, [ToolCall("step", {"square": 4, "piece": "pawn"}),
                                       ToolCall("step", {"square": 5, "piece": "king", "path": [4]})], 5.0)
    # one field besides reward/done/metadata: its text; several: one JSON object
    assert [r["content"] for r in replies] == ["e4", '{"board": "e5", "check": true}']
    assert log[1:] == [("step", {"square": 4, "piece": "pawn"}), ("step", {"square": 5, "piece": "king", "path": [4]})]


def test_arguments_that_do_not_fit_are_answered_before_the_environment_sees_them():
    log = []
    env = scripted([], log)()
    env.reset(prompt="Play.")
    replies = run_tool_calls(Toolbox([], environment=env), [ToolCall("step", {"square": "e4", "piece": "pawn"}),
                                                            ToolCall("step", {"piece": "queen", "square": 1}),
                                                            ToolCall("step", {"piece": "pawn"})], 5.0)
    errors = [json.loads(r["content"])["error"] for r in replies]
    assert errors[0].startswith("step raised ValueError: square: Input should be a valid integer")
    assert errors[1] == "step raised ValueError: piece: Input should be 'king' or 'pawn'"
    assert "missing a required argument: 'square'" in errors[2]
    assert [entry[0] for entry in log] == ["reset"]  # no step reached the session


def test_the_reward_is_the_sum_of_the_steps_and_a_turns_score_the_sum_of_its_own():
    # step rewards 0.25, None (counts 0), 1.0 (done): the episode's reward is 0.25 + 0 + 1.0 = 1.25; the first
    # turn made the first two steps (0.25 + 0 = 0.25), the second the last (1.0), a third none (None: covey's
    # default rule scores it)
    log = []
    env = scripted([({"board": "a"}, 0.25, False), ({"board": "b"}, None, False), ({"board": "c"}, 1.0, True)], log)()
    env.reset()
    assert env.reset() == "start"  # no prompt in the row: no blank line; a second reset starts a new session
    assert [e[0] for e in log] == ["reset", "close", "reset"]
    env.step(square=1, piece="pawn")
    env.step(square=2, piece="pawn")
    assert env.turn_reward() == 0.25
    env.step(square=3, piece="pawn")
    assert env.turn_reward() == 1.0 and env.turn_reward() is None
    assert env.done and log[-1] == ("close",)  # done: the session is closed at once
    assert env.rewards == [0.25, 0.0, 1.0] and env.get_reward() == 1.25
    with pytest.raises(RuntimeError, match="the episode is over"):
        env.step(square=4, piece="pawn")
    assert [e[0] for e in log].count("step") == 3  # the call after done never reached the environment


def test_an_episode_without_a_step_scores_zero_and_get_reward_closes_its_session():
    log = []
    env = scripted([], log)()
    env.reset(prompt="Play.")
    assert env.get_reward() == 0.0 and log[-1] == ("close",)
    assert observation_text({}) == "" and observation_text({"n": 3}) == "3"


def test_a_missing_openenv_package_is_one_line_naming_the_extra(monkeypatch):
    import importlib.util
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "openenv" else real(name, *a))
    with pytest.raises(ToolError, match=r"^task.source=openenv:http://127.0.0.1:1 needs the openenv-core package: "
                                        r"pip install 'covey\[openenv\]'$"):
        openenv_factory("http://127.0.0.1:1")


def test_source_keys_are_read_and_refused_in_one_line():
    cfg = load_config(None, ["task.source=openenv:http://127.0.0.1:8000", "task.name=file", "task.path=x.jsonl"])
    assert make_plan(cfg).tools.openenv == "http://127.0.0.1:8000" and make_plan(cfg).episodes is not None
    with pytest.raises(ConfigError, match="rollout.environment=m:C another: set one or the other"):
        make_plan(load_config(None, ["task.source=openenv:m:E", "rollout.environment=m:C"]))


# --------------------------------------------------------------------------- a real OpenEnv game: in-process and served


def free_port_closed() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def serving(max_sessions: int):
    """GuessEnvironment served by openenv-core's own app on loopback, on a free port; shut down after."""
    import uvicorn
    app = create_fastapi_app(GuessEnvironment, GuessAction, GuessObservation, max_concurrent_envs=max_sessions)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="critical"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started and thread.is_alive() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert server.started, "the OpenEnv server did not start"
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(10)
        sock.close()


@pytest.fixture(scope="module")
def guess_server():
    if Environment is None:
        pytest.skip("needs openenv-core: pip install 'covey[openenv]'")
    with serving(32) as url:
        yield url


@needs_openenv
@pytest.mark.parametrize("where", ["in-process", "served"])
def test_an_openenv_game_in_process_or_served_plays_the_same(where, request):
    target = (request.getfixturevalue("guess_server") if where == "served"
              else "tests.envs.test_openenv:GuessEnvironment")
    factory = openenv_factory(target)
    assert issubclass(factory, OpenEnvEnvironment) and factory.__name__ == f"openenv:{target}"
    env = factory()
    (schema,) = Toolbox([], environment=env).schemas  # the same tool whether the class or /schema gave it
    assert schema["function"] == {"name": "step", "description": "Guess the secret number.", "parameters": {
        "type": "object", "properties": {"number": {"type": "integer", "description": "A whole number between 1 "
                                                                                       "and 100."}},
        "required": ["number"]}, "return": {"type": "string"}}
    assert env.reset(prompt="Find it.", secret=30, answer=None) == ("\n\nCall step with a number until the answer "
                                                                    "is correct.")
    calls = [ToolCall("step", {"number": n}) for n in (20, 40, 30, 30)]
    replies = [r["content"] for r in run_tool_calls(Toolbox([], environment=env), calls, 10.0)]
    assert replies[:3] == ["higher", "lower", "correct"] and "the episode is over" in replies[3]
    assert env.rewards == [0.0, 0.0, 1.0] and env.done and env.get_reward() == 1.0


@needs_openenv
def test_a_server_that_is_down_is_one_line_naming_its_url():
    url = f"http://127.0.0.1:{free_port_closed()}"
    with pytest.raises(ToolError) as caught:
        openenv_factory(url)
    message = str(caught.value)
    assert message.startswith(f"task.source=openenv:{url}: no OpenEnv server answers at {url} (")
    assert len(message.splitlines()) == 1


@needs_openenv
def test_a_full_server_says_how_many_sessions_covey_holds():
    with serving(1) as url:
        factory = openenv_factory(url)
        first, second = factory(), factory()
        first.reset(prompt="Find it.", secret=3)
        full = f"the OpenEnv server at {url} is full .* covey holds one session per episode under way"
        with pytest.raises(RuntimeError, match=full):
            second.reset(prompt="Find it.", secret=3)
        assert first.get_reward() == 0.0  # its session closed: room for another
        assert second.reset(prompt="Find it.", secret=3).endswith("until the answer is correct.")
        second.get_reward()


@needs_openenv
@pytest.mark.parametrize("target, expected", [
    ("tests.envs.test_openenv:observation_text", "is not a subclass of OpenEnv's Environment"),
    ("tests.envs.test_openenv:UntypedEnvironment", "cannot tell the action class of UntypedEnvironment"),
    ("tests.envs.test_openenv:GuesEnvironment", "has no callable 'GuesEnvironment' (did you mean GuessEnvironment?)"),
])
def test_an_in_process_target_that_cannot_work_is_one_line(target, expected):
    with pytest.raises(ValueError, match=None) as caught:
        openenv_factory(target)
    assert expected in str(caught.value) and len(str(caught.value).splitlines()) == 1


# --------------------------------------------------------------------------- trained through covey's tool loop

EPISODES: list = []
GUESS = '<tool_call>{"name": "step", "arguments": {"number": 50}}</tool_call>'
NO_MODEL = "/no/such/model"


def recorded(completions, environments, secret, **kwargs):
    """Records each episode's secret, tool reply and environment rewards; scores nothing of its own."""
    EPISODES.append([(s, c[1]["content"] if len(c) > 1 else None, list(env.rewards))
                     for s, c, env in zip(secret, completions, environments)])
    return [0.0] * len(completions)


def varied(completions, **kwargs):
    """A deterministic reward that differs between episodes (their last turn's text), so every step updates."""
    return [(sum(map(ord, c[-1]["content"])) % 7) / 6 for c in completions]


def guess_rows(path) -> str:
    secrets = [50, 7, 50, 93, 12, 50, 64, 50, 3, 88]
    path.write_text("".join(json.dumps({"prompt": "I am thinking of a number between 1 and 100. Find it.",
                                        "secret": s}) + "\n" for s in secrets))
    return str(path)


@needs_openenv
def test_a_run_against_a_server_that_is_down_stops_in_one_line_before_the_model_loads(tmp_path, capsys):
    from covey.cli.main import main
    url = f"http://127.0.0.1:{free_port_closed()}"
    code = main(["train", *tiny_overrides(NO_MODEL, tmp_path, **{"task.source": f"openenv:{url}", "task.name": "file",
                                                                 "task.path": guess_rows(tmp_path / "rows.jsonl")})])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and f"no OpenEnv server answers at {url}" in err, err


@needs_openenv
def test_rows_without_answers_are_scored_by_the_environment_alone(guess_server, tmp_path):
    """No reward function and no answer column: the environment's reward is the run's reward source (the data
    settles to eval.metric=reward); the run gets as far as loading the model, past every check of its inputs."""
    cfg = load_config(None, tiny_overrides(NO_MODEL, tmp_path, **{
        "task.source": f"openenv:{guess_server}", "task.name": "file", "task.path": guess_rows(tmp_path / "r.jsonl")}))
    with pytest.raises(ValueError, match="model path not found"):
        covey.train(cfg)


@needs_openenv
def test_an_openenv_server_trains_through_the_tool_loop_and_resumes_exactly(guess_server, tiny_model_dir, tmp_path,
                                                                             monkeypatch):
    """Every first turn guesses 50 (scripted: a random tiny model writes no call); the server answers, the reply
    is the observation, the reward is the environment's (1 where the secret is 50, else 0). Two steps in one go,
    and one step then a resume to two: the same second step (timings aside)."""
    script_first_turn(monkeypatch, GUESS)
    data = guess_rows(tmp_path / "rows.jsonl")

    def run(folder, steps: int, *extra: str) -> list[dict]:
        cfg = load_config(None, [*tiny_overrides(tiny_model_dir, tmp_path / folder, **{
            "task.source": f"openenv:{guess_server}", "task.name": "file", "task.path": data, "task.eval_size": 2,
            "rollout.max_turns": 2, "rollout.max_new_tokens": 64, "train.steps": steps, "train.save_every": 1}),
            *extra])
        result = covey.train(cfg, reward_funcs=[recorded, varied])
        return [json.loads(line) for line in (result.run_dir / "metrics.jsonl").read_text().splitlines()]

    def steady(row: dict) -> dict:  # as tests/training/test_agents.py: sampler log-probs round with batching
        return {k: v for k, v in row.items() if not k.startswith(("time/", "throughput/", "memory/", "sampler/"))}

    EPISODES.clear()
    whole = run("whole", 2)
    trained = [batch for batch in EPISODES if len(batch) == 8]  # training steps: 2 prompts x 4 episodes
    assert len(trained) == 2
    for secret, reply, rewards in (episode for batch in trained for episode in batch):
        expected = "correct" if secret == 50 else "higher" if secret > 50 else "lower"
        assert reply == expected and rewards[0] == (1.0 if secret == 50 else 0.0)
    step = [r for r in whole if r["step"] == 1 and "final" not in r][0]
    # the environment's reward of an episode is the sum of its steps' rewards; its mean over the step's 8 episodes
    assert step["tools/calls"] == 8 and step["reward/environment"] == sum(sum(e[2]) for e in trained[0]) / 8
    run("parts", 1)
    resumed = run("parts", 2, "train.resume=auto")
    second = [r for r in resumed if r["step"] == 2 and "final" not in r]
    assert steady(second[0]) == steady([r for r in whole if r["step"] == 2 and "final" not in r][0])
