"""What the rollout worker watches on the generation server while it runs: its KV-cache load, every METRICS_POLL_S
(the concurrency cap follows it, and the `rollout/vllm_*` metrics report it), and its outages, said to the trainer's
user while the requests retry."""

import asyncio
import sys
import time
import warnings
from collections.abc import Callable

from tandem.config import AsyncGRPOConfig
from tandem.generation.client import ControlClient, ServerError
from tandem.rollout.generation import Generation
from tandem.rollout.pacing import METRICS_POLL_S, ConcurrencyCap

REPORT_EVERY_S = 1.0
OUTAGE_SAY_S, OUTAGE_SAY_AGAIN_S = 10.0, 60.0
"""A server silent this long is said to be (and again as often while it lasts): its requests retry without a word."""


class ServerWatch:
    def __init__(
        self,
        control: ControlClient,
        generation: Generation,
        config: AsyncGRPOConfig,
        record: Callable[..., None],
        emit: Callable[[str, object], None],
    ):
        self.control, self.generation, self.config, self.record, self.emit = control, generation, config, record, emit
        self.server_metrics = False
        """The server answers /metrics: the cap follows its load."""
        self.last_preemptions: float | None = None

    # ---- background tasks -------------------------------------------------------------------------
    async def init_cap(self) -> None:
        """Rollouts in flight capped by the server's KV-cache capacity, from its /metrics; a server without them keeps
        max_concurrent_rollouts, and the run says so."""
        try:
            metrics = await self.control.metrics()
        except (ServerError, ConnectionError) as exc:
            warnings.warn(
                f"the server's /metrics did not answer ({exc}): rollouts in flight stay capped at "
                f"max_concurrent_rollouts={self.config.max_concurrent_rollouts}, not paced by its KV cache",
                stacklevel=2,
            )
            return
        self.generation.cap = ConcurrencyCap(
            self.config.max_concurrent_rollouts, metrics.kv_capacity_tokens, self.generation.max_model_len
        )
        self.server_metrics = True

    async def poll(self) -> None:
        """The server's load every METRICS_POLL_S: the concurrency cap follows its KV-cache usage. While /metrics does not
        answer, the cap stays where it was (said once per outage; the requests' own retries report the server)."""
        failing = False
        while self.server_metrics:
            await asyncio.sleep(METRICS_POLL_S)
            try:
                metrics = await self.control.metrics()
            except (ServerError, ConnectionError) as exc:
                if not failing:
                    print(
                        f"tandem: the server's /metrics did not answer ({exc}); the concurrency cap stays at "
                        f"{self.generation.cap.value} until it does",
                        file=sys.stderr,
                    )
                failing = True
                continue
            failing = False
            async with self.generation.slot:
                self.generation.cap.update(metrics.kv_cache_usage, metrics.waiting)
                self.generation.slot.notify_all()
            self.record("rollout/vllm_kv_cache_usage_frac", metrics.kv_cache_usage)
            self.record("rollout/vllm_running_requests", metrics.running)
            self.record("rollout/vllm_queued_requests", metrics.waiting)
            previous = metrics.preemptions if self.last_preemptions is None else self.last_preemptions
            self.record("rollout/vllm_preemption_count", metrics.preemptions - previous)
            self.last_preemptions = metrics.preemptions

    async def say_outages(self) -> None:
        """Tell the trainer's user when the server stops answering at all (its requests are retried meanwhile, for
        up to vllm_server_timeout): OUTAGE_SAY_S into the outage, then every OUTAGE_SAY_AGAIN_S while it lasts."""
        said = None
        while True:
            await asyncio.sleep(REPORT_EVERY_S)
            down, now = self.generation.client.down_since, time.monotonic()
            if down is None:
                said = None
            elif now - down >= OUTAGE_SAY_S and (said is None or now - said >= OUTAGE_SAY_AGAIN_S):
                said = now
                self.emit(
                    "say",
                    f"the generation server {self.control.base_url} has not answered for {now - down:.0f}s "
                    f"({self.generation.client.down_reason}); waiting for it up to vllm_server_timeout="
                    f"{self.config.vllm_server_timeout:g}s (its log says why it stopped)",
                )
