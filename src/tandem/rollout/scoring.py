"""Scoring a group: every reward function runs concurrently (async awaited, sync in threads), the
results are summed per rollout, and `None` means "this function does not score this rollout".
A function that raises or passes `timeout_s` is called once more (judges over the network are flaky);
a second failure is a `RewardFailed`, and the loop drops the group."""

import asyncio
import inspect
import math
import traceback

import numpy as np


def reward_name(func) -> str:
    return getattr(func, "__name__", None) or type(func).__name__


class RewardFailed(Exception):
    """A reward function raised (or timed out) on a group twice in a row."""

    def __init__(self, name: str, error: BaseException):
        super().__init__(f"reward function {name!r} failed twice on one group: {error!r}")
        self.name = name
        self.traceback = "".join(traceback.format_exception(error)).rstrip()


async def _call(func, kwargs: dict) -> list:
    if inspect.iscoroutinefunction(func) or inspect.iscoroutinefunction(type(func).__call__):
        return await func(**kwargs)
    return await asyncio.to_thread(func, **kwargs)  # a sync call past its timeout finishes in its thread, unread


async def _call_twice(func, kwargs: dict, timeout_s: float | None) -> list:
    for _attempt in (1, 2):
        try:
            return await asyncio.wait_for(_call(func, kwargs), timeout_s)
        except TimeoutError:
            error: Exception = TimeoutError(f"no answer within reward_timeout={timeout_s:g}s")
        except Exception as exc:  # noqa: BLE001 - the user's function: any error is its failure
            error = exc
    raise RewardFailed(reward_name(func), error)


async def score(reward_funcs: list, kwargs: dict, size: int, timeout_s: float | None = None) -> dict[str, np.ndarray]:
    """One float array per reward function (NaN where it returned None), in `reward_funcs` order."""
    results = await asyncio.gather(*[_call_twice(f, kwargs, timeout_s) for f in reward_funcs])
    columns = {}
    for func, values in zip(reward_funcs, results):
        name = reward_name(func)
        if not isinstance(values, (list, tuple, np.ndarray)) or len(values) != size:
            got = f"{len(values)} values" if hasattr(values, "__len__") else repr(type(values).__name__)
            raise ValueError(
                f"reward function {name!r} returned {got} for a group of {size} completions: "
                "it must return one float (or None) per completion, in order"
            )
        columns[name] = np.array([math.nan if v is None else float(v) for v in values], dtype=np.float64)
    return columns


def environment_columns(env_rewards: list[tuple[type, float] | None]) -> dict[str, np.ndarray]:
    """One column per environment class that owns a reward (get_reward), named after the class: its rollouts' values,
    NaN for the others."""
    names = sorted({entry[0].__name__ for entry in env_rewards if entry is not None})
    return {
        name: np.array(
            [entry[1] if entry is not None and entry[0].__name__ == name else math.nan for entry in env_rewards],
            dtype=np.float64,
        )
        for name in names
    }


def total_reward(columns: list[np.ndarray], size: int) -> np.ndarray:
    """Sum over sources; NaN only where every source is NaN (nobody scored that rollout)."""
    if not columns:
        return np.full(size, math.nan)
    stacked = np.stack(columns)
    total = np.nansum(stacked, axis=0)
    total[np.all(np.isnan(stacked), axis=0)] = math.nan
    return total


def group_advantages(rewards: np.ndarray) -> np.ndarray:
    """(r - mean) / std over the scorable rollouts (population std); unscorable rollouts get 0."""
    advantages = np.zeros_like(rewards)
    scored = ~np.isnan(rewards)
    if scored.sum() >= 2:
        values = rewards[scored]
        std = values.std()
        if std > 0:
            advantages[scored] = (values - values.mean()) / std
    return advantages
