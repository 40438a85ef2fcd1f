"""Window rules: every metric name of catalogue.tsv is reduced as it states, and each of those names has its entry in
the metrics catalogue (tandem.metrics.catalogue) that the docs' metrics reference is generated from."""

from pathlib import Path

import pytest

from tandem.metrics.catalogue import find
from tandem.metrics.window import MAX, MEAN, MIN, POOLED, RATE, SUM, MetricWindow, rule_for

CATALOGUE = Path(__file__).with_name("catalogue.tsv")
PLACEHOLDERS = {"{func}": ["accuracy_reward", "count_max_min"], "{tool}": ["search", "max_count"]}
"""Sample names for the catalogue's placeholders; the second of each shows a name's middle parts don't decide."""


def expand(names):
    for placeholder, samples in PLACEHOLDERS.items():
        names = {n.replace(placeholder, s) for n in names for s in samples}
    return names


def catalogue() -> dict[str, str]:
    """{metric name: the window rule the catalogue states for it}, placeholders expanded (catalogue.tsv)."""
    rows = [line.split("\t") for line in CATALOGUE.read_text().splitlines() if line and not line.startswith("#")]
    return {name: rule for pattern, rule in rows for name in expand({pattern})}


def test_every_name_whose_rule_is_stated_here_is_in_the_metrics_catalogue():
    undocumented = sorted(name for name in catalogue() if find(name) is None)
    assert not undocumented, f"names with a window rule here but no entry in tandem.metrics.catalogue: {undocumented}"


def test_the_catalogue_is_whole():
    names = catalogue()
    for expected in (
        "reward",
        "num_tokens",
        "completions/min_terminated_length",
        "rewards/accuracy_reward/group_std",
        "tools/search/call_count",
        "sampling/importance_sampling_ratio/mean",
        "sampling/sampling_logp_difference/max",
        "batch/dropped_oversize_count",
        "perf/weight_sync_barrier_s",
        "rollout/generated_tokens_per_s",
    ):
        assert expected in names
    assert len(names) > 100 and set(names.values()) == {SUM, MAX, MIN, RATE, MEAN}


def test_every_catalogue_name_has_its_documented_rule():
    wrong = {n: (rule_for(n), rule) for n, rule in sorted(catalogue().items()) if rule_for(n) != rule}
    assert not wrong, f"name: (rule, documented rule): {wrong}"


@pytest.mark.parametrize(
    "name, rule",
    [
        ("completions/mean_terminated_length", MEAN),
        ("completions/min_terminated_length", MIN),
        ("completions/max_length", MAX),
        ("tools/search/call_count", SUM),
        ("sample/staleness_max", MAX),
        ("clip_ratio/low_min", MIN),
        ("sampling/importance_sampling_ratio/max", MAX),
        ("sampling/importance_sampling_ratio/mean", MEAN),
        ("batch/trained_tokens_per_step", MEAN),
        ("perf/wall_clock_trained_tokens_per_s", RATE),
        ("rewards/count_max_min/mean", MEAN),
        ("sampling/effective_sample_size", POOLED),
        ("sampling/mismatch_kl", MEAN),
    ],
)
def test_the_rule_reads_exact_words_of_the_last_part(name, rule):
    assert rule_for(name) == rule


def test_every_catalogue_name_is_reduced_by_its_rule():
    window, expected = MetricWindow(), {}
    for name, rule in catalogue().items():
        if rule == RATE:
            window.add(name, (100, 1.0), (300, 3.0), (0, 0.0))
            expected[name] = 100.0
        else:
            window.add(name, 1.0, 5.0, float("nan"), 3.0)  # NaN is left out
            expected[name] = {SUM: 9.0, MAX: 5.0, MIN: 1.0, MEAN: 3.0}[rule]
    assert window.get("completions/mean_terminated_length") == 3.0
    assert window.flush() == expected
    assert window.flush() == {}


def test_a_rate_takes_pairs_and_nothing_else_does():
    window = MetricWindow()
    with pytest.raises(ValueError, match="'perf/fwd_bwd_trained_tokens_per_s'.*pairs"):
        window.add("perf/fwd_bwd_trained_tokens_per_s", 12.0)
    with pytest.raises(ValueError, match="'perf/step_s'"):
        window.add("perf/step_s", (1, 2.0))
    window.extend({"completions/examples": [("prompt", "completion", 1.0)], "reward": [0.5]})
    assert window.flush() == {"reward": 0.5}, "examples are kept for printing, never logged"


def test_an_effective_sample_size_pools_its_sums_over_the_window():
    """(Σw)² / (N·Σw²) over every token of the window, not the mean of each record's: weights 1, 1 then 2, 0."""
    window = MetricWindow()
    window.add("sampling/effective_sample_size", (2.0, 2.0, 2), (2.0, 4.0, 2))
    assert window.flush() == {"sampling/effective_sample_size": 16 / (4 * 6)}
    with pytest.raises(ValueError, match="triples"):
        window.add("sampling/effective_sample_size", 0.9)
