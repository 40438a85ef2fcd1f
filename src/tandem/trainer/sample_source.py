"""Where the trainer's samples come from: the worker's queue, read through one object.

`SampleSource` pulls the worker's messages, keeps the samples that arrived in a buffer, drops the ones
too stale to train (`max_staleness`) or too long for a row (`token_budget`), tells the worker which
tokens have left the queue for good (its allowance), and keeps the ledger of finished prompt positions
that a resumed run starts from. It does no I/O of its own: the inbox and the shared counters are passed
in, so its rules are tested without processes.
"""

import time
import warnings
from collections import deque
from typing import Protocol

from tandem.metrics.window import MetricWindow
from tandem.rollout.records import Sample

POLL_S = 0.05


class Inbox(Protocol):
    def get(self, timeout_s: float) -> tuple[str, object] | None:
        """The next message from the worker, or None after `timeout_s`; raises if the worker failed."""


class PositionLedger:
    """Which prompt positions are finished (all their samples trained or discarded, or skipped); the
    watermark — the first unfinished position — is where a resumed run starts."""

    def __init__(self, start: int):
        self.watermark = start
        self.remaining: dict[int, int] = {}
        self.done: set[int] = set()
        self.finished: list[int] = []
        """Every finished position, in order (what a run covered)."""

    def finish(self, position: int) -> None:
        self.finished.append(position)
        self.done.add(position)
        while self.watermark in self.done:
            self.done.remove(self.watermark)
            self.watermark += 1

    def consume(self, sample: Sample) -> None:
        left = self.remaining.get(sample.position, sample.group_samples) - 1
        self.remaining[sample.position] = left
        if left == 0:
            del self.remaining[sample.position]
            self.finish(sample.position)


class SampleSource:
    """The trainer's side of the rollout queue.

    `counters` are the values shared with the worker: `consumed_tokens` (what left the queue for good:
    taken into a row or discarded) and `tokens_per_step` (what the last step consumed), which set the
    worker's allowance. Worker metrics that arrive with the samples go to `window`.
    """

    def __init__(self, inbox: Inbox, counters, window: MetricWindow, *, start_position: int, max_staleness: int,
                 token_budget: int, health_check=lambda: None):
        self.inbox, self.counters, self.window = inbox, counters, window
        self.ledger = PositionLedger(start_position)
        self.max_staleness, self.token_budget = max_staleness, token_budget
        self.health_check = health_check
        self.buffer: deque[Sample] = deque()
        self.ended = False
        """The worker has sent everything it will send."""
        self.wait_s = 0.0
        """Total time spent waiting for the worker (a counter: a step reads its growth)."""

    def pull(self, timeout_s: float) -> bool:
        """Handle one message from the worker, waiting up to `timeout_s`; False when none came."""
        try:
            message = self.inbox.get(timeout_s)
        except Exception:
            self.health_check()  # a worker that failed because the server died: name the server
            raise
        self.health_check()
        if message is None:
            return False
        kind, payload = message
        if kind == "samples":
            self.buffer.extend(payload)
        elif kind == "skip":
            self.ledger.finish(payload)
        elif kind == "metrics":
            self.window.extend(payload)
        elif kind == "end":
            self.ended = True
        return True

    def drain(self) -> int:
        """Read every message already waiting; returns the samples now buffered (`rollout/queue_size`)."""
        while not self.ended and self.pull(0):
            pass
        return len(self.buffer)

    def peek(self, model_version: int) -> Sample | None:
        """The next trainable sample, waiting for the worker when none is buffered; None once the worker has ended."""
        while True:
            if not self.buffer:
                if self.ended:
                    return None
                start = time.perf_counter()
                self.pull(POLL_S)
                self.wait_s += time.perf_counter() - start
                continue
            sample = self.buffer[0]
            if model_version - sample.model_version > self.max_staleness:
                self._discard("sample/dropped_stale_count")
            elif sample.num_tokens > self.token_budget:
                warnings.warn(f"a sample of {sample.num_tokens} tokens exceeds token_budget={self.token_budget}: dropped",
                              stacklevel=2)
                self._discard("batch/dropped_oversize_count")
            else:
                return sample

    def take(self) -> Sample:
        """Remove the sample `peek` returned: it is in a row now, so the worker may generate its tokens again."""
        sample = self.buffer.popleft()
        self.counters.consumed_tokens.value += sample.num_tokens
        return sample

    def trained(self, samples: list[Sample], tokens_per_step: float) -> None:
        """A step trained `samples`; the worker generated `tokens_per_step` tokens for it (its next allowance)."""
        for sample in samples:
            self.ledger.consume(sample)
        self.counters.tokens_per_step.value = tokens_per_step

    def _discard(self, counter: str) -> None:
        self.window.add(counter, 1)
        self.ledger.consume(self.take())
