"""Rows of a dataset of any kind (a `Dataset`, an `IterableDataset`, a list of dicts), read without reading it all:
what the trainer checks before training and the worker generates from."""

import itertools
from collections.abc import Iterable, Mapping, Sized
from typing import Any, Protocol


class RowTable(Protocol):
    """A dataset with a length, read by index: a `datasets.Dataset`, a list of dict rows."""

    def __len__(self) -> int: ...

    def __getitem__(self, index: int, /) -> Mapping[str, Any]: ...


Rows = RowTable | Iterable[Mapping[str, Any]]
"""A dataset of prompt rows: one with a length, or one read in order only (an IterableDataset, a generator)."""


def is_iterable(dataset) -> bool:
    """A dataset read in order only (no length): an IterableDataset, streamed or not."""
    return dataset is not None and not isinstance(dataset, Sized)


def first_rows(dataset, count: int) -> list[dict]:
    """The dataset's first `count` rows, whatever its kind (an IterableDataset is read that far, no further)."""
    if dataset is None:
        return []
    if is_iterable(dataset):
        return [dict(row) for row in itertools.islice(dataset, count)]
    return [dict(dataset[i]) for i in range(min(count, len(dataset)))]


def columns_of(dataset) -> list[str]:
    return getattr(dataset, "column_names", None) or list(next(iter(first_rows(dataset, 1)), {}))
