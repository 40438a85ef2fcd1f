"""The staleness policy, read as its table: what each max_staleness decides."""

import pytest

from tandem.config import AsyncGRPOConfig
from tandem.contract.records import Sample
from tandem.contract.staleness import StalenessPolicy, staleness

#   max     allowance  a step frees room      a sync's end   syncs may  adapter versions  adapter
# staleness (steps)    (no sync / sync runs)  frees room     overlap    kept loaded       slots
TABLE = [
    (0, 1, (False, False), False, False, 1, 2),
    (1, 1, (True, False), True, False, 2, 3),
    (2, 2, (True, True), True, True, 3, 4),
    (4, 4, (True, True), True, True, 5, 6),
]


@pytest.mark.parametrize(
    "max_staleness, steps, step_frees, sync_frees, overlap, kept, slots",
    TABLE,
    ids=[f"max_staleness={row[0]}" for row in TABLE],
)
def test_what_each_max_staleness_decides(max_staleness, steps, step_frees, sync_frees, overlap, kept, slots):
    policy = AsyncGRPOConfig(max_staleness=max_staleness).staleness_policy
    assert policy == StalenessPolicy(max_staleness)
    assert policy.allowance_steps == steps
    assert (policy.step_frees_room(sync_in_flight=False), policy.step_frees_room(sync_in_flight=True)) == step_frees
    assert policy.sync_end_frees_room is sync_frees
    assert policy.syncs_may_overlap is overlap
    assert (policy.adapter_versions_kept, policy.adapter_slots) == (kept, slots)


def test_a_sample_is_stale_once_it_lags_the_trainer_by_more_than_max_staleness():
    policy = StalenessPolicy(max_staleness=2)
    assert staleness(trainer_version=7, sample_version=5) == 2
    assert [policy.is_stale(trainer_version=7, sample_version=v) for v in (7, 6, 5, 4)] == [False, False, False, True]
    assert StalenessPolicy(max_staleness=0).is_stale(trainer_version=1, sample_version=0)


def test_a_group_on_an_older_adapter_may_find_it_unloaded():
    policy = StalenessPolicy(max_staleness=1)
    assert policy.adapter_may_be_gone(trainer_version=3, group_version=2)
    assert not policy.adapter_may_be_gone(trainer_version=3, group_version=3)


def group_sample(start_version: int, token_versions: list[int]) -> Sample:
    """A sample of a group started on `start_version` whose generated tokens came from `token_versions`."""
    return Sample(
        input_ids=[0] + [1] * len(token_versions),
        trained=[False] + [True] * len(token_versions),
        behavior_log_probs=[0.0] * (1 + len(token_versions)),
        advantage=1.0,
        model_version=start_version,
        group_id=0,
        prompt_index=0,
        group_samples=1,
        rollout_id="r",
        created_at=0.0,
        token_versions=[-1, *token_versions],
        group_token_version=sum(token_versions) / len(token_versions),
    )


def test_in_flight_weight_updates_judge_a_group_by_its_tokens_with_the_same_bound():
    """A group started on version 3 whose last 3 of 4 tokens came after the syncs to 4 and 5, trained at version 5 with
    max_staleness 1: 2 versions behind its start, 0.75 behind by its tokens (mean version 4.25)."""
    sample = group_sample(3, [3, 4, 5, 5])
    by_start, by_tokens = StalenessPolicy(1), AsyncGRPOConfig(max_staleness=1, in_flight_weight_updates=True)
    assert by_start.is_stale(5, by_start.version_of(sample)) and by_start.cancels_running_groups
    policy = by_tokens.staleness_policy
    assert policy.version_of(sample) == 4.25 and not policy.is_stale(5, policy.version_of(sample))
    assert policy.is_stale(6, policy.version_of(sample)), "the same max_staleness bounds the tokens' mean lag"
    assert not policy.cancels_running_groups, "a running group's next tokens come from the new weights"
    assert sample.trained_versions() == [3, 4, 5, 5] and sample.mixed_tokens() == 3
