"""A multi-turn verifiers game for the tests: guess a number from 1 to 9 in three tries; after each wrong guess the
environment (the run's user) answers 'higher' or 'lower'. An `Env` of its own drives the turns through the
agent's interaction, as verifiers' TextArena games do; the reward is 1 for a found number, else 0.2 per guess
that held a digit."""

from __future__ import annotations

import re

import verifiers.v1 as vf
from covey_vf_chat import ChatHarness

TRIES = 3


class GuessData(vf.TaskData):
    secret: int


class GuessTask(vf.Task[GuessData, vf.State, vf.TaskConfig]):
    pass


class GuessEnvConfig(vf.EnvConfig):
    player: vf.AgentConfig = vf.AgentConfig()


class GuessEnv(vf.Env[GuessEnvConfig]):
    async def run(self, task, agents):
        secret, score = task.data.secret, 0.0
        async with agents.player.interaction(task) as interaction:
            segment = await interaction.turn()
            for attempt in range(TRIES):
                if segment.terminated:
                    break
                guess = re.search(r"\d", segment.last_reply)
                if guess and int(guess.group(0)) == secret:
                    score = 1.0
                    break
                score += 0.2 if guess else 0.0
                if attempt + 1 == TRIES:
                    break
                hint = "higher" if guess is None or int(guess.group(0)) < secret else "lower"
                segment = await interaction.turn(f"No: {hint}. Guess again.")
        interaction.trace.record_reward("found", score, 1.0)
        interaction.trace.record_metric("turns", float(attempt + 1))


class GuessTaskset(vf.Taskset[GuessTask, vf.TasksetConfig]):
    def load(self):
        for secret in range(1, 7):
            yield GuessTask(GuessData(prompt="Guess my number from 1 to 9. Answer with one digit.", secret=secret),
                            self.config.task)


__all__ = ["GuessEnv", "GuessTaskset", "ChatHarness"]
