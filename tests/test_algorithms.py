"""The algorithms, read as a table: what GRPO and FlashREINFORCE each declare to the pipeline, and the config fields
one reads and the other refuses."""

import math
from types import SimpleNamespace

import pytest

from tandem.config import AsyncGRPOConfig
from tandem.contract.algorithms import ALGORITHMS, GRPO, FlashREINFORCE, algorithm_of
from tandem.errors import UsageError
from tandem.trainer.objectives import OBJECTIVES

SAMPLE = SimpleNamespace(prompt_index=7, rollout_id="7-2")

#          algorithm            unit trained whole   oversize unit   sampler's top tokens   units a step  objective
TABLE = [
    (GRPO(), 7, "split", 8, None, "score_centering"),
    (FlashREINFORCE(), "7-2", "dropped", 0, None, "flash_reinforce"),
]


@pytest.mark.parametrize(
    "algorithm, unit, oversize, top_logprobs, units, objective", TABLE, ids=[row[0].name for row in TABLE]
)
def test_each_algorithm_declares_what_differs(algorithm, unit, oversize, top_logprobs, units, objective):
    config = AsyncGRPOConfig(algorithm=algorithm.name, num_generations=2 if algorithm.name == "grpo" else 1)
    assert algorithm_of(config) == algorithm
    assert algorithm.unit_key(SAMPLE) == unit
    assert ("dropped" if algorithm.drops_oversize_unit else "split") == oversize
    assert algorithm.sampler_top_logprobs(config) == top_logprobs
    assert algorithm.units_per_step(config) == units
    assert algorithm.objective(config) == objective and objective in OBJECTIVES


def test_grpo_keeps_groups_whose_rewards_differ_and_flash_reinforce_every_scored_rollout():
    nan = math.nan
    #         rewards               GRPO    FlashREINFORCE
    cases = [
        ([1.0, 0.0, nan, 1.0], True, True),
        ([1.0, 1.0, 1.0], False, True),  # no signal within the group; FlashREINFORCE's baseline is the batch
        ([1.0, nan, nan], False, True),  # one scored rollout has nothing to be compared with
        ([nan], False, False),  # nothing scored
        ([math.inf, 0.0], False, True),
    ]
    for rewards, grpo, flash in cases:
        assert GRPO().keeps(rewards) is grpo, rewards
        assert FlashREINFORCE().keeps(rewards) is flash, rewards


def test_the_step_and_the_objective_follow_the_fields_the_algorithm_reads():
    assert GRPO().objective(AsyncGRPOConfig(score_centering=False)) == "clipped_surrogate"
    assert GRPO().sampler_top_logprobs(AsyncGRPOConfig(score_centering=False)) == 0
    assert GRPO().sampler_top_logprobs(AsyncGRPOConfig(num_sampler_logprobs=20)) == 20
    flash = AsyncGRPOConfig(algorithm="flash_reinforce", num_generations=1, flash_batch_size=16)
    assert algorithm_of(flash).units_per_step(flash) == 16


@pytest.mark.parametrize(
    "algorithm, field, value",
    [
        ("flash_reinforce", "epsilon", 0.3),
        ("flash_reinforce", "epsilon_high", 0.28),
        ("flash_reinforce", "score_centering", False),
        ("flash_reinforce", "num_sampler_logprobs", 20),
        ("flash_reinforce", "vllm_importance_sampling_clip_min", 0.1),
        ("flash_reinforce", "vllm_importance_sampling_clip_max", 2.0),
        ("flash_reinforce", "vllm_importance_sampling_mode", "geometric_mask"),
        ("flash_reinforce", "importance_sampling_level", "sequence"),
        ("grpo", "flash_delta", 0.01),
        ("grpo", "flash_negative_token_fraction", 0.5),
        ("grpo", "flash_batch_size", 8),
    ],
)
def test_a_field_the_chosen_algorithm_does_not_read_is_refused(algorithm, field, value):
    generations = {"flash_reinforce": 1, "grpo": 2}[algorithm]
    with pytest.raises(
        UsageError,
        match=rf"^AsyncGRPOConfig\.{field}={value!r} is read by \w+ only, and "
        rf"algorithm='{algorithm}': leave it at ",
    ):
        AsyncGRPOConfig(algorithm=algorithm, num_generations=generations, **{field: value})


def test_every_field_one_algorithm_reads_is_a_config_field_the_other_refuses():
    fields = set(AsyncGRPOConfig.__dataclass_fields__)
    for algorithm in ALGORITHMS.values():
        assert algorithm.reads <= fields, f"{algorithm.name} declares fields the config lacks"
    assert not GRPO.reads & FlashREINFORCE.reads


def test_flash_batch_size_sets_the_step_so_gradient_accumulation_steps_is_refused_beside_it():
    with pytest.raises(UsageError, match="gradient_accumulation_steps=2: is not read when flash_batch_size"):
        AsyncGRPOConfig(
            algorithm="flash_reinforce", num_generations=1, flash_batch_size=8, gradient_accumulation_steps=2
        )
    AsyncGRPOConfig(algorithm="flash_reinforce", num_generations=1, gradient_accumulation_steps=2)  # no B: it is read


def test_an_unknown_algorithm_names_the_ones_there_are():
    with pytest.raises(UsageError, match="algorithm='ppo': must be one of grpo, flash_reinforce"):
        AsyncGRPOConfig(algorithm="ppo")
