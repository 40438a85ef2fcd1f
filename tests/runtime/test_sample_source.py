"""The sample source on its own: messages in, trainable samples out, with the worker's counters and the ledger
kept right. No processes: the inbox is a list and the shared counters are plain objects; `next_sample` waits for
the worker as the runtime does."""

from types import SimpleNamespace

import pytest

from tandem.contract.staleness import StalenessPolicy
from tandem.metrics.window import MetricWindow
from tandem.rollout.pacing import TokenAllowance
from tandem.rollout.worker import WorkerLost
from tandem.runtime.sample_source import ResumePoint, SampleSource, StalledError
from tandem.trainer import checkpoint
from tests.packing.samples import sample


class ListInbox:
    """The worker's messages, already waiting; None once they are all read (as a queue that stays empty)."""

    def __init__(self, *messages):
        self.messages = list(messages)

    def get(self, timeout_s):
        return self.messages.pop(0) if self.messages else None


def counters():
    rings = []
    return SimpleNamespace(
        consumed_tokens=SimpleNamespace(value=0.0),
        tokens_per_step=SimpleNamespace(value=0.0),
        watermark=SimpleNamespace(value=0),
        retry=SimpleNamespace(put=print),
        evaluate=SimpleNamespace(put=print),
        room=SimpleNamespace(ring=lambda: rings.append(1), rings=rings),
    )


def group(prompt_index, size=2, version=0, tokens=5):
    """`size` samples of one prompt index, all from policy `version`."""
    samples = [sample(range(3, 3 + tokens), group=prompt_index) for _ in range(size)]
    for s in samples:
        s.prompt_index, s.group_samples, s.model_version = prompt_index, size, version
    return samples


def source_of(*messages, start=0, max_staleness=1, token_budget=100, end=None, stall_timeout=None, resume=None):
    source = SampleSource(
        ListInbox(*messages),
        counters(),
        MetricWindow(),
        resume=resume or ResumePoint(start),
        staleness=StalenessPolicy(max_staleness),
        token_budget=token_budget,
        num_prompts=end,
        stall_timeout=stall_timeout,
    )
    source.regenerated = []
    source.counters.retry.put = source.regenerated.append
    return source


def next_sample(source, model_version=0):
    """The next trainable sample, waiting for the worker as the runtime does; None once nothing more will come."""
    while (sample := source.peek(model_version)) is None and not source.finished:
        source.wait(0)
    return sample


def test_samples_come_out_in_order_and_taking_one_frees_its_tokens_for_the_worker():
    first, second = group(0), group(1)
    source = source_of(("samples", first), ("samples", second), ("end", None))
    assert source.drain() == 4, "rollout/queue_size counts samples, not messages"
    taken = []
    while next_sample(source, 0) is not None:
        taken.append(source.take())
    assert taken == first + second
    source.publish(tokens_per_step=20)  # after the step's weight sync
    assert source.counters.consumed_tokens.value == 4 * 5


def test_the_worker_is_woken_when_room_is_freed_and_when_the_allowance_moves():
    source = source_of(("samples", group(0)), ("end", None))
    rings = source.counters.room.rings
    source.drain()
    source.release()
    assert rings == [], "nothing taken yet: no wake-up"
    next_sample(source, 0)
    source.take()
    source.release()
    assert len(rings) == 1, "a sample taken frees its tokens: the waiting worker is woken"
    source.release()
    assert len(rings) == 1, "nothing new freed: no wake-up"
    source.publish(tokens_per_step=10)
    assert len(rings) == 2, "a new allowance wakes it too"


def test_a_group_beyond_max_staleness_is_dropped_counted_and_generated_again():
    stale, fresh = group(0, version=0), group(1, version=2)
    source = source_of(("samples", stale + fresh), ("end", None), max_staleness=1)
    assert next_sample(source, 2) is fresh[0]
    assert source.window.get("sample/dropped_stale_count") == 2
    assert source.regenerated == [0], "the worker is asked to generate prompt 0 again"
    assert source.ledger.watermark == 0, "a stale drop does not finish the prompt: it was never trained"
    source.publish(tokens_per_step=0)
    assert source.counters.consumed_tokens.value == 2 * 5, "dropped samples leave the queue for good"


def test_the_run_waits_for_a_regenerated_group_even_after_the_worker_said_end():
    stale = group(0, version=0)
    source = source_of(("samples", stale), ("end", None), ("samples", group(0, version=2)), max_staleness=1)
    again = next_sample(source, 2)
    assert again is not None and again.model_version == 2, "the regenerated group is trained, not the end of the run"


def test_a_late_sample_of_a_partly_trained_group_is_dropped_alone_and_finishes_the_prompt():
    samples = group(0, size=2, version=0)
    source = source_of(("samples", samples), ("end", None), max_staleness=1)
    assert next_sample(source, 1) is samples[0]
    source.trained([source.take()])
    assert next_sample(source, 2) is None, "the second sample is now too stale"
    assert source.regenerated == [], "half the group was trained: generating it again would train the prompt twice"
    assert source.ledger.watermark == 1


def test_every_prompt_finished_ends_the_run_without_waiting_for_the_worker():
    source = source_of(("samples", group(0, size=1)), end=1)
    source.trained([source.take()] if next_sample(source, 0) else [])
    assert next_sample(source, 0) is None and source.ledger.watermark == 1


def test_a_sample_longer_than_the_token_budget_is_dropped_with_a_warning():
    source = source_of(("samples", group(0, size=1, tokens=30)), ("end", None), token_budget=20)
    with pytest.warns(UserWarning, match="30 tokens exceeds token_budget=20"):
        assert next_sample(source, 0) is None
    assert source.window.get("batch/dropped_oversize_count") == 1


def test_worker_metrics_and_skips_reach_the_worker_window_and_the_ledger():
    source = source_of(("metrics", {"reward": [1.0, 0.0]}), ("skip", 0), ("end", None))
    assert next_sample(source, 0) is None and source.ended
    assert source.worker_metrics.get("reward") == 0.5 and source.window.get("reward") is None
    assert source.ledger.finished == [0] and source.ledger.watermark == 1


def test_the_watermark_waits_for_every_sample_of_a_prompt_and_for_earlier_prompts():
    a, b = group(0, size=2), group(1, size=2)
    source = source_of(("samples", a + b), ("end", None))
    for _ in range(4):
        next_sample(source, 0)
        source.take()
    source.trained([b[0], b[1], a[0]])
    assert source.ledger.watermark == 0, "prompt 0 still has a sample in training"
    source.publish(tokens_per_step=40)
    assert source.counters.tokens_per_step.value == 40
    source.trained([a[1]])
    assert source.ledger.watermark == 2 and source.ledger.finished == [1, 0]


def test_the_ledger_runs_across_an_epoch_wrap_and_a_resume_starts_at_the_watermark():
    # Dataset of 2 rows: prompt indices 2 and 3 are epoch 1's rows 0 and 1.
    source = source_of(("samples", group(1) + group(2)), ("skip", 3), ("end", None), start=1)
    while next_sample(source, 0) is not None:
        source.trained([source.take()])
    assert source.ledger.watermark == 4 and sorted(source.ledger.finished) == [1, 2, 3]

    resumed = source_of(("samples", group(4)), ("end", None), start=source.ledger.watermark)
    assert next_sample(resumed, 0).prompt_index == 4 and resumed.ledger.watermark == 4


def train_all(source, model_version=0):
    while next_sample(source, model_version) is not None:
        source.trained([source.take()])


def test_a_resume_point_carries_the_queue_and_the_partly_trained_groups_so_no_prompt_finishes_twice():
    g0, g1, g2 = group(0), group(1), group(2)
    first = source_of(("samples", g0 + g1 + g2), ("skip", 3))
    first.drain()
    for _ in range(3):  # a step trains group 0 and half of group 1
        next_sample(first, 0)
        first.trained([first.take()])
    point = first.resume_point()
    assert (point.dataset_start_index, point.finished, point.remaining) == (1, [3], {1: 1})
    assert point.samples == [g1[1]] + g2 and point.received == {1, 2, 3} and point.queued_tokens == 3 * 5

    resumed = source_of(("samples", group(4)), ("end", None), resume=point, end=5)
    train_all(resumed)
    assert sorted(first.ledger.finished + resumed.ledger.finished) == [0, 1, 2, 3, 4], "each prompt finished once"
    assert resumed.ledger.watermark == 5


def test_a_resume_point_survives_the_checkpoint_files(tmp_path):
    queued = group(2, size=2)
    queued[0].sampler_logprobs = [{5: -0.1, 7: -2.5}, None]
    point = ResumePoint(1, finished=[3, 5], remaining={2: 1}, samples=queued)
    checkpoint.save_resume_point(tmp_path, point)
    again = checkpoint.load_resume_point(tmp_path)
    assert (again.dataset_start_index, again.finished, again.remaining) == (1, [3, 5], {2: 1})
    assert repr(again.samples) == repr(queued), "every field back as it was (NaN rewards, int token ids included)"


class LostInbox:
    """A worker that was killed: every read says so."""

    def get(self, timeout_s):
        raise WorkerLost("the rollout worker exited with code -9 without reporting an error")


def test_a_lost_worker_raises_from_the_read_and_its_replacement_goes_on_from_the_resume_point():
    source = source_of(("samples", group(0) + group(1)))
    next_sample(source)
    source.trained([source.take(), source.take()])  # group 0 trained, group 1 queued
    source.ask_evaluation(step=2, model_version=1)
    source.inbox = LostInbox()
    with pytest.raises(WorkerLost, match="code -9"):
        source.drain()
    point = source.resume_point()
    assert point.dataset_start_index == 1 and point.received == {1}, "a new worker starts after what the trainer holds"

    asked = []
    new_counters = counters()
    new_counters.evaluate.put = asked.append
    source.replace_worker(ListInbox(("samples", group(2)), ("end", None)), new_counters)
    assert asked == [(2, 1)], "the evaluation the lost worker did not answer is asked of the new one"
    assert source.drain() == 4, "the queue survives the worker (2), and the new one sends prompt 2 (2)"
    train_all(source)
    assert source.window.get("rollout/worker_restart_count") == 1
    assert source.ledger.finished == [0, 1, 2]


def test_a_worker_replaced_mid_step_leaves_out_the_groups_in_the_open_row():
    source = source_of(("samples", group(0) + group(1)))
    source.drain()
    taken = [source.take() for _ in range(3)]  # group 0 and half of group 1 in a row the step has not trained yet
    point = source.resume_point()
    assert point.received == {0, 1} and point.in_rows == [0, 1], "generating them again would train them twice"
    source.trained(taken)
    assert source.resume_point().in_rows == [], "a trained step holds nothing in rows (what a checkpoint saves)"


def test_the_worker_may_start_a_group_again_once_the_trainer_takes_what_was_queued():
    allowance = TokenAllowance(StalenessPolicy(1), full_step_tokens=20)
    samples = group(0, size=4, tokens=5)  # the worker produced 20 tokens: a whole step's worth
    source = source_of(("samples", samples), ("end", None))
    produced, reservation = 20.0, 10.0

    def may_start():
        queued = produced - source.counters.consumed_tokens.value
        return allowance.may_start(
            queued, in_flight=0, reservation=reservation, tokens_per_step=0, groups_in_flight=0, groups_finished=1
        )

    assert not may_start(), "queued tokens fill the allowance"
    next_sample(source, 0)
    source.take()
    next_sample(source, 0)
    source.take()
    assert not may_start(), "taken samples free their room only once the trainer releases it (its rows placed)"
    source.release()
    assert may_start(), "two samples taken free the 10 tokens the next group reserves"


def test_a_trainer_that_must_wait_for_the_worker_frees_the_room_it_took_at_once():
    source = source_of(("samples", group(0, size=2, tokens=5)), ("end", None))
    source.take() if next_sample(source, 0) else None
    source.take() if next_sample(source, 0) else None
    assert source.counters.consumed_tokens.value == 0
    assert next_sample(source, 0) is None
    assert source.counters.consumed_tokens.value == 10, (
        "before waiting, so a half-filled row cannot deadlock the allowance"
    )


def test_a_unit_is_the_run_of_samples_sharing_a_key_a_group_or_a_rollout():
    a, b = group(0, size=3), group(1, size=1)
    a[2].rollout_id = "other"
    source = source_of(("samples", a + b), ("end", None))
    assert source.peek_unit(0) is None, "nothing read yet: the caller waits"
    source.drain()
    assert source.peek_unit(0) == [a[0]]
    assert source.peek_unit(0, same=lambda s: s.prompt_index) == a, "the whole group of prompt 0"
    assert source.peek_unit(0, same=lambda s: s.rollout_id) == a[:2], "one rollout of it"


def test_fifty_groups_dropped_in_a_row_are_said_once_with_their_rewards_then_a_sample_starts_afresh():
    dropped = [
        m for prompt_index in range(50) for m in (("metrics", {"reward_dropped": [0.0] * 4}), ("skip", prompt_index))
    ]
    source = source_of(*dropped, ("samples", group(50)))
    said, stalls = [], []
    source.say = said.append
    while source.peek(model_version=0) is None:
        stalls.append(source.wait(0))
    assert source.peek(model_version=0).prompt_index == 50
    assert len(said) == 1, said
    assert "50 groups dropped without reward variance" in said[0] and "rewards seen: 0 x200" in said[0]
    assert [stall.groups_dropped for stall in stalls if stall] == [50], (
        "the wait returns the stall when it is said: the runtime logs the worker's metrics then"
    )
    assert source.stall.groups_dropped == 0, "a trainable sample ends the stall"


def test_a_saturated_run_that_drops_fifty_groups_before_each_sample_is_told_once_a_minute():
    dropped = [("skip", prompt_index) for prompt_index in range(50)]
    messages = dropped + [("samples", group(50))] + [("skip", 51 + p) for p in range(50)] + [("samples", group(101))]
    source = source_of(*messages)
    said = []
    source.say = said.append
    assert next_sample(source, 0).prompt_index == 50
    source.trained([source.take(), source.take()])
    assert next_sample(source, 0).prompt_index == 101
    assert len(said) == 1, "the second run of 50 dropped groups, within the minute, is not said again"


def test_a_wait_past_stall_timeout_stops_with_the_reasons():
    source = source_of(
        ("skip", 0), ("metrics", {"reward_dropped": [1.0, 1.0], "rollout/vllm_retry_count": [3]}), stall_timeout=10
    )
    source.drain()
    source.stall.waited = 11  # the trainer waited 11 s since the last trainable sample
    with pytest.raises(
        StalledError,
        match=r"no trainable sample for 11s of waiting: 1 groups dropped .*rewards seen: 1 x2; 0 failed\), "
        r"0 samples dropped stale, 0 too long for token_budget, 3 requests retried",
    ):
        next_sample(source, 0)


def test_what_the_worker_says_reaches_the_user_and_changes_nothing_else():
    source = source_of(("say", "the generation server http://h:1 has not answered for 10s"), ("samples", group(0)))
    said = []
    source.say = said.append
    assert source.drain() == 2
    assert said == ["the generation server http://h:1 has not answered for 10s"]


def test_the_pacing_allowance_before_the_first_step_counts_every_rank_full():
    from tandem.runtime.rollout_inputs import full_step_tokens

    assert full_step_tokens(token_budget=1024, gradient_accumulation_steps=2, world_size=1) == 2048
    assert full_step_tokens(token_budget=1024, gradient_accumulation_steps=2, world_size=4) == 8192, "× ranks"


def test_a_samples_time_in_the_queue_ends_when_it_is_placed_in_a_row_not_when_its_step_trained():
    import threading
    import time

    from tandem.config import AsyncGRPOConfig
    from tandem.packing import TREE
    from tandem.runtime.step_rows import StepRows

    samples = group(0)
    for s in samples:
        s.created_at = time.time() - 30  # generated half a minute before the trainer takes it
    source, window = source_of(("samples", samples), ("end", None), token_budget=100), MetricWindow()
    rows = StepRows(source, AsyncGRPOConfig(), TREE, 1, window, lambda read: read(), print, threading.Event())
    [[row]] = rows.take(version=0)
    waited = window.values["sample/time_in_queue_s"]
    assert len(waited) == 2 and all(30 <= w < 60 for w in waited)
