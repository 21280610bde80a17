"""From the plan's reward section (`RewardOptions`, built from reward.* by covey/training/plan_setup.py) to a
Rewarder: rule terms with weights plus user callables, the user's functions loaded and checked before any
model loads (`check_user_rewards`)."""

from __future__ import annotations

import difflib
import functools
import importlib
import importlib.util
import inspect
import math
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable

from covey.config import RMConfig
from covey.rewards.combine import Rewarder, RewardError, RewardTerm
from covey.rewards.judge import TERM_NAME, JudgeOptions, check_judge, load_judge
from covey.rewards.learned import load_learned_rewards
from covey.rewards.remote import RemoteReward, check_reachable
from covey.rewards.rules import (
    correctness_reward,
    format_reward,
    language_consistency,
    overlong_penalty,
    tool_use_reward,
)
from covey.rewards.scoring import placeholder_inputs
from covey.runtime.errors import first_line

BUILT_IN_NAMES = ("correctness", "format", "overlong", "language", "rm", "prm", "remote", TERM_NAME)
"""Names of covey's own terms: a user function of one of these names is reported as reward/user:<name>."""
NON_FINITE = ("returned nan", "returned inf", "returned -inf")
"""A reward function's faults that are values, not exceptions."""
ERRORS_LOG = "reward_errors.log"
"""The file in the run folder that keeps the traceback of each distinct reward-function error."""


@dataclass(frozen=True)
class RewardOptions:
    """What scores the samples: the reward.* keys of the same names, and what the terms read of the other
    sections (the answer column, the response budget, the environment, the run's length)."""
    correctness: float
    format: float
    tool_use: float
    overlong_buffer: int
    overlong_weight: float
    functions: tuple[str, ...]
    """The "module:function[:weight]" items of reward.functions."""
    on_error: str
    timeout_s: float
    max_failed_steps: int
    model_path: str
    model_weight: float
    prm_path: str
    prm_weight: float
    step_separator: str
    remote_url: str
    remote_weight: float
    remote_token_env: str
    remote_timeout_s: float
    remote_retries: int
    remote_batch_size: int
    iterative_every: int
    replay_fraction: float
    language: float
    language_target: str
    rm: RMConfig
    """How a refreshed reward model is trained (rm.*; a copy of the config's)."""
    answer_key: str
    """task.answer_key: the column the correctness term compares with."""
    max_new_tokens: int
    """rollout.max_new_tokens: the length the overlong penalty counts from."""
    environment: bool
    """rollout.environment is set: its get_reward() is the term `environment`."""
    max_steps: int
    """train.steps: the trainer_state of the call that checks each user function."""
    judge: JudgeOptions
    """reward.judge.*: the judge over each group (covey/rewards/judge.py); its model '' = none."""


def load_callable(spec: str, kind: str = "reward function") -> Callable:
    """'package.module:function' or 'path/to/file.py:function' -> the function; one clear line naming the
    `kind` of thing asked for (reward function, tool, environment) when it cannot be found. A module in the
    current folder imports however covey was started (the `covey` script does not put the current folder on
    sys.path; `python -m` does)."""
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise ValueError(f"{kind} '{spec}' must look like module:{'Class' if kind == 'environment' else 'function'} "
                         f"or file.py:{'Class' if kind == 'environment' else 'function'}")
    try:
        module = import_file(Path(module_name)) if module_name.endswith(".py") else import_here(module_name)
    except Exception as e:  # noqa: BLE001 - the user's module: any error while importing it, in one line
        raise ValueError(f"{kind} '{spec}': cannot import {module_name}: {first_line(e)}") from None
    fn = getattr(module, attr, None)
    if not callable(fn):
        names = {n.lower(): n for n in dir(module) if not n.startswith("_") and callable(getattr(module, n))}
        close = difflib.get_close_matches(attr.lower(), names, n=1)
        hint = f" (did you mean {names[close[0]]}?)" if close else ""
        raise ValueError(f"{kind} '{spec}': {module_name} has no callable '{attr}'{hint}")
    return fn


def import_here(module_name: str):
    """import_module, with the current folder searched after everything else on sys.path."""
    here = os.getcwd()
    if here not in sys.path and "" not in sys.path:
        sys.path.append(here)
    return importlib.import_module(module_name)


def import_file(path: Path):
    """A module from a .py file (its own name space: covey_user.<file stem>). Its folder is searched
    first while it runs, as for a script, so it imports the modules beside it; afterwards last, for
    imports made when a function is called."""
    path = path.expanduser()
    if not path.is_file():
        raise FileNotFoundError(f"no file {path}")
    name, folder = f"covey_user.{path.stem}", str(path.resolve().parent)
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses and pickling look their module up here
    sys.path.insert(0, folder)
    try:
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(folder)
        if folder not in sys.path:
            sys.path.append(folder)
    return module


def accepted_keywords(fn: Callable) -> frozenset | None:
    """The keywords `fn` takes by name, or None when it takes **kwargs (or has no readable signature)."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return None
    if any(p.kind is p.VAR_KEYWORD for p in params):
        return None
    return frozenset(p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY))



def parse_function(item: str) -> tuple[str, float]:
    """'pkg.mod:fn:0.5' -> ('pkg.mod:fn', 0.5); without a weight, 1.0."""
    parts = item.split(":")
    if len(parts) == 3:
        try:
            return f"{parts[0]}:{parts[1]}", float(parts[2])
        except ValueError:
            raise ValueError(f"reward.functions: weight of '{item}' is not a number") from None
    if len(parts) == 2:
        return item, 1.0
    raise ValueError(f"reward.functions: '{item}' must be module:function[:weight]")


def function_list(funcs) -> list:
    """reward_funcs as a list: one callable or one string is a list of one (as TRL takes it)."""
    if funcs is None:
        return []
    if isinstance(funcs, (str, RewardTerm)) or callable(funcs):
        return [funcs]
    return list(funcs)


def user_term(fn: Callable | str | RewardTerm) -> RewardTerm:
    """One user reward term, named by its function's name (metrics reward/<name>, as TRL names them),
    or reward/user:<name> where that is the name of one of covey's own terms."""
    if isinstance(fn, RewardTerm):
        return fn
    if isinstance(fn, str):
        spec, weight = parse_function(fn.strip())
        term = RewardTerm(spec.rsplit(":", 1)[1], load_callable(spec), weight, source=spec)
    elif callable(fn):
        term = RewardTerm(getattr(fn, "__name__", type(fn).__name__), fn, 1.0)
    elif isinstance(fn, tuple) and len(fn) == 2 and (callable(fn[0]) or isinstance(fn[0], str)):
        name = getattr(fn[0], "__name__", fn[0])
        raise ValueError(f"reward function ({name}, {fn[1]!r}) is a (function, weight) pair: give the functions in "
                         f"reward_funcs=[...] and their weights in reward_weights=[...], one per function, in "
                         "order (TRL's reward_weights)")
    else:
        raise ValueError(f"reward function {fn!r} is neither a callable nor a 'module:function[:weight]' string")
    if term.name in BUILT_IN_NAMES:
        term.name = f"user:{term.name}"
    term.keywords = accepted_keywords(term.fn)
    return term


def user_terms(funcs, weights: Iterable[float] | None = None) -> list[RewardTerm]:
    """Reward terms of Python callables (weight 1) and "module:function[:weight]" or "file.py:function[:weight]"
    strings; `weights` (TRL's reward_weights) gives each its weight, one per function, in order."""
    funcs = function_list(funcs)
    terms = [user_term(fn) for fn in funcs]
    if weights is None:
        return terms
    try:
        weights = [float(w) for w in function_list(weights)]
    except (TypeError, ValueError):
        raise ValueError(f"reward_weights must be numbers, one per reward function, not {weights!r}") from None
    if len(weights) != len(terms) or not all(map(math.isfinite, weights)):
        raise ValueError(f"reward_weights {weights} must hold one finite number for each of the {len(terms)} "
                         "reward_funcs, in their order (as TRL's reward_weights)")
    for fn, term, weight in zip(funcs, terms, weights):
        if isinstance(fn, str) and fn.count(":") == 2:
            raise ValueError(f"reward function '{fn}' has a weight in its name and one in reward_weights: give it once")
        term.weight = weight
    return terms


def user_reward_terms(rewards: RewardOptions, extra=()) -> list[RewardTerm]:
    """The functions of reward.functions, then `extra` (reward_funcs of the Python API)."""
    return user_terms([*rewards.functions, *function_list(extra)])


def check_user_rewards(rewards: RewardOptions, extra, data, run_dir: Path | None = None, episodes: bool = False,
                       environments: list | None = None) -> list[RewardTerm]:
    """The user's reward functions (reward.functions, then `extra`) loaded and checked before any model
    loads: each imports, takes only keywords that exist (or **kwargs), and one call on the first
    training example with a placeholder completion returns a list of one number or None. A failure is
    one line naming the function; an exception's traceback goes to the run folder's reward_errors.log.
    `environments`: the run's probe environment instances (reset on the first training row); the call
    then passes the first as TRL's `environments` keyword."""
    terms = user_reward_terms(rewards, extra)
    if not terms or not data.train:
        return terms
    example = data.train[0]
    prompts, completions, columns = placeholder_inputs(example, rewards.max_steps, episodes)
    if environments:
        columns["environments"] = environments[:1]
    for term in terms:
        check_signature(term, sorted({"prompts", "completions", *columns}))
    rewarder = Rewarder(terms, on_error="raise", timeout_s=rewards.timeout_s,
                        errors_log=run_dir / ERRORS_LOG if run_dir else None)
    for term in terms:
        values, faults = rewarder.run_term(term, prompts, completions, columns)
        fault = next((f for f in faults if f), None)
        text = completions[0] if isinstance(completions[0], str) else completions[0][0]["content"]
        where = (f"called before training on the first training prompt ({str(prompts[0])[:60]!r}) with the "
                 f"completion {text!r}")
        if fault in NON_FINITE:
            if rewards.on_error == "raise":  # the first such value in training would stop the run
                raise RewardError(f"reward function '{term.source or term.name}' {fault}, {where}: return a "
                                  "finite number (None: not scored), or set reward.on_error=zero or drop")
            print(f"covey: warning: reward function '{term.source or term.name}' {fault}, {where}; "
                  f"reward.on_error={rewards.on_error} applies to such values")
        elif fault:
            raise RewardError(f"reward function '{term.source or term.name}' {fault}, {where}")
    return terms


def check_reward_sources(rewards: RewardOptions, user: list[RewardTerm], environment_reward: bool = False) -> None:
    """A run needs something that scores its samples: a rule term with a weight, a user function, a learned
    or remote scorer, or an environment with get_reward (`environment_reward`); else one line, before loading
    (TRL refuses a trainer without reward source the same way). A remote scorer and a judge endpoint must accept a
    connection."""
    r = rewards
    if r.remote_url:
        check_reachable(r.remote_url)
    check_judge(r.judge, r.timeout_s)
    if (r.correctness or r.format or r.tool_use or r.overlong_buffer or r.language or user or r.model_path
            or r.prm_path or r.remote_url or r.judge.model or environment_reward):
        return
    raise RewardError("no reward source: reward.correctness is 0 and no reward function, learned or remote scorer, "
                      "or environment with a get_reward() method scores the samples: the run could not learn; set "
                      "reward.correctness=1, reward.functions=module:function, or give the environment get_reward()")


def check_signature(term: RewardTerm, keywords: list[str]) -> None:
    """Every parameter without a default is a keyword covey passes: a dataset column or one of TRL's."""
    try:
        params = inspect.signature(term.fn).parameters.values()
    except (TypeError, ValueError):
        return
    name = term.source or term.name
    for p in params:
        if p.default is not p.empty or p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            continue
        if p.kind is p.POSITIONAL_ONLY:
            raise ValueError(f"reward function '{name}' takes '{p.name}' by position only; reward functions are "
                             "called with keyword arguments (TRL's convention): drop the '/' from its signature")
        if p.name not in keywords:
            raise ValueError(f"reward function '{name}' takes '{p.name}', which is not a column of the training data "
                             f"nor a keyword covey passes ({', '.join(keywords)}): rename it, give it a default, "
                             "or read it from **kwargs")


def environment_reward(completions, environment_reward=None, **kwargs) -> list:
    """The reward term `environment`: each episode's environment get_reward() (None where it has none)."""
    return list(environment_reward) if environment_reward is not None else [None] * len(completions)


def build_rewarder(rewards: RewardOptions, learned=None, extra: Iterable[Callable | str] = (), verifier: str = "math",
                   user: list[RewardTerm] | None = None, run_dir: Path | None = None,
                   environment: bool = False) -> Rewarder:
    """Rule terms, user callables (reward.functions, then `extra`; or `user`, as check_user_rewards loaded
    them), learned RM / PRM (`learned`, loaded from reward.model_path / reward.prm_path if None) and a
    remote service. `verifier` (covey/tasks/verifiers.py, resolved from eval.metric) is what the correctness
    term checks with;
    `run_dir` holds reward_errors.log; `environment` (or rollout.environment): the episodes' environment
    scores them through its get_reward(), the term `environment` of weight 1, as in TRL.

    With a learned or remote source the verifier still runs at weight 0, so the
    logged accuracy and the RM/verifier agreement are measured, never rewarded.
    """
    r = rewards
    learned = learned if learned is not None else load_learned_rewards(r.model_path, r.prm_path, r.step_separator)
    monitor = bool(learned.outcome or learned.process or r.remote_url)
    terms = []
    if r.correctness or monitor:
        fn = functools.partial(correctness_reward, verifier=verifier, answer_column=r.answer_key)
        terms.append(RewardTerm("correctness", fn, r.correctness))
    if r.format:
        terms.append(RewardTerm("format", format_reward, r.format))
    if r.tool_use:
        terms.append(RewardTerm("tool_use", tool_use_reward, r.tool_use))
    if r.overlong_buffer:
        fn = functools.partial(overlong_penalty, max_len=r.max_new_tokens, buffer=r.overlong_buffer)
        terms.append(RewardTerm("overlong", fn, r.overlong_weight))
    if r.language:
        fn = functools.partial(language_consistency, language=r.language_target)
        terms.append(RewardTerm("language", fn, r.language))
    terms += user if user is not None else user_reward_terms(r, extra)
    if learned.outcome is not None:
        terms.append(RewardTerm("rm", learned.outcome, r.model_weight, formatted_prompts=True))
    if learned.process is not None and r.prm_weight:
        terms.append(RewardTerm("prm", learned.process, r.prm_weight, formatted_prompts=True))
    if r.remote_url:
        remote = RemoteReward.from_env(r.remote_url, r.remote_token_env, timeout_s=r.remote_timeout_s,
                                       retries=r.remote_retries, batch_size=r.remote_batch_size)
        terms.append(RewardTerm("remote", remote, r.remote_weight))
    if r.judge.model:
        terms.append(RewardTerm(TERM_NAME, load_judge(r.judge), r.judge.weight))
    if environment or r.environment:
        terms.append(RewardTerm("environment", environment_reward, 1.0))
    if r.max_failed_steps < 0:
        raise ValueError(f"reward.max_failed_steps={r.max_failed_steps}: set 0 (never stop) or a number of steps")
    return Rewarder(terms, on_error=r.on_error, timeout_s=r.timeout_s, errors_log=run_dir / ERRORS_LOG if run_dir
                    else None, max_failed_steps=r.max_failed_steps)
