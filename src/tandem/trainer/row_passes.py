"""How this rank passes a step's rows through the model: which rows are its own, their log-probs with gradients (under
autocast where configured) or without (for an objective that scores the whole step first), and a clock that waits for
the device, so each pass is timed by its own work."""

import time
from contextlib import nullcontext
from dataclasses import dataclass

import torch

from tandem.metrics.window import MetricWindow
from tandem.model.distributed import Ranks
from tandem.packing import PackedRow
from tandem.packing.log_probs import TokenLogProbs, row_log_probs
from tandem.trainer.objectives import LossShare, Objective


@dataclass
class StepLoss:
    """What a step's forward and backward passes did: the step's loss and the seconds its forward passes took."""

    loss: float
    forward_s: float


class RowPasses:
    """A step's rows through `model` on this rank, with the attention `kernel` the rows were packed for."""

    def __init__(
        self, model: torch.nn.Module, kernel: str, temperature: float, autocast: torch.dtype | None, ranks: Ranks
    ):
        self.model, self.kernel, self.temperature, self.autocast, self.ranks = (
            model,
            kernel,
            temperature,
            autocast,
            ranks,
        )
        self.device = next(model.parameters()).device

    def mine(self, micro_batch: list[PackedRow]) -> list[tuple[PackedRow, bool]]:
        """(row, real) pairs this rank forwards: all rows on one process, row `rank` under torchrun, or the first row
        as a weight-0 filler when the micro-batch has fewer rows than ranks (FSDP needs the same passes everywhere)."""
        if not self.ranks.several:
            return [(row, True) for row in micro_batch]
        rank = self.ranks.rank
        return [(micro_batch[rank], True)] if rank < len(micro_batch) else [(micro_batch[0], False)]

    def forward(self, row: PackedRow) -> TokenLogProbs:
        """The row's log-probs at its trained positions, with gradients (bf16 autocast where configured)."""
        with torch.autocast(self.device.type, dtype=self.autocast) if self.autocast else nullcontext():
            return row_log_probs(self.model, row, self.kernel, self.temperature)

    def score(self, row: PackedRow) -> TokenLogProbs:
        """The row's log-probs without gradients, in the model's own dtype."""
        with torch.no_grad():
            return row_log_probs(self.model, row, self.kernel, self.temperature)

    def score_all(self, micro_batches: list[list[PackedRow]]) -> list[TokenLogProbs]:
        """Every row of the step scored without gradients, in order: each rank scores its own rows, then the ranks
        exchange their log-probs and entropies (what an objective that decides per trajectory needs)."""
        mine = [self.score(row) for micro_batch in micro_batches for row, _ in self.mine(micro_batch)]
        if not self.ranks.several:
            return mine
        exchanged = self.ranks.all_gather([(s.log_probs.cpu(), s.entropy.cpu()) for s in mine])
        return [
            TokenLogProbs(*(t.to(self.device) for t in exchanged[rank][index]))
            for index, micro_batch in enumerate(micro_batches)
            for rank in range(len(micro_batch))
        ]

    def forward_backward(
        self,
        micro_batches: list[list[PackedRow]],
        objective: Objective,
        scaler: torch.amp.GradScaler | None,
        records: MetricWindow,
    ) -> StepLoss:
        """This rank's rows of one step forwarded and backwarded through `objective` (gradients accumulate; a filler
        row with weight 0), its metrics into `records`; returns the step's loss summed over the ranks."""
        rows = [row for micro_batch in micro_batches for row in micro_batch]
        begun = objective.begin_step(rows, lambda: self.score_all(micro_batches))
        if self.ranks.main:
            records.extend(begun)
        loss, forward_s = 0.0, 0.0
        for micro_batch in micro_batches:
            share = LossShare.of(micro_batch, len(micro_batches))
            for row, real in self.mine(micro_batch):
                start = self.clock()
                scored = self.forward(row)
                forward_s += self.clock() - start
                row_loss = objective.row_loss(row, scored, share)
                weighted = row_loss.loss if real else row_loss.loss * 0.0
                (scaler.scale(weighted) if scaler else weighted).backward()
                if real:
                    records.extend(row_loss.metrics)
                    loss += row_loss.loss.item()
        return StepLoss(self.ranks.total(loss), forward_s)

    def clock(self) -> float:
        """Now, once the device has finished the work queued so far (GPU kernels run asynchronously)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()
