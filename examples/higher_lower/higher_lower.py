"""Higher or lower, a multi-turn game written with verifiers' own classes (verifiers 0.4, `verifiers.v1`). To train:

    covey train task.source=verifiers:examples/higher_lower/higher_lower.py task.train_size=512 task.eval_size=32 \
        rollout.prompts_per_step=4 rollout.group_size=8 rollout.max_new_tokens=8 rollout.eval_max_new_tokens=8 \
        task.harness.concurrency=32 algo.beta=0 train.steps=60 train.max_minutes=10

The environment (`HigherLowerEnv`, the run's user) picks a number from 1 to 9; the model has 4 replies, each wrong
guess answered "No, higher." or "No, lower." (the rules and the reward: higher_lower_game.py). Options go in the
JSON after the file: `verifiers:examples/higher_lower/higher_lower.py {"taskset": {"top": 20, "tries": 5}}`.

verifiers' own harnesses run programs provisioned from the network; `ChatHarness` here runs each segment as one
chat call in this process, through the rollout's interception endpoint, sending no max_tokens (the run's
rollout.max_turn_tokens, else rollout.max_new_tokens, bounds each reply).
"""

from __future__ import annotations

import itertools
import random

import verifiers.v1 as vf
from higher_lower_game import Game
from openai import AsyncOpenAI
from pydantic import Field


class HigherLowerConfig(vf.TasksetConfig):
    top: int = Field(default=9, ge=2)
    """Secrets are drawn from 1..top."""
    tries: int = Field(default=4, ge=1)
    """Replies the model has."""


class HigherLowerData(vf.TaskData):
    secret: int
    top: int
    tries: int


class HigherLowerTask(vf.Task[HigherLowerData, vf.State, vf.TaskConfig]):
    pass


class HigherLowerTaskset(vf.Taskset[HigherLowerTask, HigherLowerConfig]):
    INFINITE = True

    def load(self):
        top, tries = self.config.top, self.config.tries
        for i in itertools.count():  # task i's secret is drawn from its own seed: the same tasks on every load
            secret = random.Random(i).randint(1, top)
            yield HigherLowerTask(HigherLowerData(prompt=Game(secret, top, tries).prompt(), secret=secret, top=top,
                                                  tries=tries), self.config.task)


class HigherLowerEnvConfig(vf.EnvConfig):
    player: vf.AgentConfig = vf.AgentConfig()


class HigherLowerEnv(vf.Env[HigherLowerEnvConfig]):
    async def run(self, task, agents):
        game = Game(task.data.secret, task.data.top, task.data.tries)
        async with agents.player.interaction(task) as interaction:
            segment = await interaction.turn()
            while not segment.terminated:
                answer = game.step(segment.last_reply)
                if answer is None:
                    break
                segment = await interaction.turn(answer)
        interaction.trace.record_reward("game", game.reward())
        interaction.trace.record_metrics(game.metrics())


class ChatHarness(vf.Harness[vf.HarnessConfig]):
    APPENDS_SYSTEM_PROMPT = True
    SUPPORTS_RESUME = True  # verifiers relaunches it on the conversation so far for each later turn
    EXECUTES_CODE = False
    NEEDS_CONTAINER = False

    async def launch(self, ctx, trace, runtime, endpoint, secret, mcp_urls, data, **kwargs) -> vf.ProgramResult:
        system, prompt = self.resolve_prompt(data)
        messages = [{"role": "system", "content": system}] if system else []
        if isinstance(prompt, str):
            messages.append({"role": "user", "content": prompt})
        else:
            messages.extend(m.model_dump(mode="json", exclude_none=True) for m in prompt or [])
        async with AsyncOpenAI(base_url=endpoint, api_key=secret, max_retries=0) as client:  # closed on this loop
            await client.chat.completions.create(model=ctx.model, messages=messages)
        return vf.ProgramResult(exit_code=0, stdout="", stderr="")


__all__ = ["HigherLowerEnv", "HigherLowerTaskset", "ChatHarness"]
