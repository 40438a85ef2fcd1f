"""Every metric name a run logs to `metrics.jsonl` (and to tensorboard / wandb / trackio), with what it measures and
how to read it. Names built at run time are patterns: `{source}` or `{tool}` stands for one path segment."""

import re

from tandem.metrics.catalogue.learning import LEARNING
from tandem.metrics.catalogue.metric import Metric
from tandem.metrics.catalogue.operations import OPERATIONS
from tandem.metrics.catalogue.pipeline import PIPELINE

METRICS = (*LEARNING, *PIPELINE, *OPERATIONS)


def _pattern(name: str) -> re.Pattern:
    """A catalogue name as a regular expression: each `{placeholder}` matches one path segment."""
    return re.compile("[^/]+".join(re.escape(part) for part in re.split(r"\{[^{}/]+\}", name)) + r"\Z")


_EXACT = {metric.name: metric for metric in METRICS if "{" not in metric.name}
_PATTERNS = [(_pattern(metric.name), metric) for metric in METRICS if "{" in metric.name]


def find(name: str) -> Metric | None:
    """The catalogue entry of a logged name (`rewards/accuracy_reward/mean` finds `rewards/{source}/mean`), or None."""
    if name in _EXACT:
        return _EXACT[name]
    return next((metric for pattern, metric in _PATTERNS if pattern.match(name)), None)
