"""Tasks and environments from other libraries, each imported only when used (a missing package is a one-line error
naming the install command): reasoning-gym's procedural tasks (`reasoning_gym.py`), OpenEnv harnesses (`openenv.py`,
through `HarnessAsyncGRPOTrainer`) and verifiers environments (`verifiers.py`)."""

from tandem.errors import UsageError
from tandem.integrations import reasoning_gym, verifiers


def adapt(train_dataset, eval_dataset, reward_funcs, harness=None):
    """The trainer's inputs with other libraries' objects made tandem's: reasoning-gym datasets as rows (their tasks'
    scorers as rewards), a verifiers environment as rows and the harness that plays them (else the trainer's own
    `harness`, HarnessAsyncGRPOTrainer's)."""
    train_dataset, eval_dataset, reward_funcs, played = verifiers.adapt(train_dataset, eval_dataset, reward_funcs)
    if played is not None and harness is not None:
        raise UsageError(
            f"{type(harness).__name__} plays the rollouts: train_dataset cannot be a verifiers environment "
            "too (pass its rows of prompts, or train the environment with AsyncGRPOTrainer)"
        )
    return *reasoning_gym.adapt(train_dataset, eval_dataset, reward_funcs), played or harness
