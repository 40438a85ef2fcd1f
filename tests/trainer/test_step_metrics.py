"""What a trained step records about its samples: metrics defined over trained samples."""

import dataclasses

import pytest

from tandem.metrics.window import MetricWindow
from tandem.packing import pack
from tandem.trainer.step_metrics import record_samples
from tests.packing.samples import sample


def test_reward_kept_and_the_group_stds_are_averaged_over_trained_samples():
    # Group 0 trains three samples (a rollout forked into two, and one more), group 1 one: each sample counts once,
    # not each group, as the metric catalogue defines reward_kept, reward_group_std and rewards/{f}/group_std.
    group_0 = [
        dataclasses.replace(
            sample([5, 6, 7], group=0), reward=r, group_reward_std=0.5, source_group_stds={"accuracy": 0.5}
        )
        for r in (1.0, 1.0, 0.0)
    ]
    group_1 = [
        dataclasses.replace(
            sample([8, 9], group=1), reward=0.0, group_reward_std=0.1, source_group_stds={"accuracy": 0.1}
        )
    ]
    window = MetricWindow()
    record_samples(window, [pack(group_0), pack(group_1)], model_version=0)
    metrics = window.flush()
    assert metrics["reward_kept"] == pytest.approx(0.5)
    assert metrics["reward_group_std"] == pytest.approx((3 * 0.5 + 0.1) / 4), "per trained sample, not per group"
    assert metrics["rewards/accuracy/group_std"] == pytest.approx((3 * 0.5 + 0.1) / 4)
    assert "sample/time_in_queue_s" not in metrics, "measured when the runtime takes a sample, not after its step"
