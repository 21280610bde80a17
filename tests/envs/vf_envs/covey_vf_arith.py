"""A single-turn verifiers taskset for the tests: 'What is a + b?', scored by a reward (the answer in the reply)
and a metric (the reply's length), played by the in-process chat harness."""

from __future__ import annotations

import verifiers.v1 as vf
from covey_vf_chat import ChatHarness


class ArithData(vf.TaskData):
    answer: str


class ArithTask(vf.Task[ArithData, vf.State, vf.TaskConfig]):
    @vf.reward(weight=1.0)
    async def correct(self, trace) -> float:
        return 1.0 if self.data.answer in trace.last_reply else 0.0

    @vf.reward(weight=0.5)
    async def has_digit(self, trace) -> float:
        return 1.0 if any(c.isdigit() for c in trace.last_reply) else 0.0

    @vf.metric
    async def reply_chars(self, trace) -> float:
        return float(len(trace.last_reply))


class ArithTaskset(vf.Taskset[ArithTask, vf.TasksetConfig]):
    def load(self):
        for a in range(8):
            yield ArithTask(ArithData(prompt=f"What is {a} + 3?", answer=str(a + 3)), self.config.task)


__all__ = ["ArithTaskset", "ChatHarness"]
