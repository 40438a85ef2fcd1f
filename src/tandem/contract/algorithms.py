"""The training algorithms, one object each: what differs between GRPO and FlashREINFORCE, said in one place.

Both processes import this module (it needs no torch): the rollout worker asks the chosen algorithm which scored
groups to keep and what the sampler must return; the trainer asks it the unit a step trains on, how many units make
a step, what to do with a unit too long for a row, and which objective computes the loss. The pipeline never
branches on the algorithm's name: `algorithm_of` is the one place that reads `AsyncGRPOConfig.algorithm`.

A config field that only one algorithm reads is refused, set away from its default, under the other (`refusals`):
a FlashREINFORCE run with `epsilon=0.3` stops at once instead of training without it.
"""

import math
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from tandem.errors import UsageError

if TYPE_CHECKING:
    from tandem.config import AsyncGRPOConfig
    from tandem.contract.records import Sample

CORRECTION_MODES = ("token_mask", "token_truncate", "sequence_mask", "sequence_truncate", "geometric_mask")
"""The off-policy corrections `vllm_importance_sampling_mode` chooses among (losses/ratio.py has their formulas)."""
RATIO_LEVELS = ("token", "sequence")
"""The values of `importance_sampling_level`: each token's own ratio, or GSPO's per-sequence one."""


@dataclass(frozen=True)
class Algorithm:
    """What the pipeline asks of an algorithm. Subclasses set the class attributes and the methods that differ."""

    name: ClassVar[str]
    """The value of `AsyncGRPOConfig.algorithm` that chooses it."""
    title: ClassVar[str]
    """Its name in prose."""
    reads: ClassVar[frozenset[str]]
    """The config fields that this algorithm reads and another does not."""
    drops_oversize_unit: ClassVar[bool]
    """A unit longer than a whole micro-batch: dropped (True), or trained as far as it fits (False)."""

    def checks(self, config: "AsyncGRPOConfig") -> list[tuple[str, bool, str]]:
        """(field, holds, what it must be) for the fields this algorithm reads."""
        return []

    def unit_key(self, sample: "Sample") -> Hashable:
        """Samples with the same key are trained in the same step (the step's last micro-batch takes whole units)."""
        raise NotImplementedError

    def keeps(self, rewards: Sequence[float]) -> bool:
        """Whether a scored group (its rollouts' rewards, NaN where unscored) goes to the trainer."""
        raise NotImplementedError

    def sampler_top_logprobs(self, config: "AsyncGRPOConfig") -> int:
        """How many of the sampler's most likely tokens the server returns at each position (0: none)."""
        return 0

    def units_per_step(self, config: "AsyncGRPOConfig") -> int | None:
        """Exactly this many units make a step; None: `gradient_accumulation_steps` micro-batches of full rows."""
        return None

    def objective(self, config: "AsyncGRPOConfig") -> str:
        """The name of the objective that computes the loss (`tandem.trainer.objectives.OBJECTIVES`)."""
        raise NotImplementedError

    def plan(self, config: "AsyncGRPOConfig", max_model_len: int, num_prompts: int | None) -> list[tuple[str, str]]:
        """(label, text) lines that `tandem train --dry-run` prints about what a run will train; none by default."""
        return []

    def drift_fixes(self, config: Mapping[str, Any]) -> list[str]:
        """What `tandem doctor` suggests of this algorithm's own settings when the sampler drifts from the trainer
        (`config`: the run's saved config), beside the staleness and the server's dtype."""
        return []


@dataclass(frozen=True)
class GRPO(Algorithm):
    """Group-relative policy optimisation: `num_generations` rollouts per prompt, each scored against its group's
    mean. A group whose rewards are all equal carries no signal and is dropped; a group trains in one step (split
    across two, its second part would train a policy version later, past the staleness bound it was admitted under)."""

    name, title = "grpo", "GRPO"
    reads = frozenset(
        {
            "epsilon",
            "epsilon_high",
            "score_centering",
            "num_sampler_logprobs",
            "vllm_importance_sampling_clip_min",
            "vllm_importance_sampling_clip_max",
            "vllm_importance_sampling_mode",
            "importance_sampling_level",
        }
    )
    drops_oversize_unit = False

    def checks(self, config):
        return [
            (
                "num_generations",
                config.num_generations >= 2,
                "GRPO needs at least 2 generations per prompt to compare them",
            ),
            ("epsilon", config.epsilon >= 0, "must be >= 0"),
            (
                "num_sampler_logprobs",
                config.num_sampler_logprobs >= 1 or not config.score_centering,
                "score centering averages over at least 1 of the sampler's tokens: must be at least 1",
            ),
            (
                "vllm_importance_sampling_clip_min",
                0 <= config.vllm_importance_sampling_clip_min <= 1,
                "must be in [0, 1] (a ratio of 1 must never be masked)",
            ),
            (
                "vllm_importance_sampling_clip_max",
                config.vllm_importance_sampling_clip_max >= 1,
                "must be >= 1 (a ratio of 1 must never be masked)",
            ),
            (
                "vllm_importance_sampling_mode",
                config.vllm_importance_sampling_mode in CORRECTION_MODES,
                f"must be one of {', '.join(CORRECTION_MODES)}",
            ),
            (
                "importance_sampling_level",
                config.importance_sampling_level in RATIO_LEVELS,
                f"must be one of {', '.join(RATIO_LEVELS)}",
            ),
            (
                "importance_sampling_level",
                config.importance_sampling_level == "token" or not config.score_centering,
                "'sequence' (GSPO) replaces the clipped surrogate's ratio: set score_centering=False with it",
            ),
        ]

    def unit_key(self, sample):
        return sample.prompt_index

    def keeps(self, rewards):
        scored = [r for r in rewards if not math.isnan(r)]  # an infinite reward leaves no finite advantage: dropped
        return len(scored) >= 2 and all(map(math.isfinite, scored)) and max(scored) > min(scored)

    def sampler_top_logprobs(self, config):
        return config.num_sampler_logprobs if config.score_centering else 0

    def objective(self, config):
        return "score_centering" if config.score_centering else "clipped_surrogate"

    def drift_fixes(self, config):
        mode = config.get("vllm_importance_sampling_mode", "token_mask")
        other = "token_truncate" if mode == "geometric_mask" else "geometric_mask"
        return [f"try vllm_importance_sampling_mode {other} (now {mode})"]


@dataclass(frozen=True)
class FlashREINFORCE(Algorithm):
    """One rollout per prompt, centred on the batch's mean reward; a trajectory trains only while its drift from the
    sampler stays inside the Sequence Trust Region (`flash_delta`). Every trajectory with a reward is kept (its
    baseline is the batch, not a group); a trajectory trains whole in one step, so one longer than a micro-batch is
    dropped (`batch/dropped_oversize_count`)."""

    name, title = "flash_reinforce", "FlashREINFORCE"
    reads = frozenset({"flash_delta", "flash_negative_token_fraction", "flash_batch_size"})
    drops_oversize_unit = True

    def checks(self, config):
        return [
            (
                "num_generations",
                config.num_generations == 1,
                "FlashREINFORCE samples one rollout per prompt: set num_generations=1",
            ),
            ("flash_delta", config.flash_delta >= 0, "the trust-region threshold must be >= 0 (inf admits everything)"),
            ("flash_negative_token_fraction", 0 <= config.flash_negative_token_fraction <= 1, "must be in [0, 1]"),
            (
                "flash_batch_size",
                config.flash_batch_size is None or config.flash_batch_size >= 1,
                "must be at least 1, or None",
            ),
            (
                "gradient_accumulation_steps",
                config.flash_batch_size is None or config.gradient_accumulation_steps == 1,
                "is not read when flash_batch_size sets the step's trajectories: leave it at 1",
            ),
        ]

    def unit_key(self, sample):
        return sample.rollout_id

    def keeps(self, rewards):
        return any(math.isfinite(r) for r in rewards)

    def units_per_step(self, config):
        return config.flash_batch_size

    def objective(self, config):
        return "flash_reinforce"

    def drift_fixes(self, config):
        return [
            f"lower flash_delta (now {config.get('flash_delta', 3e-3):g}), so that fewer drifted trajectories train"
        ]

    def plan(self, config, max_model_len, num_prompts):
        """In FlashREINFORCE's terms: B prompts a step, one rollout each, one update per batch; episodes are rollouts."""
        budget = config.token_budget or max_model_len  # the run's default token budget is the server's max_model_len
        per_row = max(1, budget // max_model_len)
        exact = config.flash_batch_size is not None
        batch = config.flash_batch_size if exact else config.gradient_accumulation_steps * per_row
        at_least = "" if exact else ">= "
        if config.max_steps > 0:
            steps = f"{config.max_steps} (max_steps)"
            episodes = f"{at_least}{config.max_steps * batch} rollouts (steps x batch)"
        elif num_prompts is not None:
            total = math.ceil(config.num_train_epochs * num_prompts)
            steps = f"<= {math.ceil(total / batch)} (episodes / batch)"
            episodes = f"{total} rollouts (num_train_epochs {config.num_train_epochs:g} x {num_prompts} prompts)"
        else:
            steps, episodes = (
                "until the data ends",
                f"num_train_epochs {config.num_train_epochs:g} x the dataset's prompts",
            )
        per_row_why = (
            f"token_budget {budget} // {max_model_len}, the longest trajectory"
            if budget >= max_model_len
            else f"token_budget {budget} < {max_model_len}: longer trajectories are dropped, "
            "batch/dropped_oversize_count"
        )
        return [
            (
                "delta",
                f"{config.flash_delta:g} (flash_delta): a trajectory trains only if its tokens' mean Bernoulli "
                "KL, sampler to policy, is at most this",
            ),
            (
                "q",
                f"{config.flash_negative_token_fraction:g} (flash_negative_token_fraction): a failed trajectory "
                "(reward 0 or less) keeps this share of its tokens, highest entropy first",
            ),
            (
                "batch",
                f"{batch} prompts a step, one rollout each (flash_batch_size), in as many rows of token_budget "
                f"{budget} as they need"
                if exact
                else f">= {batch} prompts a step, one rollout each: {config.gradient_accumulation_steps} micro-batches "
                f"(gradient_accumulation_steps) x {per_row} a row ({per_row_why}); x ranks under torchrun; more "
                "when rollouts are shorter",
            ),
            ("steps", steps),
            ("episodes", episodes),
        ]


ALGORITHMS: dict[str, Algorithm] = {algorithm.name: algorithm for algorithm in (GRPO(), FlashREINFORCE())}


def algorithm_of(config: "AsyncGRPOConfig") -> Algorithm:
    """The algorithm `config.algorithm` names; an unknown name is the user's error, with the names there are."""
    if config.algorithm not in ALGORITHMS:
        raise UsageError(f"AsyncGRPOConfig.algorithm={config.algorithm!r}: must be one of {', '.join(ALGORITHMS)}.")
    return ALGORITHMS[config.algorithm]


def refusals(config: "AsyncGRPOConfig", defaults: dict[str, object]) -> list[tuple[str, str]]:
    """(field, why) for each field set away from its default (`defaults`) that only another algorithm reads."""
    chosen = algorithm_of(config)
    return [
        (field, f"is read by {other.name} only, and algorithm={chosen.name!r}: leave it at {defaults[field]!r}")
        for other in ALGORITHMS.values()
        if other is not chosen
        for field in sorted(other.reads - chosen.reads)
        if getattr(config, field) != defaults[field]
    ]
