"""What a rollout produces, from one sampling request (TurnRecord) to the samples the trainer packs.

Names and fields follow TRL's AsyncGRPOTrainer API (`TurnRecord`, `Rollout`, `RolloutGroup`); `Sample`
is the unit of training: one token sequence with the positions that are trained, their sampler
log-probs, and the advantage of the rollout it came from.
"""

import uuid
from dataclasses import dataclass, field

import numpy as np

from tandem.errors import UsageError


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
    output_token_versions: list[int] | None = None
    """The policy version whose weights sampled each output token (a sync between two of them changes it); None: the
    version the request named, for every token."""

    def __post_init__(self):
        """Each per-token field holds one entry per output token. A custom loop's record with fewer would otherwise
        train against made-up values (a missing log-prob read as 0.0 masks or inflates the token's ratio)."""
        n = len(self.output_ids)
        trained = self.output_mask is None or any(self.output_mask)
        if len(self.output_log_probs) != n and (self.output_log_probs or trained):
            raise UsageError(
                f"TurnRecord: output_log_probs has {len(self.output_log_probs)} values for {n} output_ids. Each "
                "generated token needs the log-prob its sampler gave it: ask the server for logprobs=0 and pass "
                "them on (or set output_mask to 0 for tokens that are not to be trained)."
            )
        optional = {  # None (or, but for the mask, empty): not given
            "output_mask": self.output_mask,
            "output_sampling_mask": self.output_sampling_mask or None,
            "output_sampler_logprobs": self.output_sampler_logprobs or None,
            "output_token_versions": self.output_token_versions or None,
        }
        for name, values in optional.items():
            if values is not None and len(values) != n:
                raise UsageError(
                    f"TurnRecord: {name} has {len(values)} values for {n} output_ids: give one per output token, "
                    "or None."
                )


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
    `behavior_log_probs[j]` their sampler log-prob (0.0 for context tokens), `token_versions[j]` the policy version
    that sampled them (-1 for context tokens)."""

    input_ids: list[int]
    trained: list[bool]
    behavior_log_probs: list[float]
    sampler_logprobs: list[dict[int, float] | None] = field(default_factory=list)
    sampling_mask: list[list[int] | None] = field(default_factory=list)
    token_versions: list[int] = field(default_factory=list)


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
    token_versions: list[int] = field(default_factory=list)
    """The policy version that sampled each token (-1 for context tokens); empty: `model_version`, for every token."""
    group_token_version: float | None = None
    """The mean policy version of every token the sample's group generated: the version the staleness rule judges
    the group by under in_flight_weight_updates. None: `model_version`."""

    def trained_versions(self) -> list[int]:
        """The policy version of each trained token."""
        if not self.token_versions:
            return [self.model_version] * self.num_trained
        return [v for v, t in zip(self.token_versions, self.trained) if t]

    def mixed_tokens(self) -> int:
        """Trained tokens sampled after a weight swap in the middle of their own turn (a run of generated tokens): the
        server kept the key-value cache the older weights computed, so no one version's weights give them exactly."""
        count, first = 0, None
        for version, trained in zip(self.token_versions, self.trained):
            first = (version if first is None else first) if trained else None
            count += trained and version != first
        return count

    @property
    def num_tokens(self) -> int:
        return len(self.input_ids)

    @property
    def num_trained(self) -> int:
        return sum(self.trained)
