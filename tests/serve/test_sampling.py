"""The processed distribution: each filter checked against a direct, unvectorised reading of its rule."""

import math

import pytest
import torch

from tandem.serve.sampling import SamplingParams, apply_penalties, process_logits, sample


def kept(row: torch.Tensor) -> set[int]:
    return set(torch.isfinite(row).nonzero().flatten().tolist())


def reference_kept(logits: list[float], p: SamplingParams) -> set[int]:
    """min_p, then top-k, then top-p, written out over plain Python floats."""
    scaled = [x / p.temperature for x in logits]
    alive = set(range(len(scaled)))
    if p.min_p > 0:
        z = sum(math.exp(x) for x in scaled)
        probs = [math.exp(x) / z for x in scaled]
        alive = {i for i in alive if probs[i] >= p.min_p * max(probs)}
    if p.top_k > 0:
        kth = sorted((scaled[i] for i in alive), reverse=True)[min(p.top_k, len(alive)) - 1]
        alive = {i for i in alive if scaled[i] >= kth}
    if p.top_p < 1:
        z = sum(math.exp(scaled[i]) for i in alive)
        probs = {i: math.exp(scaled[i]) / z for i in alive}
        # drop the least likely tokens while their total mass stays <= 1 - top_p (never the most likely)
        dropped = {i for i in alive if sum(q for q in probs.values() if q <= probs[i]) <= 1 - p.top_p}
        alive -= dropped if dropped != alive else set()
    return alive


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0.7),
        SamplingParams(top_k=5),
        SamplingParams(top_p=0.8),
        SamplingParams(min_p=0.05),
        SamplingParams(temperature=1.3, top_k=20, top_p=0.9, min_p=0.01),
    ],
)
def test_processed_support_matches_the_rules(params):
    torch.manual_seed(0)
    logits = torch.randn(8, 64) * 3
    processed = process_logits(logits.clone(), [params] * 8)
    for row in range(8):
        assert kept(processed[row]) == reference_kept(logits[row].tolist(), params), f"row {row} support differs"
        finite = processed[row][torch.isfinite(processed[row])]
        expected = (logits[row] / params.temperature)[sorted(kept(processed[row]))]
        assert torch.allclose(finite, expected), "kept logits must only be divided by the temperature"


def test_greedy_rows_are_untouched_and_take_the_argmax():
    logits = torch.tensor([[0.1, 2.0, -1.0, 1.9]])
    greedy = SamplingParams(temperature=0.0, top_k=1, top_p=0.1)
    greedy.top_k, greedy.top_p = 0, 1.0  # the server resets these for greedy requests
    processed = process_logits(logits.clone(), [greedy])
    assert torch.equal(processed, logits)
    assert sample(processed, [greedy], [torch.Generator()]).tolist() == [1]


def test_rows_with_different_settings_in_one_batch_are_independent():
    torch.manual_seed(1)
    logits = torch.randn(3, 32)
    settings = [SamplingParams(top_k=3), SamplingParams(), SamplingParams(top_p=0.5)]
    together = process_logits(logits.clone(), settings)
    for row, p in enumerate(settings):
        assert torch.equal(together[row], process_logits(logits[row : row + 1].clone(), [p])[0])


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits():
    logits = torch.tensor([2.0, -2.0, 1.0, 0.5])
    out = apply_penalties(logits.clone(), SamplingParams(repetition_penalty=2.0), prompt=[0], output=[1])
    assert out.tolist() == [1.0, -4.0, 1.0, 0.5]


def test_presence_and_frequency_penalties_count_output_tokens_only():
    logits = torch.zeros(4)
    out = apply_penalties(
        logits, SamplingParams(presence_penalty=0.5, frequency_penalty=0.25), prompt=[3], output=[1, 1, 2]
    )
    assert out.tolist() == [0.0, -1.0, -0.75, 0.0]


def test_same_generator_seed_gives_the_same_samples():
    probs_logits = torch.randn(4, 50)
    p = [SamplingParams()] * 4
    a = sample(probs_logits, p, [torch.Generator().manual_seed(i) for i in range(4)])
    b = sample(probs_logits, p, [torch.Generator().manual_seed(i) for i in range(4)])
    assert torch.equal(a, b)


def test_samples_follow_the_processed_distribution_and_never_take_a_removed_token():
    """Each row draws with its own generator; over many draws the frequencies match the probabilities (a 5-sigma
    band per token) and tokens the filters removed (-inf) are never drawn, wherever they sit in the vocabulary."""
    logits = torch.tensor(
        [[2.0, float("-inf"), 0.5, 1.0, float("-inf")], [float("-inf"), 0.0, 0.0, 3.0, float("-inf")]]
    )
    draws = 20000
    rows = logits.repeat(draws // 2, 1)
    tokens = sample(rows, [SamplingParams()] * draws, [torch.Generator().manual_seed(i) for i in range(draws)])
    for r in range(2):
        counts = torch.bincount(tokens[r::2], minlength=5).double()
        probs = logits[r].softmax(-1).double()
        n = draws // 2
        assert (counts[probs == 0] == 0).all(), f"row {r} drew a removed token: {counts.tolist()}"
        band = 5 * (n * probs * (1 - probs)).sqrt()
        assert ((counts - n * probs).abs() <= band + 1e-9).all(), (
            f"row {r}: counts {counts.tolist()}, expected {(n * probs).tolist()}"
        )
