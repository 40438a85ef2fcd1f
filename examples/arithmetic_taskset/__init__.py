"""A verifiers.v1 taskset defined in code (plugin id `arithmetic_taskset`): tandem's arithmetic questions, a calculator
tool served over MCP (tools.py, one server shared by every rollout), and a reward that needs no network.

Each task is "What is 37 + 48?" (held out of the tiny model's pretraining); the agent may call `calculator`, then
answers. Two rewards, summed by weight: `correct`, the first number of its last reply against the answer (weight 1),
and `called_calculator` (weight 0.5), showing its work with the tool.
"""

import re
from collections.abc import Iterator

import verifiers.v1 as vf

from arithmetic_taskset.tools import CalculatorToolset
from tandem.tasks import arithmetic


class ArithmeticData(vf.TaskData):
    answer: str


class ArithmeticTask(vf.Task[ArithmeticData, vf.State, vf.TaskConfig]):
    @vf.reward(weight=1.0)
    async def correct(self, trace: vf.Trace) -> float:
        found = re.search(r"-?\d+", trace.last_reply)
        return float(found is not None and found.group() == self.data.answer)

    @vf.reward(weight=0.5)
    async def called_calculator(self, trace: vf.Trace) -> float:
        return float(bool(trace.tool_messages))


class ArithmeticTaskset(vf.Taskset[ArithmeticTask, vf.TasksetConfig]):
    @classmethod
    def toolsets(cls, config: vf.TasksetConfig) -> list[vf.Toolset]:
        return [CalculatorToolset(vf.ToolsetConfig())]  # shared: one server for the whole run

    def load(self) -> Iterator[ArithmeticTask]:
        for index, row in enumerate(arithmetic.make_rows(128, split="test", seed=3)):  # held out of pretraining
            data = ArithmeticData(idx=index, prompt=row["prompt"][0]["content"], answer=row["solution"])
            yield ArithmeticTask(data, self.config.task)


__all__ = ["ArithmeticTaskset"]
