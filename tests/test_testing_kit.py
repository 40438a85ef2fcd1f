"""tandem.testing, as a user testing their own rollout loop would call it: a subclass with its hooks, run against
tandem serve for a few prompts, its groups scored and its records read back."""

import numpy as np
import pytest
from datasets import Dataset

from tandem import AsyncGRPOConfig, AsyncRolloutLoop
from tandem.rewards import accuracy_reward
from tandem.tasks import arithmetic
from tandem.testing import LoopRun, run_loop

ROWS = Dataset.from_list(arithmetic.make_rows(8, seed=0))
ARGS = AsyncGRPOConfig(num_generations=4, max_completion_length=8, train_sampling_strategy="sequential")


class EvenPromptsShortestFirst(AsyncRolloutLoop):
    """A user's loop: it skips odd prompts, records each completion's length, and ranks a group by length alone."""

    def filter_prompt(self, row_index, row, epoch):
        return row_index % 2 == 0

    async def generate_one(self, prompt, tools, group_id=0):
        rollout = await super().generate_one(prompt, tools, group_id)
        self.record("my_loop/completion_tokens", len(rollout.completion_ids))
        return rollout

    def compute_advantages(self, group):
        lengths = np.array([len(ids) for ids in group.completions_ids], dtype=np.float64)
        return lengths.mean() - lengths  # shorter than the group's mean: a positive advantage


@pytest.fixture(scope="module")
def run() -> LoopRun:
    def length_reward(completion_ids, **kwargs):  # rewards that always differ, so GRPO keeps every group
        return [float(len(ids)) + 0.01 * i for i, ids in enumerate(completion_ids)]

    return run_loop(
        EvenPromptsShortestFirst, train_dataset=ROWS, reward_funcs=[length_reward], num_prompts=4, args=ARGS
    )


def test_the_loops_hooks_decide_which_prompts_are_generated_and_how_they_are_scored(run):
    assert sorted({s.prompt_index for s in run.samples}) == [0, 2], "filter_prompt kept the even prompts"
    assert sorted(run.skipped) == [1, 3]
    for group in run.groups:
        lengths = np.array([s.num_trained for s in group], dtype=np.float64)
        assert np.allclose([s.advantage for s in group], lengths.mean() - lengths), "compute_advantages' values"


def test_what_the_hooks_recorded_is_read_back_beside_the_schedulers_metrics(run):
    assert len(run.metrics["my_loop/completion_tokens"]) == 8, "two groups of four rollouts"
    assert run.metrics["reward"], "the scheduler's own records come with them"


def test_the_default_loop_scores_with_the_reward_functions():
    run = run_loop(train_dataset=ROWS, reward_funcs=[accuracy_reward], num_prompts=2, args=ARGS)
    assert len(run.groups) + len(run.skipped) == 2
    assert all(s.reward in (0.0, 1.0) for s in run.samples)
