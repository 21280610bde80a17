"""Weighted sum of reward functions with an explicit failure policy.

A reward function is called the TRL way, with keyword arguments only:
`fn(prompts=[...], completions=[...], completion_ids=[...], trainer_state=..., **columns)
-> list[float | None]`. `prompts` are the dataset's prompts as written (a string, or a list of
chat messages), `completions` are strings for string prompts and `[{"role": "assistant",
"content": ...}]` for chat prompts, `completion_ids` the sampled token ids, `trainer_state` has
`global_step` and `max_steps`; the columns are every other dataset column under its own name,
plus `answer` (the reference answer) and `completion_lengths` (tokens). `def fn(completions,
**kwargs)` is enough; a function without `**kwargs` gets only the keywords it names. An `async def`
function's coroutine is run to its end, as TRL runs it.

Functions run in the calling thread, so libraries that time themselves with `signal.alarm`
(math_verify's `parse` and `verify`) work unchanged. `reward.timeout_s` is enforced there by a
watchdog thread that interrupts the main thread with SIGURG (`Watchdog`): not with SIGALRM, whose
one timer a nested `signal.alarm` (math_verify's) replaces and then cancels. Measured on a 2-core
EPYC (1000 calls of a trivial reward, four runs, dev/LOG.md 2026-11-26): 7.4-12.5 us a call, as
with a SIGALRM timer (6.5-11.5 us), against 82-120 us in a fresh worker thread (how calls ran
before) and 200-370 us through a process pool; a bare call costs 0.5-0.9 us. Outside the main
thread (the reward server's handlers) the function runs in a daemon thread that is abandoned at
the timeout.

A function may return None for a sample it does not score (TRL's convention): that sample's
value for that function is missing (NaN in `Scores.parts`, left out of the function's mean) and
adds nothing to the weighted sum; a sample no function scored gets 0 and is counted
(`Scores.unscored`). A function that raises (SystemExit included), times out, returns the wrong
count, a non-number, NaN or inf is a *fault*. Policy (`reward.on_error`):

- raise: stop with one line naming the function and the first bad sample;
- zero:  that sample scores 0 for that function (counted in reward/errors);
- drop:  the sample is removed from its group before advantages (counted in
         reward/dropped).

The first line of an exception is shown whole; its traceback goes to the errors log
(`reward_errors.log` in the run folder), each distinct error once. `FailureStreaks` stops a run
in which, for `reward.max_failed_steps` training steps in a row, a function failed on every
sample, every sample was dropped or no sample was scored.
"""

from __future__ import annotations

import asyncio
import inspect
import math
import os
import signal
import threading
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

WATCHDOG_SIGNAL = getattr(signal, "SIGURG", None)
"""Interrupts a reward call past its timeout. Its default action is to ignore it, so one that arrives
after the call has ended does nothing; SIGALRM is left to the functions (math_verify's alarms)."""


class RewardError(RuntimeError):
    """A reward function failed under on_error=raise, or failed for reward.max_failed_steps steps in a row."""


class RewardTimeout(BaseException):
    """A reward call ran past reward.timeout_s. A BaseException, so a function's own `except Exception`
    does not swallow it."""


@dataclass
class RewardTerm:
    name: str
    fn: Callable
    weight: float
    formatted_prompts: bool = False  # a learned reward model reads the prompts as the policy saw them
    source: str = ""  # where it came from ('file.py:function'), named in its errors
    keywords: frozenset | None = None  # the keywords it takes (no **kwargs); None: every keyword


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
    failed: dict = field(default_factory=dict)  # name -> fault, for terms that faulted on every sample


# --------------------------------------------------------------------------- calling, with a timeout


class Watchdog:
    """One daemon thread per process: past the armed deadline it sends WATCHDOG_SIGNAL to the main
    thread, and again every second until disarmed (a function that caught the first is interrupted
    again). A signal, unlike a thread, ends a blocking sleep or read at once."""

    def __init__(self):
        self.cond = threading.Condition()
        self.deadline: float | None = None
        self.target = threading.main_thread().ident
        threading.Thread(target=self.watch, name="covey-reward-watchdog", daemon=True).start()

    def watch(self) -> None:
        with self.cond:
            while True:
                left = None if self.deadline is None else self.deadline - time.monotonic()
                if left is None or left > 0:
                    self.cond.wait(left)
                    continue
                signal.pthread_kill(self.target, WATCHDOG_SIGNAL)
                self.deadline += 1.0

    def arm(self, seconds: float) -> None:
        with self.cond:
            self.deadline = time.monotonic() + seconds
            self.cond.notify()

    def disarm(self) -> None:
        with self.cond:
            self.deadline = None


WATCHDOGS: dict[int, Watchdog] = {}  # by process id: a forked child starts its own


def process_watchdog() -> Watchdog:
    if os.getpid() not in WATCHDOGS:
        WATCHDOGS[os.getpid()] = Watchdog()
    return WATCHDOGS[os.getpid()]


def call_reward(fn: Callable, timeout_s: float, kwargs: dict):
    """fn(**kwargs), a coroutine it returns run to its end; RewardTimeout after `timeout_s` seconds (0: no limit).

    In the main thread the call runs right there (signal.alarm works in it) under the watchdog; in
    another thread it runs in a daemon thread that is abandoned at the timeout (a hung Python
    function cannot be killed from a thread, and a daemon thread does not keep the process alive)."""
    if timeout_s <= 0:
        return run_to_end(fn(**kwargs))
    if threading.current_thread() is threading.main_thread() and WATCHDOG_SIGNAL and hasattr(signal, "pthread_kill"):
        return call_under_watchdog(fn, timeout_s, kwargs)
    return call_in_thread(lambda: run_to_end(fn(**kwargs)), timeout_s)


def call_under_watchdog(fn: Callable, timeout_s: float, kwargs: dict):
    state = {"running": True}

    def interrupt(signum, frame) -> None:
        if state["running"]:
            raise RewardTimeout

    previous = signal.signal(WATCHDOG_SIGNAL, interrupt)
    watchdog = process_watchdog()
    try:
        watchdog.arm(timeout_s)
        return run_to_end(fn(**kwargs))
    finally:
        while True:  # a signal handled as the call ends raises once more: undo again
            try:
                state["running"] = False
                watchdog.disarm()
                signal.signal(WATCHDOG_SIGNAL, previous if previous is not None else signal.SIG_DFL)
                break
            except RewardTimeout:
                continue


def call_in_thread(call: Callable, timeout_s: float):
    outcome: dict = {}

    def target() -> None:
        try:
            outcome["value"] = call()
        except BaseException as e:  # noqa: BLE001 - handed to the caller's thread
            outcome["error"] = e

    worker = threading.Thread(target=target, name="covey-reward", daemon=True)
    worker.start()
    worker.join(timeout_s if timeout_s > 0 else None)
    if worker.is_alive():
        raise RewardTimeout
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"]


def run_to_end(out):
    """A coroutine (from an `async def` function) run to its end; anything else as it is. In a thread
    whose event loop is already running (a notebook) it runs on a loop of its own, in another thread."""
    if not inspect.iscoroutine(out):
        return out
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(out)
    return call_in_thread(lambda: asyncio.run(out), 0)


# --------------------------------------------------------------------------- the Rewarder


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


def describe_exception(e: BaseException) -> str:
    """'raised ValueError: <the first line of its message, whole>', or 'called sys.exit(1)'."""
    if isinstance(e, SystemExit):
        return f"called sys.exit({e.code!r})"
    message = str(e).strip()
    return f"raised {type(e).__name__}" + (f": {message.splitlines()[0]}" if message else "")


class Rewarder:
    """Scores completions with every term, applies the failure policy, sums with weights.

    errors_log: the file that gets each distinct exception's traceback (None: none is kept);
    max_failed_steps: reward.max_failed_steps, read by `FailureStreaks` (0: never stop)."""

    def __init__(self, terms: list[RewardTerm], on_error: str = "raise", timeout_s: float = 30.0,
                 errors_log: Path | None = None, max_failed_steps: int = 0):
        if not terms:
            raise ValueError("no reward function configured (all weights are 0)")
        names = [term.name for term in terms]
        twice = sorted({name for name in names if names.count(name) > 1})
        if twice:
            raise ValueError(f"reward function name {twice[0]!r} is given twice (metrics are named reward/<name>)")
        self.terms = terms
        self.on_error = on_error
        self.timeout_s = timeout_s
        self.errors_log = errors_log
        self.logged: set[str] = set()
        self.streaks = FailureStreaks(max_failed_steps, on_error)

    def run_term(self, term: RewardTerm, prompts, completions, columns) -> tuple[list, list[str | None]]:
        """Values of one term (NaN where it returned None) and, per sample, a fault or None."""
        n = len(completions)
        given = {"prompts": prompts, "completions": completions, **columns}
        if term.keywords is not None:
            given = {k: v for k, v in given.items() if k in term.keywords}
        try:
            out = call_reward(term.fn, self.timeout_s, given)
        except RewardTimeout:
            return [0.0] * n, [f"timed out after {self.timeout_s:g}s (reward.timeout_s)"] * n
        except (Exception, SystemExit) as e:  # noqa: BLE001 - any user failure, sys.exit too, is a reward fault
            return [0.0] * n, [self.log_exception(term, e)] * n
        raw = _as_list(out)
        if raw is None:
            return [0.0] * n, [f"returned {type(out).__name__}, not a list of {n} values"] * n
        if len(raw) != n:
            return [0.0] * n, [f"returned {len(raw)} values for {n} samples"] * n
        faults = [_bad_value(v) for v in raw]
        values = [0.0 if f else math.nan if v is None else float(v) for v, f in zip(raw, faults)]
        return values, faults

    def log_exception(self, term: RewardTerm, e: BaseException) -> str:
        """The fault's one line; its traceback appended to the errors log the first time it is seen."""
        text = describe_exception(e)
        if self.errors_log is None:
            return text
        key = f"{term.source or term.name} {text}"
        if key not in self.logged:
            self.logged.add(key)
            trace = "".join(traceback.format_exception(type(e), e, e.__traceback__))
            self.errors_log.parent.mkdir(parents=True, exist_ok=True)  # a run folder made on first use
            with open(self.errors_log, "a", encoding="utf-8") as log:
                log.write(f"reward function '{term.source or term.name}' {text}\n{trace}\n")
        return f"{text} (traceback in {self.errors_log})"

    def __call__(self, prompts: list, completions: list, columns: dict,
                 formatted_prompts: list | None = None) -> Scores:
        """Score with every term; `formatted_prompts` (the chat-formatted text) go to the terms that
        read prompts the way the policy saw them (learned reward models), `prompts` to the others."""
        n = len(completions)
        total = torch.zeros(n)
        valid = torch.ones(n, dtype=torch.bool)
        scored = torch.zeros(n, dtype=torch.bool)
        parts, failed, errors = {}, {}, 0
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
            if n and all(faults):
                failed[term.name] = faults[-1]
            parts[term.name] = torch.tensor(values)
            scored |= ~parts[term.name].isnan()
            total += term.weight * parts[term.name].nan_to_num(0.0)
        return Scores(total=total, parts=parts, valid=valid, errors=errors, unscored=int((~scored).sum()),
                      failed=failed)

    def source_of(self, name: str) -> str:
        return next((t.source or t.name for t in self.terms if t.name == name), name)


# --------------------------------------------------------------------------- runs that fail on every step


class FailureStreaks:
    """Training steps in a row on which a reward function faulted on every sample, every sample was
    dropped, or no function scored any sample; at `limit` of them (reward.max_failed_steps, 0 = never)
    the run stops with one line. A step counts once, however many batches it scored; a step with one
    good batch does not count."""

    def __init__(self, limit: int, on_error: str):
        self.limit, self.on_error = limit, on_error
        self.count: dict[str, int] = {}
        self.last_failed: dict[str, int] = {}
        self.last_fine: dict[str, int] = {}

    def record(self, scores: Scores, step: int, rewarder: Rewarder) -> None:
        """Count this batch of step `step`; RewardError once something failed `limit` steps in a row."""
        n = len(scores.total)
        events = {f"function {name}": fault for name, fault in scores.failed.items()}
        if n and not bool(scores.valid.any()):
            events["dropped"] = ""
        if n and scores.unscored == n:
            events["unscored"] = ""
        for key in [*(f"function {t.name}" for t in rewarder.terms), "dropped", "unscored"]:
            if key not in events:
                self.count[key], self.last_fine[key] = 0, step
            elif step not in (self.last_failed.get(key), self.last_fine.get(key)):
                self.count[key], self.last_failed[key] = self.count.get(key, 0) + 1, step
        over = [key for key in events if self.limit and self.count.get(key, 0) >= self.limit]
        if over:
            raise RewardError(self.message(over[0], events[over[0]], rewarder))

    def message(self, key: str, fault: str, rewarder: Rewarder) -> str:
        k, then = self.limit, "or set reward.max_failed_steps higher (0 = never stop)"
        if key == "dropped":
            return (f"every sample was dropped by reward faults for {k} steps in a row (reward.on_error=drop; "
                    f"reward/errors in metrics.jsonl): fix the reward functions, {then}")
        if key == "unscored":
            return (f"no reward function scored any sample for {k} steps in a row (each returned None): "
                    f"nothing to learn from; check when the functions return None, {then}")
        source = rewarder.source_of(key.removeprefix("function "))
        return (f"reward function '{source}' failed on every sample for {k} steps in a row "
                f"(reward.on_error={self.on_error}; last: {fault}): fix it, {then}")
