"""Weighted sum of reward functions with an explicit failure policy.

A reward function is called the TRL way, with keyword arguments only:
`fn(prompts=[...], completions=[...], completion_ids=[...], trainer_state=..., **columns)
-> list[float | None]`. `prompts` are the dataset's prompts as written (a string, or a list of
chat messages), `completions` are strings for string prompts and `[{"role": "assistant",
"content": ...}]` for chat prompts, `completion_ids` the sampled token ids, `trainer_state` has
`global_step` and `max_steps`; the columns are every other dataset column under its own name,
plus `answer` (the reference answer) and `completion_lengths` (tokens). `def fn(completions,
**kwargs)` is enough.

A function may return None for a sample it does not score (TRL's convention): that sample's
value for that function is missing (NaN in `Scores.parts`, left out of the function's mean) and
adds nothing to the weighted sum; a sample no function scored gets 0 and is counted
(`Scores.unscored`). A function that raises, times out, returns the wrong count, a non-number,
NaN or inf is a *fault*. Policy (`reward.on_error`):

- raise: stop with one line naming the function and the first bad sample;
- zero:  that sample scores 0 for that function (counted in reward/errors);
- drop:  the sample is removed from its group before advantages (counted in
         reward/dropped).
"""

from __future__ import annotations

import concurrent.futures as cf
import importlib
import importlib.util
import math
import os
import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from covey.runtime.errors import first_line


class RewardError(RuntimeError):
    """A reward function failed under on_error=raise."""


@dataclass
class RewardTerm:
    name: str
    fn: Callable
    weight: float
    formatted_prompts: bool = False  # a learned reward model reads the prompts as the policy saw them
    source: str = ""  # where it came from ('file.py:function'), named in its errors


@dataclass
class TrainerState:
    """What TRL passes as `trainer_state`, the fields a reward schedule reads."""
    global_step: int = 0
    max_steps: int = 0


@dataclass
class Scores:
    total: torch.Tensor          # (N,) weighted sum
    parts: dict                  # name -> (N,) unweighted values (0 where faulty, NaN where None)
    valid: torch.Tensor          # (N,) bool, False where a fault asks for a drop
    errors: int                  # faulty (function, sample) pairs
    unscored: int = 0            # samples that every function returned None for (total 0)


def load_callable(spec: str) -> Callable:
    """'package.module:function' or 'path/to/file.py:function' -> the function; one clear line when
    it cannot be found. A module in the current folder imports however covey was started (the
    `covey` script does not put the current folder on sys.path; `python -m` does)."""
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise ValueError(f"reward function '{spec}' must look like module:function or file.py:function")
    try:
        module = import_file(Path(module_name)) if module_name.endswith(".py") else import_here(module_name)
    except Exception as e:  # noqa: BLE001 - the user's module: any error while importing it, in one line
        raise ValueError(f"reward function '{spec}': cannot import {module_name}: {first_line(e)}") from None
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise ValueError(f"reward function '{spec}': {module_name} has no callable '{attr}'")
    return fn


def import_here(module_name: str):
    """import_module, with the current folder searched after everything else on sys.path."""
    here = os.getcwd()
    if here not in sys.path and "" not in sys.path:
        sys.path.append(here)
    return importlib.import_module(module_name)


def import_file(path: Path):
    """A module from a .py file (its own name space: covey_user.<file stem>)."""
    path = path.expanduser()
    if not path.is_file():
        raise FileNotFoundError(f"no file {path}")
    name = f"covey_user.{path.stem}"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses and pickling look their module up here
    spec.loader.exec_module(module)
    return module


def _call_with_timeout(fn: Callable, timeout_s: float, *args, **kwargs):
    """fn(*args, **kwargs), or cf.TimeoutError after `timeout_s` seconds.

    A hung Python function cannot be killed from a thread: we stop waiting and
    leave it running in a daemon thread, which does not keep the process alive
    at exit (a ThreadPoolExecutor worker would: its threads are joined at exit).
    """
    outcome: dict = {}

    def target() -> None:
        try:
            outcome["value"] = fn(*args, **kwargs)
        except BaseException as e:  # noqa: BLE001 - handed to the caller's thread
            outcome["error"] = e

    worker = threading.Thread(target=target, name="covey-reward", daemon=True)
    worker.start()
    worker.join(timeout_s if timeout_s > 0 else None)
    if worker.is_alive():
        raise cf.TimeoutError
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"]


def _one_line(text: str) -> str:
    return " ".join(str(text).split())[:200]


def _as_list(out):
    """Lists and tuples as they are; 1-D tensors and arrays become lists; anything else None."""
    if isinstance(out, (list, tuple)):
        return list(out)
    if hasattr(out, "tolist") and getattr(out, "ndim", None) == 1:
        return out.tolist()
    return None


def _bad_value(v) -> str | None:
    """Why a returned value is a fault, or None when it is a finite number or None (not scored)."""
    if v is None:
        return None
    try:
        f = float(v)
    except (TypeError, ValueError):
        return f"returned non-number {repr(v)[:60]}"
    return None if math.isfinite(f) else f"returned {f}"


class Rewarder:
    """Scores completions with every term, applies the failure policy, sums with weights."""

    def __init__(self, terms: list[RewardTerm], on_error: str = "raise", timeout_s: float = 30.0):
        if not terms:
            raise ValueError("no reward function configured (all weights are 0)")
        names = [term.name for term in terms]
        twice = sorted({name for name in names if names.count(name) > 1})
        if twice:
            raise ValueError(f"reward function name {twice[0]!r} is given twice (metrics are named reward/<name>)")
        self.terms = terms
        self.on_error = on_error
        self.timeout_s = timeout_s

    def run_term(self, term: RewardTerm, prompts, completions, columns) -> tuple[list, list[str | None]]:
        """Values of one term (NaN where it returned None) and, per sample, a fault or None."""
        n = len(completions)
        try:
            out = _call_with_timeout(term.fn, self.timeout_s, prompts=prompts, completions=completions, **columns)
        except cf.TimeoutError:
            return [0.0] * n, [f"timed out after {self.timeout_s:g}s"] * n
        except Exception as e:  # noqa: BLE001 - any user failure is a reward fault
            return [0.0] * n, [f"raised {type(e).__name__}: {_one_line(e)}"] * n
        raw = _as_list(out)
        if raw is None:
            return [0.0] * n, [f"returned {type(out).__name__}, not a list of {n} values"] * n
        if len(raw) != n:
            return [0.0] * n, [f"returned {len(raw)} values for {n} samples"] * n
        faults = [_bad_value(v) for v in raw]
        values = [0.0 if f else math.nan if v is None else float(v) for v, f in zip(raw, faults)]
        return values, faults

    def __call__(self, prompts: list, completions: list, columns: dict, formatted_prompts: list | None = None) -> Scores:
        """Score with every term; `formatted_prompts` (the chat-formatted text) go to the terms that
        read prompts the way the policy saw them (learned reward models), `prompts` to the others."""
        n = len(completions)
        total = torch.zeros(n)
        valid = torch.ones(n, dtype=torch.bool)
        scored = torch.zeros(n, dtype=torch.bool)
        parts, errors = {}, 0
        for term in self.terms:
            given = formatted_prompts if term.formatted_prompts and formatted_prompts is not None else prompts
            values, faults = self.run_term(term, given, completions, columns)
            for i, fault in enumerate(faults):
                if fault is None:
                    continue
                errors += 1
                if self.on_error == "raise":
                    raise RewardError(f"reward function '{term.source or term.name}' {fault} "
                                      f"(first bad sample #{i}: {str(completions[i])[:80]!r})")
                if self.on_error == "drop":
                    valid[i] = False
            parts[term.name] = torch.tensor(values)
            scored |= ~parts[term.name].isnan()
            total += term.weight * parts[term.name].nan_to_num(0.0)
        return Scores(total=total, parts=parts, valid=valid, errors=errors, unscored=int((~scored).sum()))
