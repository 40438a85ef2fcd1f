"""auto_find_batch_size: a step that runs out of device memory runs again in rows of half the tokens.

transformers halves the batch and starts its training loop again; tandem's batch is its rows, bounded by
`token_budget`, so it packs the same step's samples again in rows of half the longest row's tokens (gradient
accumulation over more, smaller micro-batches) and keeps that smaller budget for the steps after.
"""

import torch

from tandem.errors import UsageError
from tandem.model.distributed import Ranks
from tandem.packing import PackedRow
from tandem.packing.batching import TokenBudgetBatcher


def check_auto_find_batch_size(auto_find_batch_size: bool, ranks: Ranks) -> None:
    """Under torchrun one rank's out-of-memory would leave the others waiting in its collectives: not supported."""
    if auto_find_batch_size and ranks.several:
        raise NotImplementedError(
            "auto_find_batch_size=True under torchrun: halving one rank's rows would leave the other ranks waiting; "
            "lower token_budget instead, or train on one process"
        )


def halved(
    micro_batches: list[list[PackedRow]], layout: str, max_samples: int | None, error: torch.OutOfMemoryError
) -> tuple[list[list[PackedRow]], int]:
    """The step's samples packed again, one row a micro-batch, in rows of half its longest row's tokens, and that
    budget. A sample longer than the new budget cannot be split: `error` is raised again, saying so."""
    samples = [sample for micro_batch in micro_batches for row in micro_batch for sample in row.samples]
    budget = max(row.num_tokens for micro_batch in micro_batches for row in micro_batch) // 2
    longest = max(sample.num_tokens for sample in samples)
    if budget < longest:
        raise UsageError(
            f"auto_find_batch_size: the step ran out of device memory with rows of {2 * budget} tokens, and its "
            f"longest sample ({longest} tokens) does not fit in half of that; lower max_completion_length, or train "
            f"on a device with more memory ({error})"
        ) from error
    batcher = TokenBudgetBatcher(budget, layout=layout, max_samples=max_samples)
    packed = []
    for sample in samples:
        if not batcher.offer(sample):
            packed.append(batcher.close())
            batcher.offer(sample)
    packed.append(batcher.close())
    return packed, budget
