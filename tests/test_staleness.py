"""The staleness policy, read as its table: what each max_staleness decides."""

import pytest

from tandem.config import AsyncGRPOConfig
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
