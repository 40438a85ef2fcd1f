"""Environments: stateful objects whose public methods are a rollout's tools.

`environment_factory` is one factory (a class or a callable) or a dict of them, named; a dataset row picks
its environment by its `environment` column. Each rollout takes an instance from its factory's pool,
`reset(**row)` starts the episode, the instance's public methods are the rollout's tools, and the optional
`get_reward()` scores it before the instance goes back to the pool for the next rollout.
"""

import inspect
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from tandem.contract.agents import EnvironmentFactories, EnvironmentFactory
from tandem.dataset_rows import columns_of
from tandem.errors import UsageError
from tandem.rollout.tools import validate_tools

RESERVED = ("reset", "get_reward")
ROUTE_COLUMN = "environment"


def factories_of(environment_factory: EnvironmentFactories | None) -> dict[str | None, EnvironmentFactory]:
    """The factories by name; a single factory is named None (every row uses it)."""
    if environment_factory is None:
        return {}
    if isinstance(environment_factory, dict):
        return {name: factory for name, factory in environment_factory.items()}
    return {None: environment_factory}


def route(row: dict, factories: dict[str | None, Callable]) -> str | None:
    """Which factory serves this row: its `environment` column when the factories are named."""
    return row[ROUTE_COLUMN] if None not in factories else None


def environment_tools(env) -> list[Callable]:
    """The instance's public methods other than reset and get_reward, bound: its rollout's tools."""
    cls = type(env)
    return [
        getattr(env, name)
        for name in sorted(vars_of(cls))
        if not name.startswith("_") and name not in RESERVED and inspect.isfunction(inspect.getattr_static(cls, name))
    ]


def vars_of(cls: type) -> set[str]:
    """Attribute names defined on the class and its bases (object's excluded)."""
    return {name for klass in cls.__mro__ if klass is not object for name in vars(klass)}


def reset_prompt(prompt: list[dict] | None, text: str | None) -> list[dict]:
    """The rollout's prompt after `reset()`: its string is appended to the last user message, or is the user
    message when the row has no prompt."""
    if text is not None and not isinstance(text, str):
        raise TypeError(f"reset() returned {type(text).__name__}; it must return a string (the task) or None")
    if not prompt:
        if text is None:
            raise ValueError(
                "the dataset row has no 'prompt' and the environment's reset() returned None: reset() must "
                "return the task as a string when there is no prompt column"
            )
        return [{"role": "user", "content": text}]
    if text is None:
        return list(prompt)
    messages = [dict(m) for m in prompt]
    last_user = max((i for i, m in enumerate(messages) if m["role"] == "user"), default=None)
    if last_user is None:
        return messages + [{"role": "user", "content": text}]
    messages[last_user]["content"] = f"{messages[last_user]['content']}{text}"
    return messages


class EnvironmentPool:
    """Idle instances per factory: a rollout takes one (made when none is idle) and gives it back after scoring,
    so an expensive __init__ is paid once per concurrent rollout, not once per rollout."""

    def __init__(self, factories: dict[str | None, Callable]):
        self.factories = factories
        self.idle: dict[str | None, list] = {name: [] for name in factories}

    def take(self, name: str | None):
        """An idle instance of the factory `name`, or None: make a new one."""
        return self.idle[name].pop() if self.idle[name] else None

    def give_back(self, name: str | None, env) -> None:
        self.idle[name].append(env)


def validate_environments(
    environment_factory: EnvironmentFactories | None,
    tools: list[Callable],
    datasets: dict[str, Iterable[Mapping[str, Any]] | None],
) -> list[type]:
    """Every mistake an environment setup can make, raised before any training work, each naming the fix;
    `datasets` are the rows that will pick environments, by name (train_dataset, eval_dataset). A class factory is
    read without running its __init__, which the pool pays once per instance; returns the instances' classes."""
    factories, classes = factories_of(environment_factory), []
    for name, factory in factories.items():
        label = "environment_factory" if name is None else f"environment_factory[{name!r}]"
        if not callable(factory):
            raise TypeError(f"{label} is {type(factory).__name__}, not a class or callable that makes an environment")
        env = unbuilt(factory)
        if not callable(getattr(env, "reset", None)):
            raise TypeError(
                f"{label}: {type(env).__name__} has no reset() method. An environment needs "
                "reset(self, **kwargs) -> str | None, called at the start of each rollout"
            )
        validate_tools(list(tools) + environment_tools(env), owner=f"{label} ({type(env).__name__}) and tools")
        classes.append(type(env))
    if None not in factories:
        for dataset_name, dataset in datasets.items():
            check_routes(factories, dataset, dataset_name)
    return classes


def unbuilt(factory: EnvironmentFactory) -> Any:
    """An instance to read an environment's tools from: a class's bare object (`__new__` without `__init__`, whose
    cost the pool pays once per instance); a factory function has to be called once."""
    if isinstance(factory, type):
        cls: type[object] = factory
        try:
            return cls.__new__(cls)
        except TypeError:  # a __new__ that needs arguments
            pass
    return factory()


def check_routes(
    factories: dict[str | None, EnvironmentFactory], dataset: Iterable[Mapping[str, Any]] | None, dataset_name: str
) -> None:
    """Named factories: every row of `dataset` names one of them in its `environment` column."""
    if dataset is None and dataset_name != "train_dataset":
        return
    columns = columns_of(dataset)
    if dataset is None or ROUTE_COLUMN not in columns:
        raise UsageError(
            f"environment_factory is a dict ({', '.join(map(repr, factories))}), so each dataset row must "
            f"name its environment in an {ROUTE_COLUMN!r} column; the {dataset_name} has "
            f"{'none' if dataset is None else 'columns ' + str(columns)}"
        )
    names = sorted(name for name in factories if name is not None)  # named factories: no None among them
    unknown = sorted({row[ROUTE_COLUMN] for row in dataset} - set(names))
    if unknown:
        raise UsageError(
            f"{dataset_name}'s {ROUTE_COLUMN!r} column names {unknown}, which environment_factory does not "
            f"have (it has {names}): add a factory for each, or fix the rows"
        )
