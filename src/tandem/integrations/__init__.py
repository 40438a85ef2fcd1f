"""Tasks and environments from other libraries, each imported only when used (a missing package is a one-line error
naming the install command): reasoning-gym's procedural tasks (`reasoning_gym.py`), OpenEnv harnesses (`openenv.py`,
through `HarnessAsyncGRPOTrainer`) and verifiers environments (`verifiers.py`)."""

from tandem.integrations import reasoning_gym, verifiers


def adapt(train_dataset, eval_dataset, reward_funcs):
    """The trainer's inputs with other libraries' objects made tandem's: reasoning-gym datasets as rows (their tasks'
    scorers as rewards), a verifiers environment as rows and the harness that plays them (else None)."""
    train_dataset, eval_dataset, reward_funcs, harness = verifiers.adapt(train_dataset, eval_dataset, reward_funcs)
    return *reasoning_gym.adapt(train_dataset, eval_dataset, reward_funcs), harness
