"""A step's rows, taken from the sample queue: up to gradient_accumulation_steps micro-batches of up to one row per
rank, each packed by the token-budget batcher until the next sample fits nowhere. The algorithm says what is placed
whole (a GRPO group, a FlashREINFORCE rollout), whether a unit too large for a row is dropped or split, and how many
units make a step when it counts them."""

import itertools
import threading
import time
from collections.abc import Callable

from tandem.config import AsyncGRPOConfig
from tandem.contract.algorithms import algorithm_of
from tandem.contract.records import Sample
from tandem.metrics.window import MetricWindow
from tandem.packing import PackedRow
from tandem.packing.batching import TokenBudgetBatcher, record_micro_batch
from tandem.runtime.sample_source import POLL_S, SampleSource, Stall


class StepRows:
    def __init__(
        self,
        source: SampleSource,
        args: AsyncGRPOConfig,
        layout: str,
        world_size: int,
        window: MetricWindow,
        read: Callable,
        log: Callable[[dict], None],
        stopping: threading.Event,
    ):
        """`read(f)` calls f, a read of the worker's queue, with the runtime's care (the server's health checked, a
        lost worker replaced); `log` writes a line of metrics to the run's sinks; `stopping` is set when the run stops
        on SIGTERM."""
        self.source, self.args, self.layout, self.world_size = source, args, layout, world_size
        self.window, self.read, self.log, self.stopping = window, read, log, stopping
        self.algorithm = algorithm_of(args)
        self.token_budget = source.token_budget
        self.batcher = self._batcher()

    def take(self, version: int) -> list[list[PackedRow]]:
        """The micro-batches of the step that trains `version`; when the algorithm counts the units of a step
        (FlashREINFORCE's flash_batch_size B), as many as those units need. Fewer (or none) once the worker has
        finished. A sample is consumed once placed."""
        micro_batches, left = [], self.algorithm.units_per_step(self.args)
        steps = self.args.gradient_accumulation_steps
        for index in itertools.count():
            if index == steps if left is None else left == 0:
                break
            left = self._fill_micro_batch(version, last=index == steps - 1, units=left)
            rows = self.batcher.close()
            if not rows:
                break
            record_micro_batch(self.window, rows, self.token_budget, self.world_size)
            taken = time.time()  # a sample leaves the queue when it is placed in a row, not when its step ends
            self.window.add("sample/time_in_queue_s", *[taken - s.created_at for row in rows for s in row.samples])
            micro_batches.append(rows)
        return micro_batches

    def limit_token_budget(self, budget: int) -> None:
        """Rows of at most `budget` tokens from now on (auto_find_batch_size, after a step out of device memory); a
        sample longer than that is dropped as oversize."""
        self.token_budget = budget
        self.batcher = self._batcher()
        self.source.token_budget = budget

    def _batcher(self) -> TokenBudgetBatcher:
        return TokenBudgetBatcher(
            self.token_budget,
            num_rows=self.world_size,
            layout=self.layout,
            max_samples=self.args.per_device_train_batch_size,
        )

    # ---- the queue ----------------------------------------------------------------------------------
    def _fill_micro_batch(self, version: int, last: bool, units: int | None) -> int | None:
        """Offer samples to the batcher until one fits nowhere, or until `units` whole units are placed (None: no
        count); returns how many are left to place. The step's last micro-batch takes whole units (the algorithm's
        `unit_key`: a GRPO group, a FlashREINFORCE rollout), and so does every micro-batch when they are counted. A
        unit larger than a whole micro-batch fills it, or is dropped as oversize (the algorithm's
        `drops_oversize_unit`)."""
        source, batcher, algorithm = self.source, self.batcher, self.algorithm
        while units != 0 and (unit := self._next_unit(version, algorithm.unit_key if last or units else None)):
            if batcher.offer_together(unit):
                for _ in unit:
                    source.take()
                units = None if units is None else units - 1
            elif not batcher.empty:
                return units
            elif algorithm.drops_oversize_unit:
                source.discard_oversize(len(unit))
            else:  # one unit overfills the micro-batch: as much of it as fits
                for sample in unit:
                    if not batcher.offer(sample):
                        return units
                    source.take()
        return units

    def _next_unit(self, version: int, same) -> list[Sample] | None:
        """The source's next trainable unit, waiting for the worker while none is buffered; None once nothing more will
        come, or when the run is stopping."""
        while (unit := self.source.peek_unit(version, same)) is None:
            if self.source.finished or self.stopping.is_set():
                return None
            stall = self.read(lambda: self.source.wait(POLL_S))
            if stall is not None:
                self._log_stalled(stall)
        return unit

    def _log_stalled(self, stall: Stall) -> None:
        """While no step is possible, the worker's metrics still reach the sinks every minute, with `stalled_s` (the
        seconds waited): what generation and scoring do while nothing trains."""
        metrics = self.source.worker_metrics.flush()
        if metrics:
            self.log({**metrics, "stalled_s": stall.waited})
