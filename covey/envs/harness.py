"""Agent harnesses: an outside program plays each episode against covey's policy server (`task.source=harness:
<command>`, docs/environments.md).

For each prompt row and each of its G samples covey starts the command (split as a shell splits it, run
without a shell) with, in its environment:

    OPENAI_BASE_URL   the policy server of this batch, ending in /v1 (127.0.0.1 only)
    OPENAI_API_KEY    the server's bearer token (a fresh random one per batch)
    COVEY_EPISODE_ID  the episode: send it as `user` (or the X-Episode-Id header) with every request
    COVEY_TASK        the row as JSON: its columns, `prompt`, `answer` and `messages` (the chat messages covey
                      would send, system prompt included); the same JSON is written on the command's stdin
    COVEY_MODEL       the model id the server answers to

`HarnessEngine` is an engine that serves each batch from a PolicyServer on the run's engine (covey/envs/
served.py: seeds, rows, outcomes); it runs `task.harness.concurrency` commands at once, each under
`task.harness.timeout_s`.

The reward: the last non-empty line the command prints on stdout, when it is a JSON object with a number
`reward` ({"reward": 0.75}), is the episode's reward term `environment` (weight 1; covey's other reward
terms add to it: set reward.correctness=0 to score by the harness alone); without one the episode is
scored by covey's reward terms over its messages. Outcomes, counted per batch (`harness/*`), never a crash:
a command that exits non-zero or runs past the timeout (killed, with its process group) scores 0; an
episode whose calls make no row (no call, a chain that breaks) is dropped from its group. Each one prints a
warning naming the episode and the last line of the command's stderr.
"""

from __future__ import annotations

import json
import math
import os
import shlex
import shutil
import signal
import subprocess
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Sequence

from covey.config import ConfigError
from covey.envs.served import MODEL_NAME, Outcome, PlayOptions, ServedEpisodes
from covey.rollout.agents import EpisodePrompt
from covey.tasks.base import Example, build_messages
from covey.tasks.data import format_prompts


class HarnessError(ConfigError):
    """A harness setting covey cannot run (one line naming the key, before the model loads)."""


@dataclass(frozen=True)
class HarnessOptions(PlayOptions):
    """task.source=harness:<command> and task.harness.*."""
    command: tuple[str, ...] = ()
    """The command line, split as a shell splits it."""

    def engine_type(self) -> type:
        return HarnessEngine


def harness_command(target: str) -> tuple[str, ...]:
    """The command of task.source=harness:<command>, split; HarnessError when it is empty or its program is
    neither on PATH nor a file."""
    try:
        argv = tuple(shlex.split(target))
    except ValueError as e:
        raise HarnessError(f"task.source=harness:{target}: {e}") from None
    if not argv:
        raise HarnessError("task.source=harness: names no command (harness:python agent.py, say)")
    if shutil.which(argv[0]) is None and not os.path.isfile(argv[0]):
        raise HarnessError(f"task.source=harness:{target}: no program {argv[0]!r} (not on PATH, not a file)")
    return argv


def harness_options(target: str, concurrency: int, timeout_s: float, max_new_tokens: int, temperature: float,
                    top_p: float) -> HarnessOptions:
    """The options of task.source=harness:<target> and task.harness.*, checked (HarnessError)."""
    if concurrency < 1 or not timeout_s > 0:
        raise HarnessError(f"task.harness.concurrency={concurrency} must be >= 1 and task.harness.timeout_s="
                           f"{timeout_s:g} > 0")
    return HarnessOptions(concurrency=concurrency, timeout_s=timeout_s, max_new_tokens=max_new_tokens,
                          temperature=temperature, top_p=top_p, command=harness_command(target))


def harness_prompts(tokenizer, examples: list[Example], system_prompt: str = "") -> list[EpisodePrompt]:
    """The rows' chat prompts as covey formats them, each carrying its messages and its example (the row a
    harness is given)."""
    texts = format_prompts(tokenizer, examples, system_prompt)
    return [EpisodePrompt(text, build_messages(ex, system_prompt or None), ex) for text, ex in zip(texts, examples)]


def task_json(prompt: EpisodePrompt) -> str:
    """COVEY_TASK: the row's columns, then covey's `prompt`, `answer` and `messages`."""
    ex = prompt.example
    return json.dumps({**ex.meta, "prompt": ex.given_prompt, "answer": ex.answer, "messages": prompt.messages},
                      ensure_ascii=False, default=str)


def reward_line(stdout: str) -> float | None:
    """The reward of the last non-empty stdout line {"reward": <number>}; None without one."""
    lines = [line for line in stdout.splitlines() if line.strip()]
    try:
        last = json.loads(lines[-1]) if lines else None
    except json.JSONDecodeError:
        return None
    value = last.get("reward") if isinstance(last, dict) else None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return None
    return float(value)


def last_line(text: str) -> str:
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[-1][:300] if lines else "(nothing on stderr)"


def run_harness(argv: Sequence[str], env: dict, task: str, timeout_s: float) -> tuple[str, float | None, str]:
    """(status, reward, the last line of stderr) of one run of the command; a run past `timeout_s` is killed
    with its process group."""
    try:
        proc = subprocess.Popen(list(argv), stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                env=env, text=True, start_new_session=True)
    except OSError as e:
        return "failed", None, f"cannot start: {e}"
    try:
        out, err = proc.communicate(task, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        out, err = proc.communicate()
        return "timeout", None, last_line(err)
    if proc.returncode != 0:
        return "failed", None, f"exit code {proc.returncode}: {last_line(err)}"
    return "ok", reward_line(out), last_line(err)


class HarnessEngine(ServedEpisodes):
    """An engine whose `generate` runs the harness command once per episode against a policy server on the
    wrapped engine (module docstring; covey/envs/served.py)."""

    kind = "harness"

    def play(self, episodes: list[str], rows: list[EpisodePrompt], url: str, token: str) -> list[Outcome]:
        """Each episode's command, `task.harness.concurrency` at once."""
        base = {**os.environ, "OPENAI_BASE_URL": url, "OPENAI_API_KEY": token, "COVEY_MODEL": MODEL_NAME}

        def one(k: int) -> Outcome:
            task = task_json(rows[k])
            env = {**base, "COVEY_EPISODE_ID": episodes[k], "COVEY_TASK": task}
            status, reward, stderr = run_harness(self.options.command, env, task, self.options.timeout_s)
            return Outcome(episodes[k], status, reward, stderr)

        with ThreadPoolExecutor(max_workers=max(1, min(self.options.concurrency, len(episodes))),
                                thread_name_prefix="covey-harness") as pool:
            return list(pool.map(one, range(len(episodes))))
