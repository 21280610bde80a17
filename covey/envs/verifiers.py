"""verifiers environments (`task.source=verifiers:<taskset id>`; pip install 'covey[verifiers]', verifiers 0.4's
`verifiers.v1` API; docs/environments.md).

The target names a verifiers taskset the way verifiers does (an installed taskset package, a module on the
path, or a `.py` file whose folder covey puts on the path), optionally followed by a JSON object merged into
the environment's config (`verifiers:textarena {"taskset": {"game": "Wordle-v0"}}`). covey loads the
environment verifiers pairs with it (`vf.load_environment`: the taskset's own Env, else the single-agent
one; its own Harness, else verifiers' default) with every agent seat on the local subprocess runtime.

- The data: the taskset's tasks (`verifiers_data`), task.train_size + task.eval_size of them (an infinite
  taskset is read that far), the last task.eval_size held out. Each becomes a row whose prompt is the
  task's and whose answer is None: the environment's rewards judge it (the run settles on eval.metric=reward).
- The rollouts (`VerifiersEngine.play`): G episodes per row through `env.run_episode(task, ctx)` inside
  `env.serving()`, `task.harness.concurrency` at once, each under `task.harness.timeout_s`; the context's
  client is verifiers' eval client pointed at the batch's policy server (covey/envs/served.py), and its
  sampling args carry the episode id as `user`, which the relayed requests keep: the server records the
  episode's calls and covey turns them into one row (covey/envs/rows.py).
- The reward: the episode's weighted reward (its traces' `reward`, their mean for a multi-agent episode) is
  the reward term `environment`; each named reward's score and each metric is logged (`verifiers/reward/
  <name>`, `verifiers/metric/<name>`). A failed episode (`episode.ok` false) or a timed-out one scores 0.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path

from covey.config import ConfigError
from covey.envs.served import MODEL_NAME, Outcome, PlayOptions, ServedEpisodes
from covey.rollout.agents import EpisodePrompt
from covey.tasks.base import Example
from covey.tasks.data import TaskData

TOKEN_VARIABLE = "COVEY_VERIFIERS_TOKEN"
"""The variable verifiers' client reads the batch server's bearer token from (set for the batch)."""


class VerifiersError(ConfigError):
    """A verifiers environment covey cannot load (one line, before the model loads)."""


def import_verifiers():
    """`verifiers.v1`, or one line naming the extra."""
    try:
        import verifiers.v1 as vf
    except ImportError as e:
        raise VerifiersError(f"task.source=verifiers: needs the optional package verifiers (0.4): pip install "
                             f"'covey[verifiers]' ({e})") from None
    return vf


@dataclass(frozen=True)
class VerifiersOptions(PlayOptions):
    """task.source=verifiers:<target> and task.harness.*."""
    target: str = ""
    """The taskset id (or .py file), then optionally a JSON object merged into the environment's config."""

    def engine_type(self) -> type:
        return VerifiersEngine


def verifiers_options(target: str, concurrency: int, timeout_s: float, max_new_tokens: int, temperature: float,
                      top_p: float) -> VerifiersOptions:
    """The options of task.source=verifiers:<target>, checked before the model loads (the target is read)."""
    if concurrency < 1 or not timeout_s > 0:
        raise VerifiersError(f"task.harness.concurrency={concurrency} must be >= 1 and task.harness.timeout_s="
                             f"{timeout_s:g} > 0")
    env_config(target)
    return VerifiersOptions(concurrency=concurrency, timeout_s=timeout_s, max_new_tokens=max_new_tokens,
                            temperature=temperature, top_p=top_p, target=target)


def env_config(target: str) -> dict:
    """The raw environment config of a target: {"taskset": {"id": ...}} and the JSON after the id; a `.py`
    file's folder goes on sys.path (its stem is the id)."""
    taskset, _, rest = target.strip().partition(" ")
    extra = {}
    if rest.strip():
        try:
            extra = json.loads(rest)
        except json.JSONDecodeError as e:
            raise VerifiersError(f"task.source=verifiers:{target}: after the taskset id, a JSON object: {e}") from None
        if not isinstance(extra, dict):
            raise VerifiersError(f"task.source=verifiers:{target}: after the taskset id, a JSON object")
    if taskset.endswith(".py"):
        path = Path(taskset).resolve()
        if not path.is_file():
            raise VerifiersError(f"task.source=verifiers:{target}: no file {taskset}")
        if str(path.parent) not in sys.path:
            sys.path.insert(0, str(path.parent))
        taskset = path.stem
    given = extra.get("taskset") if isinstance(extra.get("taskset"), dict) else {}
    return {**extra, "taskset": {**given, "id": taskset}}


def load_env(target: str):
    """The verifiers environment of `target`, every agent seat on the local subprocess runtime (verifiers'
    default, Prime's remote sandboxes, needs their service)."""
    vf = import_verifiers()
    from verifiers.v1.configs.agent import agent_config_fields
    raw = env_config(target)
    try:
        roles = agent_config_fields(vf.resolve_env_config(raw))
        for name in roles:
            seat = raw.get(name) if isinstance(raw.get(name), dict) else {}
            raw[name] = {"runtime": {"type": "subprocess"}, **seat}
        return vf.load_environment(vf.resolve_env_config(raw))
    except Exception as e:  # noqa: BLE001 - a plugin that does not import or validate: one line naming it
        raise VerifiersError(f"task.source=verifiers:{target}: {type(e).__name__}: {str(e).splitlines()[0]}") from e


def tasks_of(env, count: int) -> list:
    """The environment taskset's first `count` tasks (in `load()` order)."""
    return list(itertools.islice(iter(env.taskset), count))


def example_of(task) -> Example:
    """A task as a covey row: its prompt (text, or chat messages), no reference answer (the environment's
    rewards judge), its own fields as columns, its index (`verifiers_idx`)."""
    data, base = task.data, set(import_verifiers().TaskData.model_fields)
    extra = {k: v for k, v in data.model_dump(mode="json", exclude_none=True).items()
             if k not in base and isinstance(v, (str, int, float, bool))}  # the task's own scalar fields
    prompt = data.prompt
    messages = None if isinstance(prompt, str) or prompt is None else tuple(
        m.model_dump(mode="json", exclude_none=True) for m in prompt)
    if data.system_prompt:
        messages = ({"role": "system", "content": data.system_prompt},
                    *(messages or ({"role": "user", "content": prompt or ""},)))
    text = data.prompt_text if messages is None else "\n".join(f"{m['role']}: {m.get('content', '')}" for m in messages)
    return Example(prompt=text, answer=None, meta={**extra, "verifiers_idx": data.idx}, messages=messages,
                   source=f"verifiers task {data.idx}")


def verifiers_data(source: str, train_size: int, eval_size: int) -> TaskData | None:
    """task.source=verifiers:<target>: the taskset's rows (module docstring); None for another source."""
    kind, _, target = source.partition(":")
    if kind.strip() != "verifiers":
        return None
    env = load_env(target.strip())
    examples = [example_of(t) for t in tasks_of(env, train_size + eval_size)]
    if not examples:
        raise VerifiersError(f"task.source={source}: the taskset yields no task")
    held = min(eval_size, len(examples) // 2)
    data = TaskData(examples[:len(examples) - held], examples[len(examples) - held:])
    data.notes.append(f"task.source={source}: {len(examples)} tasks of the verifiers taskset, the last {held} held "
                      "out; their rewards are the environment's (reward term `environment`)")
    return data


def outcome_of(episode_id: str, episode) -> Outcome:
    """An episode's end: its reward (its traces' mean weighted reward), each named reward and metric."""
    traces = list(episode.traces)
    if not episode.ok or not traces:
        error = episode.last_error or next((e for t in traces for e in t.errors), None)
        detail = f"{error.type}: {error.message.splitlines()[0] if error.message else ''}" if error else "no trace"
        return Outcome(episode_id, "failed", None, detail[:300])
    parts = {}
    for trace in traces:
        parts.update({f"reward/{k}": r.score for k, r in trace.rewards.items() if r is not None})
        parts.update({f"metric/{k}": float(v) for k, v in trace.metrics.items() if isinstance(v, (int, float))})
    return Outcome(episode_id, "ok", sum(t.reward for t in traces) / len(traces), parts=parts)


class VerifiersEngine(ServedEpisodes):
    """An engine whose `generate` runs a verifiers environment's episodes against a policy server on the
    wrapped engine (module docstring; covey/envs/served.py)."""

    kind = "verifiers"

    def __init__(self, inner, options: VerifiersOptions, context_length: int):
        super().__init__(inner, options, context_length)
        self.env = load_env(options.target)
        self.tasks: dict[int, object] = {}

    def task_of(self, prompt: EpisodePrompt):
        """The environment's task of a row (by its `verifiers_idx`)."""
        idx = prompt.example.meta["verifiers_idx"]
        if idx not in self.tasks:
            self.tasks.update({t.data.idx: t for t in tasks_of(self.env, idx + 1)})
        return self.tasks[idx]

    def play(self, episodes: list[str], rows: list[EpisodePrompt], url: str, token: str) -> list[Outcome]:
        os.environ[TOKEN_VARIABLE] = token  # verifiers' client reads its key from a variable
        return asyncio.run(self.play_all(episodes, [self.task_of(r) for r in rows], url))

    async def play_all(self, episodes: list[str], tasks: list, url: str) -> list[Outcome]:
        vf = import_verifiers()
        client = vf.EvalClientConfig(base_url=url, api_key_var=TOKEN_VARIABLE)
        gate = asyncio.Semaphore(self.options.concurrency)
        limit = self.options.timeout_s

        async def one(episode: str, task) -> Outcome:
            ctx = vf.ModelContext(model=MODEL_NAME, client=client, sampling=vf.Sampling(user=episode))
            async with gate:
                try:
                    return outcome_of(episode, await asyncio.wait_for(self.env.run_episode(task, ctx), limit))
                except TimeoutError:
                    return Outcome(episode, "timeout", None, f"no end within task.harness.timeout_s={limit:g}")

        async with self.env.serving():
            return list(await asyncio.gather(*(one(e, t) for e, t in zip(episodes, tasks))))
