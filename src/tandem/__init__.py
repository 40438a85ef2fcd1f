"""tandem: asynchronous reinforcement learning for language models, generation and training overlapped.

The public names are imported on first use (PEP 562), so `tandem serve` and `tandem proxy` start without
loading the trainer, and the proxy without torch.
"""

import importlib
import os

# Every row of a CPU matmul rounds the same whatever the number of rows (exact_attention.ROWS_ROUND_ALIKE): set before
# MKL's first call in this process, and inherited by the servers and workers it starts. A value of the user's own wins.
os.environ.setdefault("MKL_CBWR", "AUTO,STRICT")

__version__ = "0.1.0"
DISTRIBUTION = "tandem-rl"
"""The name tandem installs under (`pip install tandem-rl`): `tandem` on PyPI is another project. It imports as tandem."""

_HOMES = {
    "AsyncGRPOConfig": "tandem.config",
    "AsyncGRPOTrainer": "tandem.trainer.trainer",
    "AsyncRolloutLoop": "tandem.rollout.loop",
    "HarnessAsyncGRPOTrainer": "tandem.trainer.harness",
    "Rollout": "tandem.contract.records",
    "RolloutGroup": "tandem.contract.records",
    "TurnRecord": "tandem.contract.records",
    "UsageError": "tandem.errors",
}

__all__ = [*_HOMES, "__version__", "DISTRIBUTION"]


def __getattr__(name: str):
    if name not in _HOMES:
        raise AttributeError(f"module 'tandem' has no attribute {name!r}")
    value = getattr(importlib.import_module(_HOMES[name]), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_HOMES))
