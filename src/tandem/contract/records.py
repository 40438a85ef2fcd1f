"""What a rollout produces, from one sampling request (TurnRecord) to the samples the trainer packs.

Names and fields follow TRL's AsyncGRPOTrainer API (`TurnRecord`, `Rollout`, `RolloutGroup`); `Sample`
is the unit of training: one token sequence with the positions that are trained, their sampler
log-probs, and the advantage of the rollout it came from.
"""

import uuid
from dataclasses import dataclass, field

import numpy as np


@dataclass
class TurnRecord:
    """One sampling request: the full prompt sent and what the sampler produced."""

    prompt_ids: list[int]
    output_ids: list[int]
    output_log_probs: list[float] = field(default_factory=list)
    output_mask: list[int] | None = None
    output_sampling_mask: list[list[int]] | None = None
    output_sampler_logprobs: list[dict[int, float]] | None = None
    finish_reason: str | None = None


@dataclass
class Rollout:
    """One finished rollout: the conversation after the prompt and the requests that made it."""

    completion: list[dict]
    completion_ids: list[int]
    turns: list[TurnRecord]
    tool_call_count: int = 0
    tool_failure_count: int = 0
    reward: float | None = None
    rollout_id: str = field(default_factory=lambda: uuid.uuid4().hex[:16])


@dataclass
class TrainingSequence:
    """A token sequence built from a rollout's turns: `trained[j]` marks sampled tokens to train on,
    `behavior_log_probs[j]` their sampler log-prob (0.0 for context tokens)."""

    input_ids: list[int]
    trained: list[bool]
    behavior_log_probs: list[float]
    sampler_logprobs: list[dict[int, float] | None] = field(default_factory=list)
    sampling_mask: list[list[int] | None] = field(default_factory=list)


@dataclass
class RolloutGroup:
    """The `num_generations` rollouts of one prompt, scored together; one entry per rollout in each list."""

    prompts: list[list[dict]]
    reward_kwargs: dict[str, list]
    completions: list[list[dict]]
    completions_ids: list[list[int]]
    completions_sequences: list[list[TrainingSequence]]
    tool_call_counts: list[int]
    tool_failure_counts: list[int]
    model_version: int
    group_id: int
    row_index: int
    env_rewards: list[tuple[type, float] | None]
    rollout_rewards: list[float | None]
    queued_at: float = 0.0
    rewards: np.ndarray | None = None


@dataclass
class Sample:
    """One training sample as it travels to the trainer."""

    input_ids: list[int]
    trained: list[bool]
    behavior_log_probs: list[float]
    advantage: float
    model_version: int
    group_id: int
    prompt_index: int
    """Index of the prompt in the run's stream of prompts (epoch * len(dataset) + row); resume uses it."""
    group_samples: int
    """How many samples the prompt's group produced: the prompt index is done when all are trained."""
    rollout_id: str
    created_at: float
    sampler_logprobs: list[dict[int, float] | None] = field(default_factory=list)
    sampling_mask: list[list[int] | None] = field(default_factory=list)
    reward: float = float("nan")
    """The rollout's total reward (FlashREINFORCE computes advantages from it when the batch is assembled)."""
    group_reward_std: float = float("nan")
    """The std of the summed reward within the sample's group: reward_group_std, averaged over trained samples."""
    source_group_stds: dict[str, float] = field(default_factory=dict)
    """The same per reward source (rewards/{source}/group_std)."""

    @property
    def num_tokens(self) -> int:
        return len(self.input_ids)

    @property
    def num_trained(self) -> int:
        return sum(self.trained)
