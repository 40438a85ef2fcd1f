"""`Metric`: one entry of the metric catalogue."""

from dataclasses import dataclass


@dataclass(frozen=True)
class Metric:
    name: str
    """The logged name, or a pattern whose `{placeholder}` stands for one path segment (a reward function's name)."""
    meaning: str
    """What it measures, with its unit."""
    reading: str = ""
    """How to read it: what a healthy value looks like, and what a bad one points to."""
