"""How many rollouts may run: the token allowance (staleness) and the server-load concurrency cap.

`TokenAllowance` and `ConcurrencyCap` are small state machines with no I/O, so the concurrency rules
can be read and tested directly: the worker feeds them numbers and asks them for decisions. `Room` keeps the
worker's books for the allowance (what its groups reserve and put on the queue) and waits for room in it.
"""

import asyncio
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from tandem.contract.staleness import StalenessPolicy

METRICS_POLL_S = 5.0
RAISE_BELOW_USAGE, LOWER_ABOVE_USAGE = 0.6, 0.8
MAX_RAISE_FRAC, LOWER_FACTOR = 0.25, 0.7


@dataclass
class TokenAllowance:
    """Queued + in-flight tokens stay under the policy's `allowance_steps` steps' worth of the trainer's consumption.

    Before the first step the trainer has consumed nothing, so a step is assumed to fill every row
    (`full_step_tokens`). Until the first group finishes nobody knows a rollout's size, so one group runs at a time.
    """

    policy: StalenessPolicy
    full_step_tokens: float

    def limit(self, tokens_per_step: float) -> float:
        per_step = tokens_per_step if tokens_per_step > 0 else self.full_step_tokens
        return self.policy.allowance_steps * per_step

    def may_start(
        self,
        queued: float,
        in_flight: float,
        reservation: float,
        tokens_per_step: float,
        groups_in_flight: int,
        groups_finished: int,
    ) -> bool:
        if groups_in_flight == 0 and queued <= 0:
            return True  # always make progress, even when one group alone exceeds the allowance
        if groups_finished == 0:
            return groups_in_flight == 0
        return queued + in_flight + reservation <= self.limit(tokens_per_step)


ROOM_POLL_S = 0.1
"""How often a worker waiting for room looks again on its own: the trainer's doorbell and the worker's finished groups
wake it at once, this only bounds a wake-up missed."""
RECENT_GROUPS = 16


class Room:
    """The allowance's books on the worker's side. A group in flight holds a reservation, an upper bound of what it
    may put on the queue, until it ends; a scored group's samples count as queued until the trainer consumes them
    (`channels.consumed_tokens`, published with `tokens_per_step` by the trainer, which rings `changed` as it frees
    some)."""

    def __init__(self, allowance: TokenAllowance, queued_tokens: float, channels):
        self.allowance, self.channels = allowance, channels
        self.produced_tokens, self.in_flight_tokens = queued_tokens, 0.0
        self.groups_in_flight = self.groups_finished = 0
        self.changed = asyncio.Event()
        """Set when the allowance may admit a group: the trainer freed room (its doorbell), or a group here ended."""
        self.kept_tokens: deque[int] = deque(maxlen=RECENT_GROUPS)
        """Tokens each recent kept group put on the queue, forks included: what a group really produces."""

    def reservation(self, single_turn: int) -> float:
        """What a group may put on the queue: `single_turn`, G × (prompt + max_completion_length), bounds a single-turn
        group; multi-turn rollouts and forks can produce more, so never less than the largest recent kept group."""
        return max(single_turn, max(self.kept_tokens, default=0))

    def queued_tokens(self) -> float:
        return self.produced_tokens - self.channels.consumed_tokens.value

    async def wait(self, reservation: float, check: Callable[[], None]) -> tuple[float, float | None]:
        """Wait until `reservation` fits, calling `check` (which raises to end the wait) at every look, then take it.
        Returns the seconds waited and the allowance then used with it (None before it binds: no group finished)."""
        start = time.monotonic()
        while True:
            self.changed.clear()  # before the look: a wake-up after it is kept for the wait
            if self.allowance.may_start(
                self.queued_tokens(),
                self.in_flight_tokens,
                reservation,
                self.channels.tokens_per_step.value,
                self.groups_in_flight,
                self.groups_finished,
            ):
                break
            check()
            try:
                await asyncio.wait_for(self.changed.wait(), ROOM_POLL_S)
            except TimeoutError:
                pass
        used = None
        if self.groups_finished:  # the allowance binds once the first group has finished
            used = (self.queued_tokens() + self.in_flight_tokens + reservation) / self.allowance.limit(
                self.channels.tokens_per_step.value
            )
        self.groups_in_flight += 1  # taken now, not when the group's task first runs
        self.in_flight_tokens += reservation
        return time.monotonic() - start, used

    def group_ended(self, reservation: float) -> None:
        """A group's generation ended (or failed): its reservation is free."""
        self.groups_in_flight -= 1
        self.in_flight_tokens -= reservation
        self.changed.set()

    def group_scored(self, tokens: int | None) -> None:
        """A group was scored: `tokens` on the queue (None: dropped). The first one makes the allowance bind, and it may
        then admit more than one group."""
        self.groups_finished += 1
        self.changed.set()
        if tokens is not None:
            self.produced_tokens += tokens
            self.kept_tokens.append(tokens)


class ConcurrencyCap:
    """The live cap on rollouts in flight, driven by the server's KV-cache usage.

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
