"""One logging window: everything recorded since the last log, reduced by an explicit rule per name.

The rule (the metric catalogue's window rule) comes from the last part of a name, split on `_` into
exact tokens, never from substrings (`mean_terminated_length` is a mean although "terminated" contains
"min"):

    ends in `per_s`          rate: recorded as (amount, seconds) pairs, total amount / total seconds
    `effective_sample_size`  pooled: recorded as (Σw, Σw², N) triples, (ΣΣw)² / (ΣN · ΣΣw²)
    a token `count`          summed
    a token `max` / `min`    the extreme
    anything else            the mean (a `_per_step` value is recorded once per step: the mean per step)
"""

import math
from collections import defaultdict

SUM, MAX, MIN, RATE, POOLED, MEAN = "sum", "max", "min", "rate", "pooled", "mean"
TUPLED = (RATE, POOLED)
"""The rules whose values are recorded as tuples of sums."""
EXAMPLES = "completions/examples"
"""(prompt, completion, reward) triples kept for the console's printout: never reduced or logged."""


def rule_for(name: str) -> str:
    """How the values of `name` recorded in one window become one number."""
    tokens = name.rsplit("/", 1)[-1].split("_")
    if tokens[-2:] == ["per", "s"]:
        return RATE
    if tokens[-3:] == ["effective", "sample", "size"]:
        return POOLED
    if "count" in tokens:
        return SUM
    if "max" in tokens:
        return MAX
    if "min" in tokens:
        return MIN
    return MEAN


def reduce(name: str, values: list) -> float:
    """The window's values of `name` as one number, by the name's rule."""
    rule = rule_for(name)
    if rule == RATE:
        amount, seconds = sum(v[0] for v in values), sum(v[1] for v in values)
        return amount / seconds if seconds > 0 else 0.0
    if rule == POOLED:
        total, squares, count = (sum(v[i] for v in values) for i in range(3))
        return total**2 / (count * squares) if squares > 0 else float("nan")
    if rule == SUM:
        return float(sum(values))
    if rule == MAX:
        return float(max(values))
    if rule == MIN:
        return float(min(values))
    return float(sum(values)) / len(values)


def check_values(name: str, values) -> None:
    """A rate takes (amount, seconds) pairs, an effective sample size (Σw, Σw², N) triples, and nothing else takes
    tuples; a mismatch is a recording mistake, named here (the rollout loop checks its records when they are made,
    so that the error points at the code that made them)."""
    tupled = rule_for(name) in TUPLED
    if name != EXAMPLES and any(isinstance(v, tuple) != tupled for v in values):
        raise ValueError(
            f"metric {name!r}: rates (names ending in _per_s) are recorded as (amount, seconds) pairs, effective "
            f"sample sizes as (Σw, Σw², N) triples and other metrics as numbers; got {values[:3]!r}"
        )


class MetricWindow:
    def __init__(self):
        self.values: dict[str, list] = defaultdict(list)

    def add(self, name: str, *values) -> None:
        """Record values of `name`; NaN values are left out."""
        check_values(name, values)
        self.values[name].extend(v for v in values if not (isinstance(v, float) and math.isnan(v)))

    def extend(self, records: dict[str, list]) -> None:
        for name, values in records.items():
            self.add(name, *values)

    def get(self, name: str, default=None):
        values = self.values.get(name)
        return reduce(name, values) if values else default

    def take(self) -> dict[str, list]:
        """The values recorded so far, unreduced, leaving the window empty (to be merged into another window)."""
        values, self.values = dict(self.values), defaultdict(list)
        return values

    def flush(self) -> dict[str, float]:
        result = {name: reduce(name, values) for name, values in self.values.items() if values and name != EXAMPLES}
        self.values = defaultdict(list)
        return result
