"""TRL's documented agent-training examples run as written, with the tiny model for the hub model, a few steps
for max_steps=1000, and a defined reward function where the documentation writes `...`. Real processes: an
embedded `tandem serve`, a spawned rollout worker. The tiny model calls an offered integer tool on part of the
requests, so an environment's own reward varies within a group and groups train."""

import json
import random

import pytest
from datasets import Dataset

from tandem import AsyncGRPOConfig, AsyncGRPOTrainer, AsyncRolloutLoop
from tandem.chat.tool_calls import ToolCall
from tandem.tasks import arithmetic

pytestmark = pytest.mark.slow


def args(tmp_path, **overrides) -> AsyncGRPOConfig:
    """The examples' AsyncGRPOConfig, sized for two CPU cores."""
    values = dict(
        output_dir=str(tmp_path / "run"),
        max_steps=3,
        num_generations=4,
        max_completion_length=32,
        learning_rate=1e-4,
        gradient_checkpointing=False,
        save_strategy="no",
        vllm_server_timeout=120,
        rollout_worker_timeout=60,
        max_tool_calling_iterations=2,
    )
    values.update(overrides)
    return AsyncGRPOConfig(**values)


def logged(tmp_path) -> list[dict]:
    return [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl")]


# ---- tools: TRL's tool example ----------------------------------------------------------------------------------
def multiply(a: int, b: int) -> int:
    """
    Multiplies two integers.

    Args:
        a: The first integer.
        b: The second integer.

    Returns:
        The product of the two integers.
    """
    return a * b


async def async_add(a: int, b: int) -> int:
    """
    Asynchronously adds two integers.

    Args:
        a: The first integer.
        b: The second integer.

    Returns:
        The sum of the two integers.
    """
    return a + b


@pytest.mark.long  # covered in parts by faster tests; python -m pytest -q -m long runs it
def test_a_tool_example_trains(tmp_path):
    data = Dataset.from_list(arithmetic.make_rows(16, split="train", seed=5))
    trainer = AsyncGRPOTrainer(
        model="tiny",
        reward_funcs=[arithmetic.correctness_reward, reward_func],
        args=args(tmp_path),
        train_dataset=data,
        tools=[multiply, async_add],
    )
    assert trainer.train().global_step == 3
    rows = logged(tmp_path)
    assert all("tools/call_frequency" in r and "tools/loop_exhausted_frac" in r for r in rows if "reward" in r)
    assert all("tools/failure_frequency" in r for r in rows), "NaN when a window saw no call, but always logged"


# ---- environments: self-sampling, dataset-driven, env-owned + trainer-owned rewards -----------------------------
class IncrementEnv:
    # Reserved methods
    def reset(self, **kwargs) -> str | None:  # required; called at the start of each rollout
        self.counter = 0
        self.target = random.randint(1, 6)  # self-sample the task
        return f"Increment the counter by {self.target}."  # returned string becomes the prompt

    def get_reward(self) -> float:  # optional: the environment scores itself from its own state
        return float(self.counter == self.target)

    # Public methods (exposed as tools)
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


@pytest.mark.long  # an environment trains in the default suite (the agent run of test_runs_write_the_documented_metrics)
def test_a_self_sampling_environment_trains_without_a_dataset(tmp_path):
    trainer = AsyncGRPOTrainer(model="tiny", args=args(tmp_path, max_steps=2), environment_factory=IncrementEnv)
    assert trainer.train().global_step == 2
    rows = logged(tmp_path)
    assert any("rewards/IncrementEnv/mean" in r for r in rows), "the environment's reward is a source named after it"
    assert any("env/reset_s" in r and "env/reward_s" in r for r in rows)
    assert any(r.get("tools/increment/call_count", 0) > 0 for r in rows), "the model called the environment's tool"
    assert "epoch" not in rows[-1], "without a dataset there are no epochs, only max_steps"


class DatasetIncrementEnv:
    def reset(self, target, **kwargs) -> None:  # the row's `target` column arrives as a keyword argument
        self.counter = 0
        self.target = target

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


@pytest.mark.long  # covered in parts by faster tests; python -m pytest -q -m long runs it
def test_a_dataset_driven_environment_trains(tmp_path):
    dataset = Dataset.from_dict(
        {
            "prompt": [[{"role": "user", "content": f"Increment the counter to {i}."}] for i in range(1, 7)],
            "target": list(range(1, 7)),
        }
    )
    trainer = AsyncGRPOTrainer(
        model="tiny", args=args(tmp_path, max_steps=2), train_dataset=dataset, environment_factory=DatasetIncrementEnv
    )
    assert trainer.train().global_step == 2


def format_reward(completions, **kwargs) -> list[float]:  # trainer-owned: scores the completion text
    """1.0 when the first reply is a tool call (defined here: the example leaves it to the reader)."""
    return [float(bool(c and c[0].get("tool_calls"))) for c in completions]


@pytest.mark.long  # covered in parts by faster tests; python -m pytest -q -m long runs it
def test_env_owned_and_trainer_owned_rewards_add_up(tmp_path):
    trainer = AsyncGRPOTrainer(
        model="tiny", args=args(tmp_path, max_steps=2), reward_funcs=format_reward, environment_factory=IncrementEnv
    )
    assert trainer.train().global_step == 2
    rows = [r for r in logged(tmp_path) if "reward" in r]
    assert rows and all("rewards/format_reward/mean" in r and "rewards/IncrementEnv/mean" in r for r in rows)


# ---- several environments: routing by the dataset's environment column ------------------------------------------
class CodingEnv:
    def reset(self, **kwargs) -> str:
        n = random.randint(1, 20)
        return f"Compute the {n}th Fibonacci number."

    def run_code(self, code: str) -> str:  # exposed as a tool only for "coding" examples
        """Run the given Python code and return its stdout.

        Args:
            code: The Python source to execute.

        Returns:
            The captured standard output.
        """
        return "not run in tests"


class GameEnv:
    def reset(self, **kwargs) -> str:
        return "Reach the goal tile."

    def move(self, action: str) -> str:  # exposed as a tool only for "game" examples
        """Apply an action to the game and return the new observation.

        Args:
            action: One of "up", "down", "left", "right".

        Returns:
            The observation after the move.
        """
        return f"moved {action}"


def reward_func(completions, **kwargs) -> list[float]:
    """Shorter final replies score higher (defined here: the example leaves it to the reader)."""
    return [-float(len(c[-1].get("content") or "")) for c in completions]


@pytest.mark.long  # covered in parts by faster tests; python -m pytest -q -m long runs it
def test_multi_environment_routing_trains(tmp_path):
    dataset = Dataset.from_dict({"environment": ["coding", "game"] * 500})
    trainer = AsyncGRPOTrainer(
        model="tiny",
        args=args(tmp_path, max_steps=2),
        train_dataset=dataset,
        reward_funcs=reward_func,
        environment_factory={"coding": CodingEnv, "game": GameEnv},
    )
    assert trainer.train().global_step == 2


# ---- bad input, before any training work ------------------------------------------------------------------------
def test_agent_mistakes_fail_at_construction_naming_the_fix(tmp_path):
    data = Dataset.from_list(arithmetic.make_rows(4, split="train", seed=5))
    with pytest.raises(TypeError, match="a lambda cannot be a tool"):
        AsyncGRPOTrainer(
            "tiny", arithmetic.correctness_reward, args=args(tmp_path), train_dataset=data, tools=[lambda x: x]
        )
    with pytest.raises(ValueError, match="set max_steps"):
        AsyncGRPOTrainer("tiny", args=args(tmp_path, max_steps=-1), environment_factory=IncrementEnv)
    with pytest.raises(ValueError, match="names \\['chess'\\]"):
        AsyncGRPOTrainer(
            "tiny",
            reward_func,
            args=args(tmp_path),
            train_dataset=Dataset.from_dict({"environment": ["chess"]}),
            environment_factory={"coding": CodingEnv},
        )
    with pytest.raises(ValueError, match="no environment defines get_reward"):
        AsyncGRPOTrainer("tiny", args=args(tmp_path), environment_factory=CodingEnv)

    class LocalEnv(GameEnv):
        pass

    with pytest.raises(TypeError, match="not picklable"):
        AsyncGRPOTrainer(
            "tiny",
            reward_func,
            args=args(tmp_path),
            train_dataset=Dataset.from_dict({"environment": ["x"]}),
            environment_factory={"x": LocalEnv},
        )


# ---- exactness over several turns -------------------------------------------------------------------------------
class AlwaysCallsLoop(AsyncRolloutLoop):
    """Every reply is followed by a multiply call (as if the model had written it), so each rollout runs to
    max_tool_calling_iterations: several turns, tool results in the context, whatever the tiny model says."""

    def reply(self, output_ids, parse):
        message, _ = super().reply(output_ids, parse)
        call = ToolCall(name="multiply", arguments={"a": 6, "b": 7})
        return {**message, "tool_calls": [call.as_message_call()]}, [call]


class AlwaysCallsTrainer(AsyncGRPOTrainer):
    loop_cls = AlwaysCallsLoop


def random_reward(completions, **kwargs) -> list[float]:
    """Any reward that varies within a group (the tiny model's truncated replies may all be alike): this test
    checks log-probs, not learning."""
    return [random.random() for _ in completions]


def test_at_staleness_zero_several_tool_turns_keep_the_importance_ratio_at_one(tmp_path):
    """Every trained token is the sampler's own id with its own log-prob, turn after turn (the server's prefix cache
    on), so the trainer's forward reproduces the sampler: the importance ratio stays 1."""
    data = Dataset.from_list(arithmetic.make_rows(16, split="train", seed=5))
    trainer = AlwaysCallsTrainer(
        "tiny",
        random_reward,
        args=args(tmp_path, max_staleness=0, max_completion_length=6),
        train_dataset=data,
        tools=[multiply],
    )
    trainer.train()
    rows = [r for r in logged(tmp_path) if "sampling/importance_sampling_ratio/mean" in r]
    assert rows
    for r in rows:
        assert r["sample/staleness_max"] == 0
        assert abs(r["sampling/importance_sampling_ratio/mean"] - 1.0) < 1e-4, r[
            "sampling/importance_sampling_ratio/mean"
        ]
    assert all(
        r["rollout/turns_mean"] == 3 and r["tools/loop_exhausted_frac"] == 1.0
        for r in logged(tmp_path)
        if "rollout/turns_mean" in r
    ), "two tool turns, then the cap"
