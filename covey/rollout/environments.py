"""Tools and environments as TRL 1.16 takes them, resolved and checked before any model loads.

- `tools=`: a list of functions, or one function; rollout.tools names built-in tools (calculator)
  or `module:function` / `file.py:function`. A name that is neither gets a did-you-mean.
- `environment_factory=`: one callable (a class) called with no arguments for each episode, or a
  dict of named factories: each example then picks its environment by its `environment` column,
  and its prompt shows that environment's tools only (TRL's multi-environment form).
- `check_agent` builds one instance of every environment (a factory that needs arguments is one
  line saying what covey calls and how to bind them), checks `reset` and the tools' schemas, calls
  `reset(**row)` on the first training row that picks it, and checks every row names a known
  environment. The probes' instances then give each environment's tool schemas.
"""

from __future__ import annotations

import difflib
import inspect
from dataclasses import dataclass, field
from typing import Callable, Iterable

from covey.rewards.build import load_callable
from covey.rewards.combine import describe_exception, run_to_end
from covey.rollout.tools import Toolbox, ToolError
from covey.tasks.tools import calculator

BUILTIN_TOOLS = {"calculator": calculator}
"""Tools covey ships, by the name rollout.tools takes."""
ENVIRONMENT_COLUMN = "environment"
"""The dataset column that picks an example's environment when environment_factory is a dict (TRL's name)."""


def tool_list(tools) -> list[Callable]:
    """The Python API's `tools=`: a list, or one function alone (as TRL takes it)."""
    if tools is None:
        return []
    if callable(tools):
        return [tools]
    return list(tools)


def load_tools(spec: str, extra=None) -> list[Callable]:
    """rollout.tools (built-in names, module:function, file.py:function), then the Python API's tools."""
    out = []
    for item in filter(None, (s.strip() for s in spec.split(","))):
        if item in BUILTIN_TOOLS:
            out.append(BUILTIN_TOOLS[item])
        elif ":" not in item:
            close = difflib.get_close_matches(item, BUILTIN_TOOLS, n=1)
            hint = f" (did you mean {close[0]}?)" if close else ""
            raise ToolError(f"rollout.tools: tool '{item}' is not a built-in tool{hint}; built in: "
                            f"{', '.join(BUILTIN_TOOLS)}, or give module:function / file.py:function")
        else:
            out.append(load_callable(item, kind="tool"))
    return out + tool_list(extra)


def factory_name(factory) -> str:
    inner = getattr(factory, "func", factory)  # a functools.partial names its function
    return getattr(inner, "__name__", type(inner).__name__)


def required_arguments(factory) -> list[str]:
    """The parameters a no-argument call of `factory` would lack (a class: its __init__'s)."""
    try:
        params = inspect.signature(factory).parameters.values()
    except (TypeError, ValueError):
        return []
    return [p.name for p in params if p.default is p.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD,
                                                                         p.KEYWORD_ONLY)]


def construct(factory) -> object:
    """`factory()`, as TRL calls it; a one-line ToolError naming the environment when it fails."""
    name = factory_name(factory)
    missing = required_arguments(factory)
    if missing:
        raise ToolError(f"environment {name}: covey calls {name}() with no arguments for each episode (as TRL's "
                        f"environment_factory) but it requires {', '.join(missing)}: pass "
                        f"functools.partial({name}, {missing[0]}=...) or a subclass that sets them")
    try:
        environment = factory()
    except Exception as e:  # noqa: BLE001 - the user's constructor, reported in one line
        raise ToolError(f"environment {name}: {name}() {describe_exception(e)}") from e
    if not callable(getattr(environment, "reset", None)):
        raise ToolError(f"environment {name}: its instances need a reset(**row) method (TRL's environment_factory "
                        "convention), called before each episode with the dataset row's columns")
    return environment


@dataclass
class Environments:
    """The run's environment factories by name (None: the one factory of a plain environment_factory), and one
    probe instance of each (its tool schemas; whether it owns a reward through get_reward)."""
    factories: dict
    probes: dict = field(default_factory=dict)

    @property
    def named(self) -> bool:
        return None not in self.factories

    def name_of(self, example) -> str | None:
        """The environment an example picks: its `environment` column where the factories are named."""
        if not self.named:
            return None
        name = example.meta.get(ENVIRONMENT_COLUMN)
        if name not in self.factories:
            raise ToolError(f"a training example has {ENVIRONMENT_COLUMN}={name!r}, not one of the environments of "
                            f"environment_factory ({', '.join(map(str, self.factories))})")
        return name

    def owns_reward(self) -> bool:
        """Some environment scores its episodes (a get_reward method): a reward source of its own."""
        return any(callable(getattr(p, "get_reward", None)) for p in self.probes.values())


def environments_of(factory) -> Environments | None:
    """environment_factory as TRL takes it: None, one callable, or a dict {name: callable}."""
    if factory is None:
        return None
    if isinstance(factory, dict):
        if not factory:
            raise ToolError("environment_factory is an empty dict: give at least one {name: factory}")
        for name, item in factory.items():
            if not callable(item):
                raise ToolError(f"environment_factory[{name!r}] is a {type(item).__name__}, not a class or callable")
        return Environments(dict(factory))
    if not callable(factory):
        raise ToolError(f"environment_factory is a {type(factory).__name__}: give a class (or a callable that returns "
                        "an environment), or a dict of them by name")
    return Environments({None: factory})


def check_agent(tools: list[Callable], environments: Environments | None, rows: Iterable) -> None:
    """Before the model loads: every tool's schema, one instance of each environment (its tools' schemas, a reset
    on the first training row that picks it), and every row's environment name. Fills `environments.probes`."""
    Toolbox(tools)  # schemas, duplicate names
    if environments is None:
        return
    rows = list(rows)
    first = {}
    for index, example in enumerate(rows):
        try:
            first.setdefault(environments.name_of(example), example)
        except ToolError as e:
            raise ToolError(f"training example {index + 1}: {e}") from None
    for name, factory in environments.factories.items():
        instance = construct(factory)
        Toolbox(tools, environment=instance)
        if name in first:
            reset_probe(instance, factory_name(factory), first[name])
        environments.probes[name] = instance


def episode_row(example) -> dict:
    """The row an environment's reset(**row) receives: every dataset column, the prompt as the dataset gives
    it, and the reference answer."""
    return {**example.meta, "prompt": example.given_prompt, "answer": example.answer}


def reset_probe(instance, name: str, example) -> None:
    """reset(**row) on one training row, as an episode will call it."""
    try:
        run_to_end(instance.reset(**episode_row(example)))
    except Exception as e:  # noqa: BLE001 - the user's reset, reported in one line
        hint = "; reset receives every column of the row: give it **kwargs" if isinstance(e, TypeError) else ""
        raise ToolError(f"environment {name}: reset(**row) on the first training row {describe_exception(e)}{hint}") \
            from e
