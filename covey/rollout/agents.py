"""Episodes behind the engine interface: an engine whose `generate` runs whole tool-calling episodes.

`EpisodeEngine` wraps any engine (fast, hf, vllm) and answers `generate(prompts, G, ...)` with
episodes (covey/rollout/episodes.py): the first turn is the inner engine's sample of the prompts
(with their seeds), every later turn a continuation from the episode's token ids (with seeds, each
episode's from its own seed and the turn: `row_seed`, `turn_seed`). So training,
held-out evaluation and pass@k run episodes through the code that runs single answers, and the
wrapped engine's weights, seeding and out-of-memory policy stay as they are.

`ToolHost` is the tools side of one episode: it reads a turn's tool calls in the model's format,
runs them (concurrently, each under the tool timeout, failures answered as {"error": ...}) and
renders the replies with the chat template into the ids appended after the model's turn.
"""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path
from typing import Callable, Sequence

import torch

from covey.batch import Rollout
from covey.rewards.combine import describe_exception, run_to_end
from covey.rollout.base import Engine, EngineWrapper, Prompt
from covey.rollout.environments import Environments, construct, episode_row
from covey.rollout.episodes import EpisodeOptions, row_seed, run_episodes
from covey.rollout.tools import (
    Toolbox,
    ToolError,
    ToolStats,
    add_tool_system_prompt,
    append_to_last_user,
    chat_template_supports_tools,
    find_tool_calls,
    run_tool_calls,
    start_episode,
    tool_call_format,
    tool_messages_ids,
)
from covey.tasks.base import Example, build_messages
from covey.tasks.tools import CALCULATOR_DEMO

BUILTIN_DEMOS = {"calculator": CALCULATOR_DEMO}
"""Their worked exchanges (rollout.tool_demo=builtin)."""

METRIC_KEYS = ("episode/turns_mean", "episode/tool_calls_mean", "episode/env_token_frac", "episode/cut_off_frac")


class EpisodePrompt(str):
    """A chat-formatted prompt that carries its messages and its example: the text is what the engines
    read; the messages and the row (an environment's reset(**row)) are what the episode's tools side
    needs. Identical texts of different rows stay apart."""

    messages: list[dict]
    example: Example

    def __new__(cls, text: str, messages: list[dict], example: Example):
        prompt = super().__new__(cls, text)
        prompt.messages, prompt.example = messages, example
        return prompt


class ToolHost:
    """The tools side of one episode: its messages so far (for the chat template), its tools (the run's,
    or its own environment's), the schemas its chat template shows, the format."""

    def __init__(self, agent: "Agent", messages: list[dict], toolbox: Toolbox | None = None,
                 template_tools: list[dict] | None = None):
        self.agent, self.history = agent, list(messages)
        self.toolbox = toolbox or agent.toolbox
        self.template_tools = template_tools

    def calls_in(self, text: str) -> list:
        self.history.append({"role": "assistant", "content": text})
        return find_tool_calls(text, self.agent.format)

    def reply(self, calls: list) -> list[dict]:
        return run_tool_calls(self.toolbox, calls, self.agent.timeout_s, stats=self.agent.toolbox.stats)

    def append_ids(self, messages: list[dict]) -> list[int]:
        self.history += messages
        return tool_messages_ids(self.agent.tokenizer, self.history, self.template_tools)

    def turn_reward(self) -> float | None:
        """The environment's `turn_reward()` for the model turn just ended (covey's addition to TRL's
        environments); None without one (the turn is then scored by the default rule)."""
        environment = self.toolbox.environment
        method = getattr(environment, "turn_reward", None)
        if method is None:
            return None
        try:
            value = run_to_end(method())
        except Exception as e:  # noqa: BLE001 - one line naming the environment
            raise ToolError(f"environment {type(environment).__name__}: turn_reward() {describe_exception(e)}") from e
        return None if value is None else float(value)


class Agent:
    """What a run's episodes share: the tools (one Toolbox, whose counters are the run's), the environments
    (covey/rollout/environments.py), the model's tool-call format, and each prompt's messages. A chat template
    that renders `tools=` shows the tools itself; one that does not (SmolLM2-135M-Instruct's) gets a system
    prompt teaching the <tool_call>{json}</tool_call> format (covey/rollout/tools.py, tool_system_prompt).
    With named environments (a dict environment_factory) each example's prompt shows its own environment's
    tools, as TRL's does."""

    def __init__(self, tokenizer, tools: list[Callable], timeout_s: float, environments: Environments | None = None,
                 demo: list[dict] | None = None):
        self.tokenizer, self.timeout_s, self.tools = tokenizer, timeout_s, list(tools)
        self.environments, self.demo = environments, list(demo or ())
        self.toolbox = Toolbox(tools)  # the run's call counters, and the tools of an episode without environment
        # each environment's schemas (its methods first, then the tools), read off its probe instance
        self.schemas = {None: self.toolbox.schemas}
        if environments is not None:
            probes = {name: environments.probes.get(name) or construct(factory)
                      for name, factory in environments.factories.items()}
            self.schemas = {name: Toolbox(tools, environment=probe).schemas for name, probe in probes.items()}
        self.format = tool_call_format(tokenizer)
        self.template_shows_tools = chat_template_supports_tools(tokenizer)
        self.seen = ToolStats()

    def schemas_of(self, example: Example) -> list[dict]:
        return self.schemas[self.environments.name_of(example) if self.environments is not None else None]

    def template_tools(self, example: Example) -> list[dict] | None:
        """The schemas the chat template renders for the example's episode (None: a system prompt shows them)."""
        return self.schemas_of(example) if self.template_shows_tools else None

    def prompts(self, examples: list[Example], system_prompt: str = "") -> list[EpisodePrompt]:
        """The examples' chat prompts with the tools shown, each carrying its messages and example."""
        out = []
        for ex in examples:
            messages = build_messages(ex, system_prompt or None)
            if not self.template_shows_tools:
                messages = add_tool_system_prompt(messages, self.schemas_of(ex))
            if self.demo:  # the worked exchange between the system message and the question
                at = 1 if messages and messages[0].get("role") == "system" else 0
                messages = messages[:at] + self.demo + messages[at:]
            out.append(EpisodePrompt(self.render(messages, self.template_tools(ex)), messages, ex))
        return out

    def render(self, messages: list[dict], template_tools: list[dict] | None) -> str:
        return self.tokenizer.apply_chat_template(messages, tools=template_tools, tokenize=False,
                                                  add_generation_prompt=True)

    def episodes(self, prompts: list[Prompt], group_size: int) -> tuple[list[str] | None, list[ToolHost]]:
        """The tools side of each of the prompts' episodes (group_size each, in rollout order), and with an
        environment each episode's own prompt: its instance's reset(**row) text appended to the last user
        message (None when no reset wrote any: the group then shares its prompt)."""
        if self.environments is None:
            return None, [ToolHost(self, p.messages, template_tools=self.template_tools(p.example))
                          for p in prompts for _ in range(group_size)]
        hosts, own, changed = [], [], False
        for p in prompts:
            row = episode_row(p.example)
            factory = self.environments.factories[self.environments.name_of(p.example)]
            shown = self.template_tools(p.example)
            for _ in range(group_size):
                toolbox, text = start_episode(factory, row, self.tools)
                messages = append_to_last_user(p.messages, text)
                hosts.append(ToolHost(self, messages, toolbox, shown))
                own.append(self.render(messages, shown) if text else p)
                changed = changed or bool(text)
        return (own if changed else None), hosts

    def metrics(self) -> dict:
        """Tool calls since the last call: tools/calls, tools/errors, tools/timeouts, tools/truncated."""
        now = self.toolbox.stats.as_dict()
        before, self.seen = self.seen.as_dict(), ToolStats(**now)
        return {f"tools/{k}": now[k] - before[k] for k in now}


def load_demo(spec: str, tool_names: list[str]) -> list[dict]:
    """rollout.tool_demo: "" (none), builtin (the worked exchanges of the built-in tools named in
    rollout.tools) or a .json file holding a list of chat messages."""
    if not spec:
        return []
    if spec == "builtin":
        demos = [m for name in tool_names if name in BUILTIN_DEMOS for m in BUILTIN_DEMOS[name]]
        if not demos:
            raise ToolError(f"rollout.tool_demo=builtin: none of rollout.tools ({', '.join(tool_names) or 'none'}) "
                            f"has a worked exchange; built in: {', '.join(BUILTIN_DEMOS)}")
        return demos
    try:
        messages = json.loads(Path(spec).read_text())
    except (OSError, ValueError) as e:
        raise ToolError(f"rollout.tool_demo={spec}: {type(e).__name__}: {e}") from None
    roles = {"system", "user", "assistant", "tool"}
    if not isinstance(messages, list) or not all(isinstance(m, dict) and m.get("role") in roles
                                                 and isinstance(m.get("content"), str) for m in messages):
        raise ToolError(f"rollout.tool_demo={spec}: expected a JSON list of messages, each with a role "
                        f"({', '.join(sorted(roles))}) and a text content")
    return messages


def environment_rewards(hosts: list[ToolHost]) -> torch.Tensor | None:
    """(N,) each finished episode's environment get_reward() (NaN where it has none); None without any."""
    rewards = []
    for host in hosts:
        try:
            value = host.toolbox.reward()
        except Exception as e:  # noqa: BLE001 - one line naming the environment
            name = type(host.toolbox.environment).__name__
            raise ToolError(f"environment {name}: get_reward() raised {type(e).__name__}: {e}") from e
        rewards.append(float("nan") if value is None else value)
    return None if all(math.isnan(r) for r in rewards) else torch.tensor(rewards)


class EpisodeEngine(EngineWrapper):
    """An engine that samples whole episodes; `episodes(prompts, G)` gives the tools side of each episode
    (and, with an environment, each episode's own prompt: Agent.episodes)."""

    def __init__(self, engine: Engine, episodes: Callable[[list[Prompt], int], tuple[list | None, list]],
                 options: EpisodeOptions, tool_metrics: Callable[[], dict] | None = None):
        super().__init__(engine)
        self.episodes, self.options = episodes, options
        self.tool_metrics = tool_metrics or dict
        self.pending: list[dict] = []

    def generate(self, prompts: list[Prompt], group_size: int, *, greedy: bool = False,
                 max_new_tokens: int | None = None, seeds: list[int] | None = None,
                 budgets: Sequence[int] | None = None) -> Rollout:
        """len(prompts) x group_size episodes. `max_new_tokens` (held-out evaluation's budget) is the
        turn's budget, the episode's twice the turns' as by default; else the run's options. An episode's
        budgets are its options' (per-row `budgets` are refused)."""
        if budgets is not None:
            raise ValueError("episodes take their budgets from their options (max turns, turn and episode tokens)")
        turns = self.options.max_turns
        options = self.options if max_new_tokens is None else replace(
            self.options, max_turn_tokens=max_new_tokens, max_episode_tokens=2 * turns * max_new_tokens)
        # One seed per episode (rollout row order): its first turn's as a prompt of its own, and where its later
        # turns' come from (episodes.py, turn_seed), so they do not depend on the other episodes of the batch.
        rows = None if seeds is None else [row_seed(s, g) for s in seeds for g in range(group_size)]

        def episodes(batch: list[Prompt], g: int, hosts: list, first: list[int] | None) -> tuple[Rollout, dict]:
            if self.inner.continues_episodes:  # the fast engine: one loop, rows apart
                return self.inner.decode_episodes(batch, g, hosts, options, greedy=greedy, seeds=first)

            def sample(turn: list[Prompt], n: int, budget: int, seeds: list[int] | None = first) -> Rollout:
                # the first turn: `first`, one per prompt of `batch`; later turns: run_episodes' turn seeds
                seeded = {} if seeds is None else {"seeds": seeds}
                return self.inner.generate(turn, n, greedy=greedy, max_new_tokens=budget, **seeded)
            return run_episodes(sample, self.tokenizer, batch, g, hosts, options, seeds=rows)

        own, hosts = self.episodes(prompts, group_size)
        if own is None:
            rollout, metrics = episodes(prompts, group_size, hosts, seeds)
        else:  # each episode its own prompt (an environment's reset text): one row each, then grouped back
            rollout, metrics = episodes(own, 1, hosts, rows)
            index = torch.arange(len(prompts)).repeat_interleave(group_size)
            rollout.group_ids, rollout.example_index = index, index.tolist()
        rollout.environment_rewards = environment_rewards(hosts)
        if any(host.toolbox.environment is not None for host in hosts):  # a reward function's `environments=`
            rollout.environments = [host.toolbox.environment for host in hosts]
        self.pending.append({**metrics, "episodes": len(rollout), "tokens": float(rollout.response_attended.sum())})
        return rollout

    def take_metrics(self, total: Callable[[torch.Tensor], torch.Tensor] | None = None) -> dict:
        """The episode and tool metrics since the last call: `episode/*` over every batch's episodes
        (`env_token_frac` over their tokens), `tools/*` counted. `total` sums a vector over processes
        (under torchrun, every rank's: covey/training/global_batch.py); every rank must then call it."""
        batches, self.pending = self.pending, []
        tools = self.tool_metrics()
        weight = {k: "tokens" if k == "episode/env_token_frac" else "episodes" for k in METRIC_KEYS}
        sums = [sum(b[k] * b[weight[k]] for b in batches) for k in METRIC_KEYS]
        vector = torch.tensor([sum(b["episodes"] for b in batches), sum(b["tokens"] for b in batches), *sums,
                               *tools.values()], dtype=torch.float64)
        episodes, tokens, *rest = (total(vector) if total is not None else vector).tolist()
        out = {k: value / ({"episodes": episodes, "tokens": tokens}[weight[k]] or 1.0)
               for k, value in zip(METRIC_KEYS, rest)} if episodes else {}
        return {**out, **{k: int(v) for k, v in zip(tools, rest[len(METRIC_KEYS):])}}
