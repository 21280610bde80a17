"""OpenEnv environments as covey's environments (`task.source=openenv:<target>`, docs/environments.md).

OpenEnv (the `openenv-core` package, pip install 'covey[openenv]') serves an environment through
`reset(**kwargs)` and `step(action)`, each answering an observation with a reward and a done flag. covey
wraps it as an environment in TRL's `environment_factory` form, which its tool loop already runs
(covey/rollout/agents.py): one instance per episode, `reset(**row)`, its one tool, `get_reward()`.

- target: `module:Class` or `file.py:Class` of an OpenEnv `Environment` subclass, run in this process
  (its `step(action: MyAction)` names the action class), or the `http://` URL of a running OpenEnv server,
  one WebSocket session per episode through OpenEnv's own client (its `/schema` gives the action's fields).
- prompts: the task's rows (task.name, task.path) as with any environment. `reset(**row)` passes every
  column of the row to the environment's reset (it keeps those its reset names, as OpenEnv's server does:
  a `seed` column seeds it); the first observation's text is appended to the row's prompt.
- the tool: `step`, whose parameters are the action's fields (the base Action's `metadata` left out) and
  whose description is the action class's docstring; the model's call becomes `step(Action(**arguments))`
  and the observation's text its reply: the one field's value where the observation has one field besides
  reward, done and metadata, else those fields as JSON.
- reward and done: the episode's reward (`get_reward()`) is the sum of its steps' rewards (a step without
  one counts 0; no step: 0); each model turn's score (`turn_reward()`, reward.step_source=turns) is the sum
  of the rewards of that turn's steps. Once a step says done, a later call is answered with an error and
  never reaches the environment. The reward reset returns is not counted.
- sessions: an episode's session opens at reset and closes when it is done or scored (get_reward).
"""

from __future__ import annotations

import importlib.util
import inspect
import json
import re
import time
import typing
import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import Any, Callable, Literal, Optional, Union

from covey.rewards.build import load_callable
from covey.rollout.tools import ToolError
from covey.runtime.errors import first_line

TOOL_NAME = "step"
"""The name of the one tool an OpenEnv environment gives the model."""
HIDDEN_FIELDS = ("metadata",)
"""Action fields the model is not shown (OpenEnv's base Action carries `metadata`)."""
OBSERVATION_EXTRAS = ("reward", "done", "metadata")
"""Observation fields that are not its text (OpenEnv's serialization leaves them out as well)."""
JSON_TYPES = {"string": str, "integer": int, "number": float, "boolean": bool, "array": list, "object": dict}
SCHEMA_TIMEOUT_S = 10.0
"""Seconds covey waits for a server's /schema when the run starts."""
FULL_SERVER_WAIT_S = 2.0
"""Seconds a reset asks a full server again before it gives up."""
INSTALL = "pip install 'covey[openenv]'"


@dataclass
class Outcome:
    """What reset or step answered: the observation's fields (reward, done and metadata left out), its reward
    (None: none given) and whether the episode is over."""
    observation: dict
    reward: float | None = None
    done: bool = False


def observation_text(fields: dict) -> str:
    """The text the model reads of an observation: '' without fields; the value of its one field (a text as
    it is, anything else as JSON); several fields as one JSON object."""
    if not fields:
        return ""
    if len(fields) == 1:
        value = next(iter(fields.values()))
        return value if isinstance(value, str) else json.dumps(value, default=str, ensure_ascii=False)
    return json.dumps(fields, default=str, ensure_ascii=False)


# --------------------------------------------------------------------------- sessions: in-process and remote


def reset_arguments(reset: Callable, row: dict) -> dict:
    """The columns of `row` that `reset` takes: all of them where it takes **kwargs, else those it names (the
    rule of OpenEnv's server)."""
    params = inspect.signature(reset).parameters.values()
    if any(p.kind is p.VAR_KEYWORD for p in params):
        return dict(row)
    names = {p.name for p in params}
    return {k: v for k, v in row.items() if k in names}


class LocalSession:
    """One episode of an OpenEnv `Environment` subclass run in this process."""

    def __init__(self, env_class: type, action_class: type):
        self.env, self.action_class = env_class(), action_class

    def reset(self, row: dict) -> Outcome:
        return outcome_of(self.env.reset(**reset_arguments(self.env.reset, row)))

    def step(self, arguments: dict) -> Outcome:
        from pydantic import ValidationError
        try:
            action = self.action_class.model_validate(arguments)
        except ValidationError as e:
            raise ValueError(validation_text(e)) from None
        return outcome_of(self.env.step(action))

    def close(self) -> None:
        self.env.close()


def outcome_of(observation) -> Outcome:
    """An OpenEnv Observation (a pydantic model) as OpenEnv's server would send it."""
    fields = observation.model_dump(exclude=set(OBSERVATION_EXTRAS))
    return Outcome(fields, observation.reward, bool(observation.done))


class RemoteSession:
    """One episode on an OpenEnv server: a WebSocket session of OpenEnv's generic client (its own event loop
    thread), open from reset to close."""

    def __init__(self, url: str):
        self.url, self.client = url, None

    def connect(self):
        from openenv.core.generic_client import GenericEnvClient
        self.client = GenericEnvClient(base_url=self.url).sync()
        return self.client

    def reset(self, row: dict) -> Outcome:
        """The session's reset; a full server (it refuses the session, or closes it at once) is asked again
        until FULL_SERVER_WAIT_S have passed (sessions that just closed may not have left it yet)."""
        from websockets.exceptions import ConnectionClosed
        row = json.loads(json.dumps(row, default=str))  # what the server can read of every column
        deadline = time.monotonic() + FULL_SERVER_WAIT_S
        while True:
            try:
                return self.outcome(self.connect().reset(**row))
            except (RuntimeError, ConnectionClosed) as e:
                if not isinstance(e, ConnectionClosed) and "CAPACITY_REACHED" not in str(e):
                    raise
                self.close()
                if time.monotonic() > deadline:
                    raise RuntimeError(f"the OpenEnv server at {self.url} is full (it refused or closed every new "
                                       f"session for {FULL_SERVER_WAIT_S:g} s): covey holds one session per episode "
                                       "under way (rollout.prompts_per_step x rollout.group_size, held-out: up to "
                                       "rollout.eval_batch_size) and one for its start-up check: start it with a "
                                       "larger max_concurrent_envs") from e
                time.sleep(0.1)

    def step(self, arguments: dict) -> Outcome:
        return self.outcome(self.client.step(arguments))

    def close(self) -> None:
        client, self.client = self.client, None
        if client is not None:
            client.close()

    @staticmethod
    def outcome(result) -> Outcome:
        fields = {k: v for k, v in (result.observation or {}).items() if k not in OBSERVATION_EXTRAS}
        return Outcome(fields, result.reward, bool(result.done))


# --------------------------------------------------------------------------- the environment covey runs


class OpenEnvEnvironment:
    """One episode of an OpenEnv environment, as covey's tool loop runs environments. `openenv_factory` makes a
    subclass per target with its `step` tool; subclass that to read observations another way
    (`_observation_text`). After the episode: `rewards` (each step's), `done`, `observation` (the last one's
    fields), which reward functions taking `environments` may read."""

    _open: Callable[[], object] = None  # starts a session: LocalSession, RemoteSession (environment_type)

    def __init__(self):
        self._session = None
        self.rewards: list[float] = []
        self.done = False
        self.observation: dict = {}
        self._turn: list[float] = []

    def reset(self, **row) -> str:
        """A fresh session reset with the row's columns; the first observation's text, after a blank line when
        the row has a prompt (covey appends it to the prompt)."""
        self._close()
        self.rewards, self.done, self.observation, self._turn = [], False, {}, []
        self._session = type(self)._open()
        try:
            outcome = self._session.reset(row)
        except BaseException:
            self._close()
            raise
        self.observation = outcome.observation
        text = self._observation_text(outcome.observation)
        return f"\n\n{text}" if text and row.get("prompt") else text

    def get_reward(self) -> float:
        """The sum of the episode's step rewards; the episode's session is closed."""
        self._close()
        return float(sum(self.rewards))

    def turn_reward(self) -> float | None:
        """The sum of the rewards of the steps since the last call (the model turn just ended); None without
        any (covey then scores the turn by its default rule)."""
        turn, self._turn = self._turn, []
        return float(sum(turn)) if turn else None

    def _act(self, arguments: dict) -> str:
        if self.done:
            raise RuntimeError("the episode is over (the environment said done); answer without a tool call")
        if self._session is None:
            raise RuntimeError("the environment has no session: reset(**row) starts one")
        outcome = self._session.step(arguments)
        reward = 0.0 if outcome.reward is None else float(outcome.reward)
        self.rewards.append(reward)
        self._turn.append(reward)
        self.observation, self.done = outcome.observation, outcome.done
        if self.done:
            self._close()
        return self._observation_text(outcome.observation)

    def _observation_text(self, fields: dict) -> str:
        return observation_text(fields)

    def _close(self) -> None:
        session, self._session = self._session, None
        if session is not None:
            session.close()


# --------------------------------------------------------------------------- the step tool from the action schema


def python_type(prop: dict, defs: dict):
    """The type hint of one JSON-schema property (pydantic's model_json_schema), for the tool's schema."""
    if "$ref" in prop:
        prop = defs.get(prop["$ref"].rsplit("/", 1)[-1], {})
    if "enum" in prop:
        return Literal[tuple(prop["enum"])]
    options = prop.get("anyOf") or prop.get("oneOf")
    if options:
        kinds = [python_type(p, defs) for p in options if p.get("type") != "null"]
        inner = kinds[0] if len(kinds) == 1 else Union[tuple(kinds)] if kinds else Any
        return Optional[inner] if len(kinds) < len(options) else inner
    if prop.get("type") == "array":
        return list[python_type(prop["items"], defs)] if prop.get("items") else list
    return JSON_TYPES.get(prop.get("type"), Any)


def check_arguments(arguments: dict, hints: dict) -> None:
    """ValueError naming each argument whose value does not fit its field's type (pydantic's message)."""
    from pydantic import TypeAdapter, ValidationError
    problems = []
    for name, value in arguments.items():
        try:
            TypeAdapter(hints.get(name, Any)).validate_python(value)
        except ValidationError as e:
            problems.append(f"{name}: {e.errors()[0]['msg']}")
    if problems:
        raise ValueError("; ".join(problems))


def validation_text(error) -> str:
    """A pydantic ValidationError in one line: 'field: message; ...'."""
    return "; ".join(f"{'.'.join(map(str, e['loc'])) or 'action'}: {e['msg']}" for e in error.errors())


def one_line(text: str) -> str:
    return re.sub(r"\s+", " ", text or "").strip()


def step_tool(schema: dict, name: str) -> Callable:
    """The `step` method of an environment whose action has this JSON schema: a keyword parameter per field
    (required where the action requires it), typed and described for the model; a call passes the
    arguments the model gave to `_act`."""
    defs, required = schema.get("$defs", {}), set(schema.get("required", ()))
    fields = {k: v for k, v in schema.get("properties", {}).items() if k not in HIDDEN_FIELDS}

    def step(self, **arguments) -> str:
        check_arguments(arguments, hints)  # the model reads why a value does not fit, whatever the server says
        return self._act(arguments)

    P = inspect.Parameter
    params, hints, lines = [P("self", P.POSITIONAL_OR_KEYWORD)], {}, []
    for field, prop in fields.items():
        if not field.isidentifier() or field == "self":
            raise ToolError(f"{name}: the action's field {field!r} cannot be a tool parameter (not a Python name)")
        hints[field] = python_type(prop, defs)
        default = P.empty if field in required else prop.get("default")
        params.append(P(field, P.KEYWORD_ONLY, default=default, annotation=hints[field]))
        lines.append(f"    {field}: {one_line(prop.get('description') or prop.get('title') or field)}")
    about = one_line(schema.get("description")) or f"Act in the {schema.get('title', 'OpenEnv')} environment."
    step.__name__ = step.__qualname__ = TOOL_NAME
    step.__signature__ = inspect.Signature(params, return_annotation=str)
    step.__annotations__ = {**hints, "return": str}
    step.__doc__ = about + ("\n\nArgs:\n" + "\n".join(lines) if lines else "")
    return step


# --------------------------------------------------------------------------- targets


def openenv_factory(target: str) -> type:
    """The environment class covey runs for `task.source=openenv:<target>` (also usable as covey.train's
    environment_factory=): a subclass of OpenEnvEnvironment with the target's `step` tool. A target that
    cannot work (no openenv-core, a server that does not answer, a class that is not an OpenEnv
    Environment) is one line naming it."""
    source = f"openenv:{target}"
    if importlib.util.find_spec("openenv") is None:
        raise ToolError(f"task.source={source} needs the openenv-core package: {INSTALL}")
    if target.startswith(("http://", "https://")):
        url = target.rstrip("/")
        schema, opener = server_action_schema(url, source), (lambda: RemoteSession(url))
    else:
        env_class = environment_class(target, source)
        action = action_class(env_class, source)
        schema, opener = action.model_json_schema(), (lambda: LocalSession(env_class, action))
    return environment_type(source, schema, opener)


def environment_type(name: str, schema: dict, opener: Callable[[], object]) -> type:
    """The OpenEnvEnvironment subclass named `name` whose `step` tool takes the fields of the action `schema`
    and whose episodes run in the sessions `opener` starts (anything with reset(row), step(arguments) and
    close(), answering Outcomes)."""
    return type(name, (OpenEnvEnvironment,), {TOOL_NAME: step_tool(schema, name), "_open": staticmethod(opener)})


def server_action_schema(url: str, source: str) -> dict:
    """The action's JSON schema from a running server's /schema."""
    try:
        with urllib.request.urlopen(f"{url}/schema", timeout=SCHEMA_TIMEOUT_S) as answer:
            body = json.loads(answer.read())
    except urllib.error.HTTPError as e:
        raise ToolError(f"task.source={source}: {url}/schema answered HTTP {e.code}: is {url} an OpenEnv "
                        "server?") from None
    except (urllib.error.URLError, OSError) as e:
        reason = getattr(e, "reason", e)
        raise ToolError(f"task.source={source}: no OpenEnv server answers at {url} ({reason}): start it, or "
                        "correct the URL") from None
    except ValueError as e:
        raise ToolError(f"task.source={source}: {url}/schema is not JSON ({first_line(e)}): is {url} an "
                        "OpenEnv server?") from None
    if not isinstance(body, dict) or not isinstance(body.get("action"), dict):
        raise ToolError(f"task.source={source}: {url}/schema has no action schema: is {url} an OpenEnv server?")
    return body["action"]


def environment_class(target: str, source: str) -> type:
    """The OpenEnv Environment subclass `module:Class` (or `file.py:Class`) names."""
    from openenv.core.env_client import EnvClient
    from openenv.core.env_server import Environment
    found = load_callable(target, kind="environment")
    if isinstance(found, type) and issubclass(found, EnvClient):
        raise ToolError(f"task.source={source}: {found.__name__} is an OpenEnv client; give the http:// URL of "
                        "its server (task.source=openenv:http://HOST:PORT), or its Environment class")
    if not (isinstance(found, type) and issubclass(found, Environment)):
        raise ToolError(f"task.source={source}: {target} is not a subclass of OpenEnv's Environment "
                        "(openenv.core.env_server.Environment)")
    return found


def action_class(env_class: type, source: str) -> type:
    """The Action subclass an Environment's step takes: the hint on its `action` parameter, else the first
    type argument of its Environment[Action, Observation, State] base."""
    from openenv.core.env_server import Action
    try:
        hint = typing.get_type_hints(env_class.step).get("action")
    except Exception:  # noqa: BLE001 - a hint that does not resolve: the generic base may still say
        hint = None
    found = [hint] + [typing.get_args(base)[0] for klass in env_class.__mro__
                      for base in getattr(klass, "__orig_bases__", ()) if typing.get_args(base)]
    for candidate in found:
        if isinstance(candidate, type) and issubclass(candidate, Action) and candidate is not Action:
            return candidate
    raise ToolError(f"task.source={source}: cannot tell the action class of {env_class.__name__}: write its step "
                    "as step(self, action: MyAction, ...), MyAction a subclass of OpenEnv's Action")
