"""examples/arithmetic_taskset with a broken scorer: every third episode it scores, its reward is a word, not a number. (A verifiers
taskset is imported by its id as a top-level module: the tests put this folder on the import path.)"""

import itertools
import re
from collections.abc import Iterator

import verifiers.v1 as vf
from arithmetic_taskset import ArithmeticData
from arithmetic_taskset.tools import CalculatorToolset

from tandem.tasks import arithmetic

SCORED = itertools.count(1)


class FlakyTask(vf.Task[ArithmeticData, vf.State, vf.TaskConfig]):
    @vf.reward(weight=1.0)
    async def correct(self, trace: vf.Trace) -> float:
        if next(SCORED) % 3 == 0:
            return "right"  # a scorer returning a non-number
        found = re.search(r"-?\d+", trace.last_reply)
        return float(found is not None and found.group() == self.data.answer)


class FlakyTaskset(vf.Taskset[FlakyTask, vf.TasksetConfig]):
    @classmethod
    def toolsets(cls, config: vf.TasksetConfig) -> list[vf.Toolset]:
        return [CalculatorToolset(vf.ToolsetConfig())]

    def load(self) -> Iterator[FlakyTask]:
        for index, row in enumerate(arithmetic.make_rows(12, split="train", seed=5)):
            yield FlakyTask(
                ArithmeticData(idx=index, prompt=row["prompt"][0]["content"], answer=row["solution"]), self.config.task
            )


__all__ = ["FlakyTaskset"]
