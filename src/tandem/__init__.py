"""tandem: asynchronous reinforcement learning for language models, generation and training overlapped."""

import os

__version__ = "0.1.0"

# The trainer, the rollout worker and the embedded server share the machine's cores. OpenMP threads
# that spin while idle then steal them from each other (a training step ran 20x slower here); passive
# waiting costs nothing measurable. Takes effect only if torch was not imported before tandem.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from tandem.config import AsyncGRPOConfig  # noqa: E402
from tandem.rollout.loop import AsyncRolloutLoop  # noqa: E402
from tandem.rollout.records import Rollout, RolloutGroup, TurnRecord  # noqa: E402
from tandem.trainer.trainer import AsyncGRPOTrainer  # noqa: E402

__all__ = ["AsyncGRPOConfig", "AsyncGRPOTrainer", "AsyncRolloutLoop", "Rollout", "RolloutGroup", "TurnRecord", "__version__"]
