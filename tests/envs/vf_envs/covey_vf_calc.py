"""A tool-use verifiers taskset for the tests: the harness offers a calculator, runs it and sends its result back
as the tool's message; the reward reads the final reply."""

from __future__ import annotations

import verifiers.v1 as vf
from covey_vf_chat import CalculatorHarness


class CalcData(vf.TaskData):
    answer: str


class CalcTask(vf.Task[CalcData, vf.State, vf.TaskConfig]):
    @vf.reward
    async def correct(self, trace) -> float:
        return 1.0 if self.data.answer in trace.last_reply else 0.0


class CalcTaskset(vf.Taskset[CalcTask, vf.TasksetConfig]):
    def load(self):
        for a in range(6):
            yield CalcTask(CalcData(prompt=f"What is {12 + a} * 3?", answer=str((12 + a) * 3)), self.config.task)


__all__ = ["CalcTaskset", "CalculatorHarness"]
