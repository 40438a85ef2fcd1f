"""Rows as prefix tries: a worked example, sharing rules, and what a row costs."""

import torch

from tandem.packing import PADDED, TrieRow, pack

from .samples import sample

P1, P2, P3, A1, A2, B1, B2 = 11, 12, 13, 21, 22, 31, 32


def test_the_worked_example():
    """The worked example: two rollouts p1 p2 p3 a1 a2 / p1 p2 p3 b1 b2."""
    r0 = sample([P1, P2, P3, A1, A2], [0, 0, 0, 1, 1])
    r1 = sample([P1, P2, P3, B1, B2], [0, 0, 0, 1, 1])
    row = pack([r0, r1])
    assert row.input_ids.tolist() == [P1, P2, P3, A1, A2, P3, B1, B2]  # p3 is not shared: it predicts a1 or b1
    assert row.position_ids.tolist() == [0, 1, 2, 3, 4, 2, 3, 4]
    assert row.predict_index.tolist() == [2, 3, 5, 6]  # a1 a2 at 2 3, b1 b2 at 5 6
    assert row.targets.tolist() == [A1, A2, B1, B2]
    assert row.term_sample.tolist() == [0, 0, 1, 1]
    assert (row.raw_tokens, row.num_tokens) == (10, 8)
    # Attention: S0 = [0 1] is seen by everything below it; S1 = [2 3 4] and S2 = [5 6 7] only by themselves.
    assert row.end.tolist() == [7, 7, 4, 4, 4, 7, 7, 7]


def test_three_samples_branch_one_token_before_they_differ():
    rows = [sample([1, 2, 3, 10, 11]), sample([1, 2, 3, 10, 12, 13]), sample([1, 2, 3, 20])]
    row = pack(rows)
    # Segments [1 2] [3] [10 11] [10 12 13] [3 20]: the shared "3 -> 10" node serves two samples.
    assert row.input_ids.tolist() == [1, 2, 3, 10, 11, 10, 12, 13, 3, 20]
    assert row.position_ids.tolist() == [0, 1, 2, 3, 4, 3, 4, 5, 2, 3]
    assert row.end.tolist() == [9, 9, 7, 4, 4, 7, 7, 7, 9, 9]
    first_terms = row.predict_index[row.term_sample < 2].tolist()
    assert first_terms[:4] == [0, 1, 2, 3] and first_terms.count(2) == 2


def test_samples_sharing_nothing_are_plain_padding_free_packing():
    row = pack([sample([5, 6, 7]), sample([8, 9])])
    assert row.input_ids.tolist() == [5, 6, 7, 8, 9]
    assert row.position_ids.tolist() == [0, 1, 2, 0, 1]
    assert row.end.tolist() == [2, 2, 2, 4, 4]
    assert row.packing_ratio == 1.0


def test_without_sharing_identical_samples_stay_apart():
    row = pack([sample([5, 6, 7]), sample([5, 6, 7])], share_prefixes=False)
    assert row.input_ids.tolist() == [5, 6, 7, 5, 6, 7]
    assert row.predict_index.tolist() == [0, 1, 3, 4]


def test_a_padded_row_lays_its_samples_side_by_side_padded_to_the_longest():
    """The layout of models a tree row would change: nothing shared, each sample one right-padded sequence."""
    row = pack([sample([5, 6, 7]), sample([5, 6])], layout=PADDED)
    assert row.input_ids.tolist() == [5, 6, 7, 5, 6, 0]
    assert row.position_ids.tolist() == [0, 1, 2, 0, 1, 2]
    assert row.predict_index.tolist() == [0, 1, 3]  # the second sample starts at its block, index 3
    assert row.end.tolist() == [2, 2, 2, 5, 5, 5]  # as a tree: each block sees only itself, causally
    assert (row.raw_tokens, row.num_tokens, row.load) == (5, 6, 12)


def test_duplicates_share_every_token_but_keep_their_own_terms():
    row = pack([sample([5, 6, 7], advantage=1.0), sample([5, 6, 7], advantage=-1.0)])
    assert row.input_ids.tolist() == [5, 6, 7]
    assert row.predict_index.tolist() == [0, 1, 0, 1]
    assert row.advantages.tolist() == [1.0, 1.0, -1.0, -1.0]


def test_a_later_turn_extends_the_earlier_one():
    """Multi-turn: turn 2's sample repeats turn 1's conversation; only the last token of turn 1 is duplicated."""
    turn1 = sample([1, 2, 3, 4], [0, 0, 1, 1])
    turn2 = sample([1, 2, 3, 4, 7, 8, 9], [0, 0, 0, 0, 0, 1, 1])
    row = pack([turn1, turn2])
    assert row.input_ids.tolist() == [1, 2, 3, 4, 4, 7, 8, 9]
    assert row.behavior_log_probs.numel() == 4


def test_insertion_cost_counts_shared_tokens_once():
    row = TrieRow()
    row.add(sample([1, 2, 3, 4], [0, 0, 1, 1]))
    cost = row.cost(sample([1, 2, 3, 5], [0, 0, 1, 1]))
    # [1 2] are shared; 3 is not (it is followed by 5 now): 2 new tokens at depths 2 and 3.
    assert (cost.new_tokens, cost.new_terms, cost.new_load) == (2, 2, 3 + 4)
    assert (row.num_tokens, row.num_terms, row.load) == (4, 2, 1 + 2 + 3 + 4)


def test_kept_sets_travel_with_their_terms():
    masked = sample([1, 2, 3], sampling_mask=[None, [2, 9], [3]])
    row = pack([masked])
    assert row.sampling_mask.tolist() == [[2, 9], [3, -1]]
    assert pack([sample([1, 2, 3])]).sampling_mask is None


def test_tensors_have_the_documented_types():
    row = pack([sample([1, 2, 3])])
    assert row.input_ids.dtype == row.predict_index.dtype == torch.long
    assert row.behavior_log_probs.dtype == row.advantages.dtype == torch.float32
