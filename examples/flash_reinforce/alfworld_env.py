"""ALFWorld's text household games as a tandem environment, for examples/flash_reinforce/alfworld.yaml.

Each rollout plays one game of ALFWorld's training split: `reset()` starts the next game and returns its opening
text (the room, and "Your task is to: ...") as the prompt; the model acts through one tool, `act(command)`, which
answers with what it sees next and the commands that are possible now; `get_reward()` is 1.0 for a won game,
else 0.0. Instances come from a pool (one per rollout in flight) and each runs its own game process.

`alfworld` is imported when the first instance is made, so a dry run of the recipe needs none of this. Set up once:

    pip install alfworld
    export ALFWORLD_DATA=DIR && alfworld-download     # the PDDL and game files, into DIR
    export ALFWORLD_CONFIG=PATH/configs/base_config.yaml   # ALFWorld's own config (github.com/alfworld/alfworld)
"""

import functools
import os
from pathlib import Path

import yaml

SETUP = (
    "pip install alfworld; export ALFWORLD_DATA=DIR and run alfworld-download (the game files); export "
    "ALFWORLD_CONFIG=PATH of ALFWorld's configs/base_config.yaml (github.com/alfworld/alfworld)"
)
INSTRUCTIONS = (
    "You are in a household. Carry out the task below with the act tool, one command per call, until it is done.\n\n"
)


@functools.cache
def training_games():
    """ALFWorld's training games, found once per process (ALFWorld checks every game file)."""
    try:
        from alfworld.agents.environment import get_environment
    except ImportError as exc:
        raise ImportError(f"ALFWorldEnv needs the alfworld package and its games: {SETUP}") from exc
    path = os.environ.get("ALFWORLD_CONFIG", "")
    if not Path(path).is_file():
        raise FileNotFoundError(f"ALFWORLD_CONFIG={path!r} is not a file: {SETUP}")
    config = yaml.safe_load(Path(path).read_text())
    return get_environment(config["env"]["type"])(config, train_eval="train")


class ALFWorldEnv:
    def __init__(self):
        self.game = training_games().init_env(batch_size=1)
        self.won = self.over = False

    def reset(self, **row) -> str:
        observations, infos = self.game.reset()
        self.won = self.over = False
        return INSTRUCTIONS + seen(observations, infos)

    def act(self, command: str) -> str:
        """Carry out one command in the household, such as "go to countertop 1", "take apple 1 from countertop 1"
        or "open fridge 1".

        Args:
            command: One of the commands listed as possible now.

        Returns:
            What you see after it, and the commands possible next.
        """
        if self.over:
            return "The game is over."
        observations, _, dones, infos = self.game.step([command])
        self.won, self.over = bool(infos["won"][0]), bool(dones[0])
        return seen(observations, infos) + ("\n\nThe task is done." if self.won else "")

    def get_reward(self) -> float:
        return float(self.won)


def seen(observations, infos) -> str:
    """The game's text for the one game of a batch of 1, with the commands it accepts now."""
    return f"{observations[0]}\n\nPossible commands: {', '.join(infos['admissible_commands'][0])}"
