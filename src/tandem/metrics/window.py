"""One logging window: everything recorded since the last log, reduced by the spec's naming rules.

The last part of a name decides: `count` is summed, `max`/`min` keep the extreme, a rate recorded as
(amount, seconds) pairs is total amount / total seconds, anything else is the mean of its values.
"""

import math
from collections import defaultdict


def reduce(name: str, values: list) -> float:
    last = name.rsplit("/", 1)[-1]
    if values and isinstance(values[0], tuple):
        amount, seconds = sum(v[0] for v in values), sum(v[1] for v in values)
        return amount / seconds if seconds > 0 else 0.0
    if "count" in last:
        return float(sum(values))
    if "max" in last:
        return float(max(values))
    if "min" in last:
        return float(min(values))
    return float(sum(values)) / len(values)


class MetricWindow:
    def __init__(self):
        self.values: dict[str, list] = defaultdict(list)

    def add(self, name: str, *values) -> None:
        self.values[name].extend(v for v in values if not (isinstance(v, float) and math.isnan(v)))

    def extend(self, records: dict[str, list]) -> None:
        for name, values in records.items():
            self.add(name, *values)

    def get(self, name: str, default=None):
        values = self.values.get(name)
        return reduce(name, values) if values else default

    def flush(self) -> dict[str, float]:
        result = {name: reduce(name, values) for name, values in self.values.items() if values and name != "completions/examples"}
        self.values = defaultdict(list)
        return result
