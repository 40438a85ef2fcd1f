"""The run's prompts by their index in its stream: what the rollout loop generates for, and what a prompt generated
again reads.

A dataset with a length is indexed: prompt index p is row p mod len of epoch p div len, in the dataset's order or in
an order drawn for each epoch (train_sampling_strategy 'random'). An IterableDataset (a streamed Hub dataset, a
generator) has no length: it is read in its own order, one prompt index per row, and from its start again when it
ends (the next epoch); the rows of prompt indices the trainer has not finished are kept, since such a prompt may be
generated again. A resumed run reads past the examples its checkpoint consumed. Without a dataset (environments
that make their own tasks) every prompt index is an empty row of epoch 0.
"""

import dataclasses
import functools
import random
from collections.abc import Iterator, Mapping, Sized
from typing import Any

from tandem.dataset_rows import Rows


@dataclasses.dataclass
class PromptRow:
    epoch: int
    row_index: int
    """The dataset row (a dataset with a length), or the row's place in its epoch (an IterableDataset)."""
    row: dict
    epoch_start: bool
    """The first prompt index of its epoch."""


RECENT_ROWS = 4096
"""Prompt indices whose rows a PromptStream keeps: more than most runs have in flight (an evicted one is read again)."""


@functools.lru_cache(maxsize=4)
def epoch_order(seed: int, epoch: int, num_rows: int) -> list[int]:
    """The rows of one epoch in a shuffled order, the same for a seed wherever (and however often) it is drawn."""
    return random.Random(f"{seed}:{epoch}").sample(range(num_rows), num_rows)


class PromptStream:
    def __init__(self, dataset: Rows | None, order_seed: int | None = None, start: int = 0):
        """`order_seed`: shuffle each epoch of a dataset with a length from this seed; None keeps its order. `start`:
        the prompt indices below it are finished (a resumed run's), so an IterableDataset's rows there are read past."""
        self.dataset, self.order_seed = dataset, order_seed
        self.kept: dict[int, PromptRow] = {}
        """An IterableDataset's rows read and not yet forgotten, by prompt index."""
        self.floor = start
        """Rows below this prompt index are not kept: the trainer finished them."""
        self.read_to = 0
        """The next prompt index an IterableDataset's reader yields."""
        self.rows: Iterator[Mapping[str, Any]] | None = None
        self.epoch = self.index = 0
        self.recent: dict[int, PromptRow] = {}
        """A dataset with a length: the rows of the prompts read last (a group reads its prompt's row up to 3 times,
        and one `Dataset[i]` costs ~0.3 ms: 10% of the demo's rollout worker)."""

    def at(self, prompt_index: int) -> PromptRow:
        if self.dataset is None:
            return PromptRow(0, prompt_index, {}, prompt_index == 0)
        if not isinstance(self.dataset, Sized):  # an IterableDataset: read in order only
            return self._streamed(prompt_index)
        if prompt_index not in self.recent:
            if len(self.recent) >= RECENT_ROWS:
                del self.recent[next(iter(self.recent))]  # the oldest
            epoch, index = divmod(prompt_index, len(self.dataset))
            first = index == 0
            if self.order_seed is not None:
                index = epoch_order(self.order_seed, epoch, len(self.dataset))[index]
            self.recent[prompt_index] = PromptRow(epoch, index, dict(self.dataset[index]), first)
        kept = self.recent[prompt_index]
        return dataclasses.replace(kept, row=dict(kept.row))

    def forget_below(self, prompt_index: int) -> None:
        """The trainer finished every prompt index below `prompt_index`: their rows are not needed again."""
        self.floor = max(self.floor, prompt_index)
        for old in [p for p in self.kept if p < prompt_index]:
            del self.kept[old]

    def _streamed(self, prompt_index: int) -> PromptRow:
        if prompt_index in self.kept:
            return self.kept[prompt_index]
        if prompt_index < max(self.read_to, self.floor):
            raise RuntimeError(
                f"prompt {prompt_index} of the IterableDataset was read and forgotten (the trainer "
                "had finished it), yet it is asked for again"
            )
        while self.read_to <= prompt_index:
            row = self._read()
            if self.read_to >= self.floor:
                self.kept[self.read_to] = row
            self.read_to += 1
        return self.kept[prompt_index]

    def _read(self) -> PromptRow:
        """The stream's next row; at its end, the first row of the next epoch."""
        if self.rows is None:
            dataset = self.dataset
            assert dataset is not None and not isinstance(dataset, Sized)  # only an IterableDataset is streamed
            if hasattr(dataset, "set_epoch"):  # a shuffled IterableDataset draws each epoch's order from it
                dataset.set_epoch(self.epoch)
            self.rows = iter(dataset)
        try:
            row = next(self.rows)
        except StopIteration:
            if self.index == 0:
                raise ValueError("train_dataset, an IterableDataset, yields no rows") from None
            self.epoch, self.index, self.rows = self.epoch + 1, 0, None
            return self._read()
        self.index += 1
        return PromptRow(self.epoch, self.index - 1, dict(row), self.index == 1)
