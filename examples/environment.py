"""Agent training with an environment: a counter driven by tool calls, reset from dataset columns.

    python examples/environment.py            (about 2 minutes on 2 CPU cores)

Each dataset row asks the model to bring a counter to a target. One `CounterEnv` per rollout (from a pool,
reused after `reset`): `reset(target=...)` reads the row's `target` column, the instance's public method
`increment` is the rollout's only tool, and `get_reward` scores the counter the episode ended on — a reward
source of weight 1 named after the class (`rewards/CounterEnv/mean`). The tiny model calls an offered
integer tool on part of the problems; RL teaches it to call it, with the right number, every time.
"""

import random

from datasets import Dataset

from tandem import AsyncGRPOConfig, AsyncGRPOTrainer

PHRASINGS = [
    "Increment the counter by {n}.",
    "Increment the counter to {n}.",
    "Add {n} to the counter.",
    "Bring the counter from 0 to {n}.",
]


class CounterEnv:
    def reset(self, target: int, **kwargs) -> None:
        """A new episode: the counter at 0, the row's target to reach. Returns None: the row's prompt is the task."""
        self.counter, self.target = 0, target

    def get_reward(self) -> float:
        return float(self.counter == self.target)

    def increment(self, step: int) -> int:
        """
        Increment the internal counter.

        Args:
            step: Value to add to the counter.

        Returns:
            The updated counter value.
        """
        self.counter += step
        return self.counter


def counter_rows(n: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        target = rng.randint(1, 9)
        text = rng.choice(PHRASINGS).format(n=target)
        rows.append({"prompt": [{"role": "user", "content": text}], "target": target})
    return rows


if __name__ == "__main__":  # the rollout worker is a spawned process that re-imports this script
    args = AsyncGRPOConfig(
        output_dir="runs/environment",
        max_steps=60,
        learning_rate=2e-4,
        num_generations=8,
        max_completion_length=32,
        max_tool_calling_iterations=1,
        token_budget=1024,
        gradient_checkpointing=False,
        max_staleness=2,
        save_steps=1000,
    )
    trainer = AsyncGRPOTrainer(
        model="tiny", args=args, train_dataset=Dataset.from_list(counter_rows(64)), environment_factory=CounterEnv
    )
    output = trainer.train()
    head, tail = trainer.reward_history[:10], trainer.reward_history[-10:]
    print(
        f"\ntrained {output.global_step} steps; mean reward, first {len(head)} steps: {sum(head) / len(head):.3f}   "
        f"last {len(tail)} steps: {sum(tail) / len(tail):.3f}"
    )
