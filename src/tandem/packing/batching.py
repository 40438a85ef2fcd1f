"""The token-budget batcher: which samples go into which row of a micro-batch.

A micro-batch has one row per rank. A row holds at most `token_budget` unique tokens (a prefix shared
by several samples counts once) and as many loss terms. A sample goes to the least-loaded row that
already holds its group (so its prompt is shared) when it fits there; when it does not, to another row
only if that row is empty or would stay under the most loaded row, which sets the micro-batch's time;
a sample of a new group goes to the least-loaded row it fits. When nothing fits, the micro-batch closes.
`max_samples` (per_device_train_batch_size) caps the samples of a row as well.
In the padded layout (models a tree row would change) a row's tokens are its samples padded to the longest.
"""

from tandem.contract.records import Sample
from tandem.metrics.window import MetricWindow
from tandem.packing import TREE, PackedRow, TrieRow


class TokenBudgetBatcher:
    def __init__(
        self,
        token_budget: int,
        num_rows: int = 1,
        share_prefixes: bool = True,
        layout: str = TREE,
        max_samples: int | None = None,
    ):
        if token_budget < 1:
            raise ValueError(f"token_budget={token_budget}: a row must hold at least one token")
        self.token_budget, self.max_samples = token_budget, max_samples
        self.num_rows = num_rows
        self.share_prefixes = share_prefixes
        self.layout = layout
        self.rows = self._fresh_rows()

    def _fresh_rows(self) -> list[TrieRow]:
        return [TrieRow(self.share_prefixes, self.layout) for _ in range(self.num_rows)]

    @property
    def empty(self) -> bool:
        return not any(row.samples for row in self.rows)

    def offer(self, sample: Sample) -> bool:
        """Place `sample` in a row and return True, or return False: it fits nowhere, close the micro-batch first."""
        costs = [row.cost(sample) for row in self.rows]
        fitting = [
            i
            for i, (row, cost) in enumerate(zip(self.rows, costs))
            if row.num_tokens + cost.new_tokens <= self.token_budget
            and row.num_terms + cost.new_terms <= self.token_budget
            and (self.max_samples is None or len(row.samples) < self.max_samples)
        ]
        home = [i for i, row in enumerate(self.rows) if sample.group_id in row.groups]
        candidates = [i for i in home if i in fitting]
        if home and not candidates:  # its group's row is full: move only where it does not slow the micro-batch
            heaviest = max(row.load for row in self.rows)
            candidates = [
                i for i in fitting if not self.rows[i].samples or self.rows[i].load + costs[i].new_load <= heaviest
            ]
        elif not home:
            candidates = fitting
        if not candidates:
            return False
        self.rows[min(candidates, key=lambda i: self.rows[i].load)].add(sample)
        return True

    def offer_together(self, samples: list[Sample]) -> bool:
        """Place all of `samples` (a group, to be trained in one step) or none of them."""
        if len(samples) == 1:
            return self.offer(samples[0])
        before = [list(row.samples) for row in self.rows]
        if all(self.offer(sample) for sample in samples):
            return True
        self.rows = [self._row_of(row_samples) for row_samples in before]  # the same insertions, the same trie
        return False

    def _row_of(self, samples: list[Sample]) -> TrieRow:
        row = TrieRow(self.share_prefixes, self.layout)
        for sample in samples:
            row.add(sample)
        return row

    def close(self) -> list[PackedRow]:
        """The micro-batch's packed rows (empty ones left out), and fresh rows for the next one."""
        rows = [row.pack() for row in self.rows if row.samples]
        self.rows = self._fresh_rows()
        return rows


def record_micro_batch(window: MetricWindow, rows: list[PackedRow], token_budget: int, num_ranks: int = 1) -> None:
    """Each row of a micro-batch, and how evenly the ranks (one row each) are loaded: `batch/row_imbalance`
    (the costliest row's attention load over the mean, a rank without a row counting 0) and `batch/pad_frac` (the
    share of the ranks' token slots that padding every row to the longest would add: the time ranks wait)."""
    lengths = [r.num_tokens for r in rows]
    window.add("batch/samples_per_row", *[len(r.samples) for r in rows])
    window.add("batch/row_tokens_mean", *lengths)
    window.add("batch/row_tokens_max", *lengths)
    window.add("batch/row_fill_frac", *[n / token_budget for n in lengths])
    window.add("batch/packing_ratio", *[r.packing_ratio for r in rows])
    loads = [r.load for r in rows]  # one process: one row, balanced (1.0) and unpadded (0.0) by definition
    window.add("batch/row_imbalance", max(loads) / (sum(loads) / num_ranks))
    window.add("batch/pad_frac", 1 - sum(lengths) / (num_ranks * max(lengths)))
