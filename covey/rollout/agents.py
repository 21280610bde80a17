"""Episodes behind the engine interface: an engine whose `generate` runs whole tool-calling episodes.

`EpisodeEngine` wraps any engine (fast, hf, vllm) and answers `generate(prompts, G, ...)` with
episodes (covey/rollout/episodes.py): the first turn is the inner engine's sample of the prompts
(with their seeds), every later turn a continuation from the episode's token ids. So training,
held-out evaluation and pass@k run episodes through the code that runs single answers, and the
wrapped engine's weights, seeding and out-of-memory policy stay as they are.

`ToolHost` is the tools side of one episode: it reads a turn's tool calls in the model's format,
runs them (concurrently, each under the tool timeout, failures answered as {"error": ...}) and
renders the replies with the chat template into the ids appended after the model's turn.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Callable

from covey.batch import Rollout
from covey.rollout.base import Prompt
from covey.rollout.episodes import EpisodeHost, EpisodeOptions, run_episodes
from covey.rollout.tools import (Toolbox, ToolStats, add_tool_system_prompt, chat_template_supports_tools,
                                 find_tool_calls, run_tool_calls, tool_call_format, tool_messages_ids)
from covey.tasks.base import Example, build_messages
from covey.tasks.tools import calculator

BUILTIN_TOOLS = {"calculator": calculator}
"""Tools covey ships, by the name rollout.tools takes."""

METRIC_KEYS = ("episode/turns_mean", "episode/tool_calls_mean", "episode/env_token_frac", "episode/cut_off_frac")


class ToolHost:
    """The tools side of one episode: its messages so far (for the chat template), the tools, the format."""

    def __init__(self, agent: "Agent", messages: list[dict]):
        self.agent, self.history = agent, list(messages)

    def calls_in(self, text: str) -> list:
        self.history.append({"role": "assistant", "content": text})
        return find_tool_calls(text, self.agent.format)

    def reply(self, calls: list) -> list[dict]:
        return run_tool_calls(self.agent.toolbox, calls, self.agent.timeout_s)

    def append_ids(self, messages: list[dict]) -> list[int]:
        self.history += messages
        return tool_messages_ids(self.agent.tokenizer, self.history, self.agent.template_tools)


class Agent:
    """What a run's episodes share: the tools (one Toolbox, whose counters are the run's), the model's
    tool-call format, and each prompt's messages. A chat template that renders `tools=` shows the
    tools itself; one that does not (SmolLM2-135M-Instruct's) gets a system prompt teaching the
    <tool_call>{json}</tool_call> format (covey/rollout/tools.py, tool_system_prompt)."""

    def __init__(self, tokenizer, tools: list[Callable], timeout_s: float):
        self.tokenizer, self.timeout_s = tokenizer, timeout_s
        self.toolbox = Toolbox(tools)
        self.format = tool_call_format(tokenizer)
        self.template_tools = self.toolbox.schemas if chat_template_supports_tools(tokenizer) else None
        self.messages_of: dict[str, list[dict]] = {}
        self.seen = ToolStats()

    def prompts(self, examples: list[Example], system_prompt: str = "") -> list[str]:
        """The examples' chat prompts with the tools shown, remembered with their messages."""
        out = []
        for ex in examples:
            messages = build_messages(ex, system_prompt or None)
            if self.template_tools is None:
                messages = add_tool_system_prompt(messages, self.toolbox.schemas)
            text = self.tokenizer.apply_chat_template(messages, tools=self.template_tools, tokenize=False,
                                                      add_generation_prompt=True)
            self.messages_of[text] = messages
            out.append(text)
        return out

    def hosts(self, prompts: list[Prompt], group_size: int) -> list[EpisodeHost]:
        return [ToolHost(self, self.messages_of[p]) for p in prompts for _ in range(group_size)]

    def metrics(self) -> dict:
        """Tool calls since the last call: tools/calls, tools/errors, tools/timeouts, tools/truncated."""
        now = self.toolbox.stats.as_dict()
        before, self.seen = self.seen.as_dict(), ToolStats(**now)
        return {f"tools/{k}": now[k] - before[k] for k in now}


class EpisodeEngine:
    """An engine that samples whole episodes; `make_hosts(prompts, G)` gives the tools side of each."""

    def __init__(self, engine, tokenizer, make_hosts: Callable[[list[Prompt], int], list[EpisodeHost]],
                 options: EpisodeOptions, tool_metrics: Callable[[], dict] | None = None):
        self.engine, self.tokenizer, self.make_hosts, self.options = engine, tokenizer, make_hosts, options
        self.tool_metrics = tool_metrics or dict
        self.pending: list[dict] = []

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def generate(self, prompts: list[Prompt], group_size: int, *, greedy: bool = False,
                 max_new_tokens: int | None = None, seeds: list[int] | None = None) -> Rollout:
        """len(prompts) x group_size episodes. `max_new_tokens` (held-out evaluation's budget) is the
        turn's budget, the episode's twice the turns' as by default; else the run's options."""
        turns = self.options.max_turns
        options = self.options if max_new_tokens is None else replace(
            self.options, max_turn_tokens=max_new_tokens, max_episode_tokens=2 * turns * max_new_tokens)
        first_call = {"seeds": seeds} if seeds is not None else {}

        def sample(batch: list[Prompt], g: int, budget: int) -> Rollout:
            kwargs = first_call.copy()
            first_call.clear()  # later turns continue from the global stream (seeds start an episode)
            return self.engine.generate(batch, g, greedy=greedy, max_new_tokens=budget, **kwargs)

        rollout, metrics = run_episodes(sample, self.tokenizer, prompts, group_size,
                                        self.make_hosts(prompts, group_size), options)
        self.pending.append({**metrics, "episodes": len(rollout)})
        return rollout

    def take_metrics(self) -> dict:
        """The episode and tool metrics since the last call, episodes weighting each batch's means."""
        batches, self.pending = self.pending, []
        total = sum(b["episodes"] for b in batches)
        out = {k: sum(b[k] * b["episodes"] for b in batches) / total for k in METRIC_KEYS} if total else {}
        return {**out, **self.tool_metrics()}
