"""TRL's documented reward-function examples, run through the worker's scoring exactly as written."""

import asyncio
import math
import re
import time

import numpy as np
import pytest

from tandem.rollout import scoring


def length_reward(completion_ids, **kwargs):
    """Reward function that assigns higher scores to longer completions (in terms of token count)."""
    return [float(len(ids)) for ids in completion_ids]


def format_reward_func(completions, **kwargs):
    pattern = r"^<think>.*?</think><answer>.*?</answer>$"
    contents = [completion[0]["content"] for completion in completions]
    return [1.0 if re.match(pattern, c) else 0.0 for c in contents]


def boxed_reward(completions, ground_truth, **kwargs):
    matches = [re.search(r"\\boxed\{(.*?)\}", completion[0]["content"]) for completion in completions]
    contents = [m.group(1) if m else "" for m in matches]
    return [1.0 if c == gt else 0.0 for c, gt in zip(contents, ground_truth)]


def math_reward_func(prompts, completions, task, **kwargs):
    return [(1.0 if "4" in c[0]["content"] else -1.0) if t == "math" else None for c, t in zip(completions, task)]


def coding_reward_func(prompts, completions, task, **kwargs):
    return [(1.0 if "def" in c[0]["content"] else -1.0) if t == "code" else None for c, t in zip(completions, task)]


async def async_reward_func(prompts, completions, **kwargs):
    await asyncio.sleep(0.01)
    return [1.0 if completion else 0.0 for completion in completions]


async def slow_a(completions, **kwargs):
    await asyncio.sleep(0.2)
    return [1.0] * len(completions)


async def slow_b(completions, **kwargs):
    await asyncio.sleep(0.2)
    return [2.0] * len(completions)


def score(funcs, n, **kwargs):
    columns = asyncio.run(scoring.score(funcs, kwargs, n))
    return columns, scoring.total_reward(list(columns.values()), n)


def msgs(*texts):
    return [[{"role": "assistant", "content": t}] for t in texts]


def test_example_1_longer_completions():
    prompts = [[{"role": "user", "content": "The sky is"}], [{"role": "user", "content": "The sun is"}]]
    _, total = score(
        [length_reward],
        2,
        prompts=prompts,
        completions=msgs(" blue.", " in the sky."),
        completion_ids=[[6303, 13], [304, 279, 12884, 13]],
    )
    assert total.tolist() == [2.0, 4.0]


def test_example_2_format():
    completions = msgs(
        "<think>The sum of 1 and 2 is 3, which we multiply by 4 to get 12.</think><answer>(1 + 2) * 4 = 12</answer>",
        "The sum of 3 and 1 is 4, which we multiply by 2 to get 8. So (3 + 1) * 2 = 8.",
    )
    _, total = score([format_reward_func], 2, prompts=[[], []], completions=completions, completion_ids=[[], []])
    assert total.tolist() == [1.0, 0.0]


def test_example_3_reference_column():
    _, total = score(
        [boxed_reward],
        2,
        prompts=[[], []],
        completions=msgs(r"The solution is \boxed{2}.", r"The solution is \boxed{6}."),
        completion_ids=[[], []],
        ground_truth=["2", "5"],
    )
    assert total.tolist() == [1.0, 0.0]


def test_example_4_multi_task_none_is_ignored():
    completions = msgs("4", "def add(a, b): return a + b", "12", "return a * b")
    columns, total = score(
        [math_reward_func, coding_reward_func],
        4,
        prompts=[[]] * 4,
        completions=completions,
        completion_ids=[[]] * 4,
        task=["math", "code", "math", "code"],
    )
    assert math.isnan(columns["math_reward_func"][1]) and math.isnan(columns["coding_reward_func"][0])
    assert total.tolist() == [1.0, 1.0, -1.0, -1.0], "each row takes the reward of the function that scored it"


def test_example_5_async_reward_is_awaited():
    _, total = score([async_reward_func], 2, prompts=[[], []], completions=msgs("x", "y"), completion_ids=[[], []])
    assert total.tolist() == [1.0, 1.0]


def test_two_slow_async_rewards_overlap():
    start = time.perf_counter()
    _, total = score([slow_a, slow_b], 3, prompts=[[]] * 3, completions=msgs("a", "b", "c"), completion_ids=[[]] * 3)
    elapsed = time.perf_counter() - start
    assert total.tolist() == [3.0, 3.0, 3.0]
    assert elapsed < 0.35, f"two 0.2 s rewards took {elapsed:.2f}s: they did not run concurrently"


def test_a_reward_returning_the_wrong_count_is_named():
    def short(completions, **kwargs):
        return [1.0]

    with pytest.raises(ValueError, match="reward function 'short' returned 1 values for a group of 3"):
        score([short], 3, prompts=[[]] * 3, completions=msgs("a", "b", "c"), completion_ids=[[]] * 3)


def test_advantages_exclude_unscored_rollouts():
    rewards = np.array([1.0, 0.0, math.nan, 1.0])
    advantages = scoring.group_advantages(rewards)
    assert advantages[2] == 0.0
    scored = rewards[[0, 1, 3]]
    assert np.allclose(advantages[[0, 1, 3]], (scored - scored.mean()) / scored.std())


def test_accuracy_reward_checks_the_final_answer_and_remembers_what_it_checked():
    from tandem.rewards import accuracy_reward, verdict

    verdict.cache_clear()
    completions = [[{"role": "assistant", "content": c}] for c in ["42", "The answer is 42", "41", "42"]]
    assert accuracy_reward(completions, solution=["42"] * 4) == [1.0, 1.0, 0.0, 1.0]
    assert accuracy_reward(["42"], solution=["no number here"]) == [None], "a solution that does not parse: unscored"
    assert verdict.cache_info().hits == 1, "the repeated (solution, completion) pair is checked once"
    assert accuracy_reward(completions, solution=["41"] * 4) == [0.0, 0.0, 1.0, 0.0], (
        "another solution, another verdict"
    )
