"""How many rollouts may run: the token allowance (staleness) and the server-load concurrency cap.

Both are small state machines with no I/O, so the rules of the spec's concurrency section can be read
and tested directly: the worker feeds them numbers and asks them for decisions.
"""

from dataclasses import dataclass

METRICS_POLL_S = 5.0
RAISE_BELOW_USAGE, LOWER_ABOVE_USAGE = 0.6, 0.8
MAX_RAISE_FRAC, LOWER_FACTOR = 0.25, 0.7


@dataclass
class TokenAllowance:
    """Queued + in-flight tokens stay under max(max_staleness, 1) steps' worth of the trainer's consumption.

    Before the first step the trainer has consumed nothing, so a step is assumed to fill every row
    (`full_step_tokens`). Until the first group finishes nobody knows a rollout's size, so one group runs at a time.
    """

    max_staleness: int
    full_step_tokens: float

    def limit(self, tokens_per_step: float) -> float:
        per_step = tokens_per_step if tokens_per_step > 0 else self.full_step_tokens
        return max(self.max_staleness, 1) * per_step

    def may_start(self, queued: float, in_flight: float, reservation: float, tokens_per_step: float,
                  groups_in_flight: int, groups_finished: int) -> bool:
        if groups_in_flight == 0 and queued <= 0:
            return True  # always make progress, even when one group alone exceeds the allowance
        if groups_finished == 0:
            return groups_in_flight == 0
        return queued + in_flight + reservation <= self.limit(tokens_per_step)


class ConcurrencyCap:
    """The live cap on rollouts in flight, driven by the server's KV-cache usage (spec: 동시성).

    Starts at what fits the KV cache at full length; while usage < 60% and nothing waits it rises by up
    to 25%, at most by the number of rollouts finished since the last poll; above 80% it drops by 30%.
    Without /metrics it stays at `maximum` (max_concurrent_rollouts).
    """

    def __init__(self, maximum: int, kv_cache_tokens: int | None = None, max_model_len: int | None = None):
        self.maximum = maximum
        if kv_cache_tokens and max_model_len:
            self.value = max(1, min(maximum, kv_cache_tokens // max_model_len))
        else:
            self.value = maximum
        self.finished_since_poll = 0

    def rollout_finished(self) -> None:
        self.finished_since_poll += 1

    def update(self, kv_cache_usage: float, waiting: int) -> int:
        if kv_cache_usage > LOWER_ABOVE_USAGE:
            self.value = max(1, int(self.value * LOWER_FACTOR))
        elif kv_cache_usage < RAISE_BELOW_USAGE and waiting == 0:
            step = min(self.finished_since_poll, max(1, int(self.value * MAX_RAISE_FRAC)))
            self.value = min(self.maximum, self.value + step)
        self.finished_since_poll = 0
        return self.value
