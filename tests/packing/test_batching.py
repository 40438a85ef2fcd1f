"""The token-budget batcher: shared tokens count once, groups stay together, rows stay balanced."""

import pytest

from tandem.packing import PADDED
from tandem.packing.batching import TokenBudgetBatcher
from tests.packing.samples import sample

PROMPT = [1, 2, 3, 4, 5, 6]


def rollout(group, *completion, prompt=PROMPT):
    return sample(prompt + list(completion), [False] * len(prompt) + [True] * len(completion), group=group)


def test_shared_prompt_tokens_count_once_against_the_budget():
    batcher = TokenBudgetBatcher(token_budget=11)
    assert batcher.offer(rollout(0, 10, 11))  # 8 unique tokens
    assert batcher.offer(rollout(0, 20, 21))  # shares 5 of its 8 tokens: 11 unique, 16 raw
    assert not batcher.offer(rollout(0, 30, 31))  # 3 more would make 14
    (row,) = batcher.close()
    assert (row.num_tokens, row.raw_tokens) == (11, 16)
    assert batcher.empty


def test_in_the_padded_layout_the_budget_counts_every_sample_padded_to_the_longest():
    batcher = TokenBudgetBatcher(token_budget=24, layout=PADDED)
    assert batcher.offer(rollout(0, 10, 11))  # 8 tokens
    assert batcher.offer(rollout(0, 20))  # 7 tokens, padded to 8: nothing shared, 16 in all
    assert not batcher.offer(rollout(0, 30, 31, 32))  # 9 tokens would widen all three to 27
    assert batcher.offer(rollout(0, 40, 41))  # 24
    (row,) = batcher.close()
    assert (row.num_tokens, row.raw_tokens, row.layout) == (24, 23, PADDED)


def test_loss_terms_are_bounded_by_the_budget_too():
    batcher = TokenBudgetBatcher(token_budget=9)
    assert batcher.offer(rollout(0, 10, 11, 12))  # 9 tokens, 3 terms
    for _ in range(2):
        assert batcher.offer(rollout(0, 10, 11, 12))  # duplicates add no tokens, 3 terms each
    assert not batcher.offer(rollout(0, 10, 11, 12))  # a 4th copy would make 12 terms


def test_a_group_joins_the_row_that_holds_its_prompt():
    batcher = TokenBudgetBatcher(token_budget=100, num_rows=2)
    batcher.offer(rollout(0, 10))
    batcher.offer(rollout(1, 10, prompt=[7, 8, 9]))  # a new group takes the empty (least-loaded) row
    batcher.offer(rollout(0, 11))
    batcher.offer(rollout(1, 11, prompt=[7, 8, 9]))
    rows = batcher.close()
    assert [sorted({s.group_id for s in row.samples}) for row in rows] == [[0], [1]]
    assert [len(row.samples) for row in rows] == [2, 2]


def test_a_full_home_row_sends_the_sample_to_an_empty_row():
    batcher = TokenBudgetBatcher(token_budget=8, num_rows=2)
    assert batcher.offer(rollout(0, 10, 11))  # row 0 full (8 tokens)
    assert batcher.offer(rollout(0, 20, 21))  # row 1 is empty: it goes there
    assert [len(r.samples) for r in batcher.close()] == [1, 1]


def test_a_full_home_row_closes_the_micro_batch_rather_than_overload_another():
    batcher = TokenBudgetBatcher(token_budget=13, num_rows=2)
    assert batcher.offer(rollout(0, 10, 11))  # row 0: group 0, load 1+...+8 = 36
    assert batcher.offer(rollout(1, 7))  # row 1 (least loaded): group 1, 7 tokens, load 28
    assert batcher.offer(rollout(0, 20, 21))  # row 0 again, sharing the prompt: 11 tokens, load 57
    # Group 0's row is full. Row 1 has room (7 + 6 new tokens) but its load would reach 28 + 51 = 79 > 57.
    assert not batcher.offer(rollout(0, 30, 31, 32, 33, 34))
    assert [len(r.samples) for r in batcher.close()] == [2, 1]


def test_no_row_of_a_micro_batch_is_empty():
    batcher = TokenBudgetBatcher(token_budget=50, num_rows=4)
    batcher.offer(rollout(0, 10))
    assert len(batcher.close()) == 1
    assert batcher.close() == []


def test_a_budget_below_one_token_is_refused():
    with pytest.raises(ValueError, match="token_budget=0"):
        TokenBudgetBatcher(token_budget=0)


def test_a_group_is_placed_whole_or_not_at_all():
    batcher = TokenBudgetBatcher(token_budget=12)
    assert batcher.offer(sample(range(3, 9), group=0))
    group = [sample(range(20, 25), group=1), sample(range(30, 35), group=1)]
    assert not batcher.offer_together(group), "6 + 5 + 5 unique tokens exceed the budget of 12"
    [row] = batcher.close()
    assert [s.group_id for s in row.samples] == [0], "nothing of the refused group stays behind"
