"""Tasks and environments from other libraries, each imported only when used (a missing package is a one-line error
naming the install command): reasoning-gym's procedural tasks (`reasoning_gym.py`)."""
