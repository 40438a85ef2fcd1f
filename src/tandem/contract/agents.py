"""What a run's agents are made of, as the trainer hands them to the rollout worker: the environments' factories,
and another library's harness that plays whole episodes instead of tandem's tool loop."""

from collections.abc import Callable
from typing import Any, Protocol

EnvironmentFactory = Callable[[], Any]
"""What makes an environment: its class, or a callable that returns an instance."""

EnvironmentFactories = EnvironmentFactory | dict[str, EnvironmentFactory]
"""One factory, or several by the name a dataset row's `environment` column picks."""


class Harness(Protocol):
    """Another library's episodes (an OpenEnv harness, a verifiers environment), which its loop class runs."""

    @property
    def loop_cls(self) -> type: ...
