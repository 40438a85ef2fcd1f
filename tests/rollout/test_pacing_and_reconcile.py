"""Pacing rules, the metric window rules, and turn reconciliation, on hand-made numbers."""

import asyncio
from types import SimpleNamespace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tandem.contract.records import TurnRecord
from tandem.contract.staleness import StalenessPolicy
from tandem.metrics.window import MetricWindow
from tandem.rollout import pacing
from tandem.rollout.pacing import ConcurrencyCap, Room, TokenAllowance
from tandem.rollout.reconcile import reconcile
from tests.rollout.test_failures import by_reply, prompt_indices, run_loop


def test_allowance_is_max_staleness_steps_of_consumption():
    allowance = TokenAllowance(StalenessPolicy(2), full_step_tokens=1000)
    assert allowance.limit(0) == 2000, "before the first step, every row counts as full"
    assert allowance.limit(300) == 600
    assert TokenAllowance(StalenessPolicy(0), full_step_tokens=1000).limit(300) == 300


def test_a_worker_waiting_for_room_starts_the_next_group_when_the_trainer_rings(monkeypatch):
    monkeypatch.setattr(pacing, "ROOM_POLL_S", 3600.0)  # no look of its own: only a wake-up moves it on
    # An allowance of one token: each group waits until the trainer took the last one's samples and rang.
    messages, _ = run_loop(by_reply, prompts=4, settings={"full_step_tokens": 1}, max_staleness=1, timeout_s=30)
    assert sorted(set(prompt_indices(messages, "samples"))) == [0, 1, 2, 3]


def test_room_keeps_the_books_of_reservations_and_queued_tokens():
    async def main():
        consumed = SimpleNamespace(value=0.0)  # what the trainer publishes across the process boundary
        channels = SimpleNamespace(tokens_per_step=SimpleNamespace(value=1000.0), consumed_tokens=consumed)
        room = Room(TokenAllowance(StalenessPolicy(1), full_step_tokens=1000), 0.0, channels)
        assert await room.wait(600, check=lambda: None) == (pytest.approx(0, abs=0.1), None), (
            "the first group starts at once; the allowance binds only once a group finished"
        )
        room.group_ended(600)
        room.group_scored(500)
        assert (room.in_flight_tokens, room.queued_tokens()) == (0, 500)
        assert room.reservation(300) == 500, "never less than the largest recent kept group"
        assert (await room.wait(500, check=lambda: None))[1] == 1.0, "500 queued + 500 reserved: the whole allowance"

        waiting = asyncio.create_task(room.wait(1, check=lambda: None))
        await asyncio.sleep(0.05)
        assert not waiting.done(), "one token more than the allowance waits"
        consumed.value = 500  # the trainer took the queued samples and rang
        room.changed.set()
        await asyncio.wait_for(waiting, 5)

        def failed():
            raise RuntimeError("a group failed")

        with pytest.raises(RuntimeError, match="a group failed"):
            await room.wait(10_000, check=failed)

    asyncio.run(main())


def test_one_group_at_a_time_until_the_first_finishes():
    allowance = TokenAllowance(StalenessPolicy(4), full_step_tokens=10_000)
    assert allowance.may_start(0, 0, 100, 0, groups_in_flight=0, groups_finished=0)
    assert not allowance.may_start(0, 100, 100, 0, groups_in_flight=1, groups_finished=0)
    assert allowance.may_start(0, 100, 100, 0, groups_in_flight=1, groups_finished=1)


def test_allowance_blocks_when_queued_plus_in_flight_would_exceed_it():
    allowance = TokenAllowance(StalenessPolicy(1), full_step_tokens=1000)
    assert allowance.may_start(
        queued=500, in_flight=300, reservation=200, tokens_per_step=1000, groups_in_flight=1, groups_finished=3
    )
    assert not allowance.may_start(
        queued=500, in_flight=300, reservation=201, tokens_per_step=1000, groups_in_flight=1, groups_finished=3
    )
    assert allowance.may_start(
        queued=0, in_flight=0, reservation=5000, tokens_per_step=1000, groups_in_flight=0, groups_finished=3
    ), "an idle pipeline always starts a group, even one larger than the allowance"


def test_concurrency_cap_starts_at_what_fits_and_follows_kv_usage():
    cap = ConcurrencyCap(maximum=512, kv_cache_tokens=64 * 1024, max_model_len=1024)
    assert cap.value == 64
    for _ in range(40):
        cap.rollout_finished()
    assert cap.update(kv_cache_usage=0.3, waiting=0) == 80, "+25% at most"
    cap.rollout_finished()
    assert cap.update(kv_cache_usage=0.3, waiting=0) == 81, "+1: only one rollout finished since the last poll"
    assert cap.update(kv_cache_usage=0.3, waiting=2) == 81, "no raise while requests wait"
    assert cap.update(kv_cache_usage=0.9, waiting=0) == 56, "-30% above 80% usage"
    assert ConcurrencyCap(maximum=12).value == 12, "without /metrics the cap is max_concurrent_rollouts"


def test_window_reduces_by_name():
    window = MetricWindow()
    window.add("sample/dropped_stale_count", 2, 3)
    window.add("sample/staleness_max", 1, 4, 2)
    window.add("clip_ratio/low_min", 0.3, 0.1)
    window.add("rollout/generated_tokens_per_s", (100, 1.0), (300, 3.0))
    window.add("reward", 0.0, 1.0, 1.0, 0.0)
    assert window.flush() == {
        "sample/dropped_stale_count": 5.0,
        "sample/staleness_max": 4.0,
        "clip_ratio/low_min": 0.1,
        "rollout/generated_tokens_per_s": 100.0,
        "reward": 0.5,
    }
    assert window.flush() == {}


def test_turns_that_extend_the_held_tokens_make_one_sample():
    first = TurnRecord(prompt_ids=[1, 2], output_ids=[3, 4], output_log_probs=[-0.1, -0.2])
    second = TurnRecord(prompt_ids=[1, 2, 3, 4, 9, 9], output_ids=[5], output_log_probs=[-0.3])
    [seq], stats = reconcile([first, second], version=0)
    assert seq.input_ids == [1, 2, 3, 4, 9, 9, 5]
    assert seq.trained == [False, False, True, True, False, False, True], "tool results are context, never trained"
    assert seq.behavior_log_probs == [0.0, 0.0, -0.1, -0.2, 0.0, 0.0, -0.3]
    assert (stats.transitions, stats.forks) == (1, 0)


def test_a_turn_record_with_a_value_missing_for_a_token_is_refused_naming_the_field():
    """A custom loop's record must give each output token its log-prob (0.0 would be made up), and every other
    per-token field given must have one entry per token; untrained tokens need no log-prob."""
    with pytest.raises(ValueError, match="output_log_probs has 1 values for 2 output_ids"):
        TurnRecord(prompt_ids=[1], output_ids=[3, 4], output_log_probs=[-0.1])
    with pytest.raises(ValueError, match="output_log_probs has 0 values for 2 output_ids"):
        TurnRecord(prompt_ids=[1], output_ids=[3, 4])
    with pytest.raises(ValueError, match="output_mask has 1 values for 2 output_ids"):
        TurnRecord(prompt_ids=[1], output_ids=[3, 4], output_log_probs=[-0.1, -0.2], output_mask=[1])
    with pytest.raises(ValueError, match="output_token_versions has 3 values"):
        TurnRecord(prompt_ids=[1], output_ids=[3, 4], output_log_probs=[-0.1, -0.2], output_token_versions=[0, 1, 1])
    untrained = TurnRecord(prompt_ids=[1], output_ids=[3, 4], output_mask=[0, 0])
    assert reconcile([untrained], version=0)[0] == [], "an untrained turn makes no sample"


def test_each_trained_token_keeps_the_policy_version_that_sampled_it():
    """A sync between the first turn's two tokens; the second turn's record names no versions: the group's (2)."""
    first = TurnRecord(
        prompt_ids=[1, 2], output_ids=[3, 4], output_log_probs=[-0.1, -0.2], output_token_versions=[2, 3]
    )
    second = TurnRecord(prompt_ids=[1, 2, 3, 4, 9], output_ids=[5], output_log_probs=[-0.3])
    [seq], _ = reconcile([first, second], version=2)
    assert seq.token_versions == [-1, -1, 2, 3, -1, 2], "context tokens have no policy version"


def test_a_re_rendered_history_forks_a_new_sample():
    first = TurnRecord(prompt_ids=[1, 2], output_ids=[3, 4], output_log_probs=[-0.1, -0.2])
    second = TurnRecord(prompt_ids=[1, 2, 7, 9], output_ids=[5], output_log_probs=[-0.3])
    seqs, stats = reconcile([first, second], version=0)
    assert [s.input_ids for s in seqs] == [[1, 2, 3, 4], [1, 2, 7, 9, 5]]
    assert sum(sum(s.trained) for s in seqs) == 3, "every generated token is trained exactly once"
    assert (stats.forks, stats.drift_tokens) == (1, [2])


def test_a_template_that_strips_earlier_reasoning_forks_at_the_reasoning_and_trains_each_reply_once():
    """Turn 1 answered with reasoning (<think>=7, 8, </think>=9, answer 4); turn 2's prompt re-renders that reply
    without its reasoning, as Qwen3's template does, so turn 2 starts a new sample from the whole new prompt."""
    first = TurnRecord(prompt_ids=[1, 2], output_ids=[7, 8, 9, 4], output_log_probs=[-0.1] * 4)
    second = TurnRecord(prompt_ids=[1, 2, 4, 5, 6], output_ids=[7, 9, 3], output_log_probs=[-0.2] * 3)
    seqs, stats = reconcile([first, second], version=0)
    assert [s.input_ids for s in seqs] == [[1, 2, 7, 8, 9, 4], [1, 2, 4, 5, 6, 7, 9, 3]]
    assert [s.trained for s in seqs] == [[False, False, True, True, True, True], [False] * 5 + [True] * 3], (
        "the re-rendered answer is context in the fork"
    )
    assert (stats.forks, stats.drift_tokens) == (1, [4]), "the whole held reply was re-rendered"


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(0, 3), st.integers(1, 4)), min_size=1, max_size=6))
def test_every_generated_token_is_trained_in_exactly_one_sample(plan):
    """Each turn either extends the held tokens (with some context) or re-renders them (a fork); whatever the mix,
    each generated token is trained exactly once and no context token is."""
    turns, held, fresh = [], [], iter(range(1000, 100000))
    for extends, context, generated in plan:
        prompt = held + [0] * context if extends or not held else [held[0] + 1] + held[1:] + [0] * context
        output = [next(fresh) for _ in range(generated)]
        turns.append(TurnRecord(prompt_ids=prompt or [0], output_ids=output, output_log_probs=[-1.0] * generated))
        held = (prompt or [0]) + output
    seqs, _ = reconcile(turns, version=0)
    trained = [t for s in seqs for t, is_trained in zip(s.input_ids, s.trained) if is_trained]
    generated = [t for turn in turns for t in turn.output_ids]
    assert sorted(trained) == sorted(generated), "each generated token once, context never"
