"""Where the trainer's samples come from: the worker's queue, read through one object.

`SampleSource` pulls the worker's messages, keeps the samples that arrived in a buffer, drops the ones
too long for a row (`token_budget`) and the samples too stale to train (the staleness policy: a group none of
whose samples was trained yet is dropped whole and generated again; the late samples of a group already
partly trained are dropped alone, and finish its prompt), tells the worker
which tokens have left the queue for good (its allowance), and keeps the ledger of finished prompt
prompt indices that a resumed run starts from. It does no I/O of its own: the inbox and the shared counters are passed
in, so its rules are tested without processes. It calls nothing of its owner: `peek` never waits and `wait` reads one
message, so the waiting loop, and what a lost worker or a dead server leads to, are the runtime's.
"""

import itertools
import sys
import time
import warnings
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Any, Protocol

from tandem.contract.records import Sample
from tandem.contract.staleness import StalenessPolicy
from tandem.metrics.window import MetricWindow

POLL_S = 0.05
STALL_SAY_S = 60.0
"""Seconds without a trainable sample before the trainer says why (and again as often while it lasts)."""
STALL_SAY_GROUPS = 50
"""Groups dropped in a row before the trainer says why, however short the wait."""


class StalledError(RuntimeError):
    """No trainable sample arrived for `stall_timeout` seconds."""


@dataclass
class Stall:
    """What kept trainable samples away since the last one, counted so a long wait says why with numbers."""

    waited: float = 0.0
    """Seconds the trainer waited for samples since the last trainable one (its steps not counted)."""
    said: float | None = None
    """`waited` when the trainer last said why (None: not yet in this stall)."""
    groups_dropped: int = 0
    """Groups the worker dropped or skipped (no reward variance, or filtered out)."""
    rewards: Counter = field(default_factory=Counter)
    """The rewards of the dropped groups, by value."""
    stale: int = 0
    oversize: int = 0
    retries: int = 0
    """Requests the worker retried (server errors)."""
    failed: int = 0
    """Groups dropped because a reward function or the server failed on them twice."""

    def seen(self, metrics: dict[str, list]) -> None:
        self.rewards.update(round(v, 4) for v in metrics.get("reward_dropped", []))
        self.retries += int(sum(metrics.get("rollout/vllm_retry_count", [])))
        self.failed += int(sum(metrics.get("rollout/failed_count", [])))

    def reason(self) -> str:
        if self.failed and self.failed == self.groups_dropped:
            return (
                f"no trainable sample for {self.waited:.0f}s of waiting: {self.failed} groups dropped because a reward "
                f"function or the server failed on them twice ({self.retries} requests retried): see the lines "
                "'tandem: dropped the group ...' above."
            )
        if not (self.groups_dropped or self.stale or self.oversize):
            return (
                f"no trainable sample for {self.waited:.0f}s of waiting, and nothing dropped: generation is slow or "
                f"stuck ({self.retries} requests retried). Check the server's log and /metrics."
            )
        rewards = ", ".join(f"{value:g} x{count}" for value, count in self.rewards.most_common(5)) or "none scored"
        return (
            f"no trainable sample for {self.waited:.0f}s of waiting: {self.groups_dropped} groups dropped without reward "
            f"variance, filtered out or failed (rewards seen: {rewards}; {self.failed} failed), {self.stale} samples "
            f"dropped stale, "
            f"{self.oversize} too long for token_budget, {self.retries} requests retried. A reward that never "
            "varies within a group trains nothing: check the reward function against a few completions "
            "(log_completions=True), or make the task easier."
        )


@dataclass
class ResumePoint:
    """Where a worker starts so that nothing is trained twice or lost: the watermark, and what the trainer already
    holds beyond it. Saved with each checkpoint (a resumed run) and handed to a restarted worker."""

    dataset_start_index: int
    """The first unfinished prompt index (the ledger's watermark), where the new worker's stream starts."""
    finished: list[int] = field(default_factory=list)
    """Prompt indices past `dataset_start_index` that are finished (trained, dropped or skipped)."""
    remaining: dict[int, int] = field(default_factory=dict)
    """Groups partly trained: their samples not yet in a row, by prompt index."""
    samples: list[Sample] = field(default_factory=list)
    """Samples received and not yet trained (the queue)."""
    in_rows: list[int] = field(default_factory=list)
    """Prompt indices whose samples sit in a row not trained yet (a worker replaced mid-step; never at a checkpoint)."""

    @property
    def received(self) -> frozenset[int]:
        """Prompt indices past `dataset_start_index` the worker must not generate again."""
        return (
            frozenset(self.finished)
            | self.remaining.keys()
            | {s.prompt_index for s in self.samples}
            | set(self.in_rows)
        )

    @property
    def queued_tokens(self) -> float:
        return float(sum(s.num_tokens for s in self.samples))


WorkerMessage = tuple[str, Any]
"""A message from the worker process: its kind and a payload whose type the kind says ("samples": a list of `Sample`,
"skip": a prompt index, "metrics": a `MetricWindow` dict, "eval": (step, records), "say": text, "end": nothing)."""


class Inbox(Protocol):
    def get(self, timeout_s: float) -> WorkerMessage | None:
        """The next message from the worker, or None after `timeout_s`; raises if the worker failed."""


class PromptLedger:
    """Which prompt indices are finished (all their samples trained or discarded, or skipped); the
    watermark — the first unfinished prompt index — is where a resumed run starts."""

    def __init__(self, start: int, finished=(), remaining: dict[int, int] | None = None):
        self.watermark = start
        self.remaining: dict[int, int] = dict(remaining or {})
        self.done: set[int] = set(finished)
        self.finished: list[int] = []
        """Every prompt index this run finished, in order (what it covered)."""

    def finish(self, prompt_index: int) -> None:
        self.finished.append(prompt_index)
        self.done.add(prompt_index)
        while self.watermark in self.done:
            self.done.remove(self.watermark)
            self.watermark += 1

    def consume(self, sample: Sample) -> None:
        left = self.remaining.get(sample.prompt_index, sample.group_samples) - 1
        self.remaining[sample.prompt_index] = left
        if left == 0:
            del self.remaining[sample.prompt_index]
            self.finish(sample.prompt_index)


class SampleSource:
    """The trainer's side of the rollout queue.

    `counters` are the values shared with the worker: `consumed_tokens` (what left the queue for good:
    taken into a row or discarded) and `tokens_per_step` (what the last step consumed), which set the
    worker's allowance. The source's own counts go to `window`; the worker's metrics, which arrive with the samples,
    to `worker_metrics` (the trainer logs them with its step, or alone while a stall lasts).
    """

    def __init__(
        self,
        inbox: Inbox,
        counters,
        window: MetricWindow,
        *,
        resume: ResumePoint,
        staleness: StalenessPolicy,
        token_budget: int,
        num_prompts: int | None = None,
        stall_timeout: float | None = None,
        say=lambda text: print(f"tandem: {text}", file=sys.stderr),
    ):
        self.inbox, self.counters, self.window = inbox, counters, window
        self.worker_metrics = MetricWindow()
        self.ledger = PromptLedger(resume.dataset_start_index, resume.finished, resume.remaining)
        self.staleness, self.token_budget = staleness, token_budget
        self.num_prompts = num_prompts
        """Where the run's prompt indices end (None: an endless stream, max_steps decides)."""
        self.buffer: deque[Sample] = deque(resume.samples)
        self.ended = False
        """The worker said it had nothing left to send (it sends more if asked to regenerate)."""
        self.unpublished = 0.0
        """Tokens taken or dropped since the worker was last told (`release`): told once the step's rows are placed
        when the groups it admits can still be trained, else when its sync ends (the runtime decides), and at once when the trainer has
        to wait for the worker (so a half-filled row never deadlocks the allowance)."""
        self.pending: set[int] = set()
        """Prompt indices sent back to the worker whose new group has not arrived yet."""
        self.admitted: set[int] = set(resume.remaining)
        """Prompt indices with a sample in a row already: their group is partly trained, so it is not generated again."""
        self.wait_s = 0.0
        """Total time spent waiting for the worker (a counter: a step reads its growth)."""
        self.last_said: float | None = None
        """When a stall was last said (monotonic seconds)."""
        self.heard = False
        """Whether the worker has sent anything yet: the stall clock starts then."""
        self.stall, self.stall_timeout, self.say = Stall(), stall_timeout, say
        """Since the last trainable sample; a wait past `stall_timeout` seconds stops the run (None: never)."""
        self.evaluations: dict[int, dict[str, list]] = {}
        """The eval records the worker sent, by the step that asked for them."""
        self.asked: dict[int, int] = {}
        """Evaluations asked for and not answered yet: step -> policy version (asked again of a replaced worker)."""

    def resume_point(self) -> ResumePoint:
        """What a new worker (a resumed run's, or a restarted one) needs to go on from here."""
        ledger = self.ledger
        return ResumePoint(
            ledger.watermark,
            sorted(ledger.done),
            dict(ledger.remaining),
            list(self.buffer),
            sorted(self.admitted - ledger.remaining.keys()),
        )

    def pull(self, timeout_s: float) -> bool:
        """Handle one message from the worker, waiting up to `timeout_s`; False when none came. A worker that failed or
        was lost raises here (`WorkerLost`): its owner decides what follows."""
        message = self.inbox.get(timeout_s)
        if message is None:
            return False
        self.heard = True
        kind, payload = message
        if kind == "samples":
            self.buffer.extend(payload)
            self.pending.difference_update(s.prompt_index for s in payload)
        elif kind == "skip":
            self.pending.discard(payload)
            self.ledger.finish(payload)
            self.stall.groups_dropped += 1
        elif kind == "metrics":
            self.worker_metrics.extend(payload)
            self.stall.seen(payload)
        elif kind == "eval":
            step, records = payload
            self.asked.pop(step, None)
            self.evaluations[step] = records
        elif kind == "end":
            self.ended = True
        elif kind == "say":  # the worker tells the user something (a server that stopped answering)
            self.say(payload)
        return True

    def ask_evaluation(self, step: int, model_version: int) -> None:
        """Have the worker generate and score the eval prompts under `model_version`: its records arrive in
        `evaluations[step]` (samples that arrive meanwhile are buffered)."""
        self.asked[step] = model_version
        self.counters.evaluate.put((step, model_version))

    def replace_worker(self, inbox: Inbox, counters) -> None:
        """Read from a new worker (started where the lost one left off: `resume_point()`): the lost one's token
        accounting went with it, and the evaluations it did not answer are asked again."""
        self.inbox, self.counters = inbox, counters
        self.unpublished = 0.0
        for step, version in self.asked.items():
            self.counters.evaluate.put((step, version))
        self.window.add("rollout/worker_restart_count", 1)

    def drain(self) -> int:
        """Read every message already waiting; returns the samples now buffered (`rollout/queue_size`)."""
        while self.pull(0):
            pass
        return len(self.buffer)

    @property
    def finished(self) -> bool:
        """Nothing more will come: every prompt index of the run is finished, or the worker ended with none pending."""
        if self.num_prompts is not None and self.ledger.watermark >= self.num_prompts:
            return True
        return self.ended and not self.pending

    def peek(self, model_version: int) -> Sample | None:
        """The next trainable sample in the buffer (those too stale or too long for a row are dropped on the way); None
        when none is buffered: then `wait` for the worker, unless the source is `finished`."""
        while self.buffer:
            sample = self.buffer[0]
            stale = self.staleness.is_stale(model_version, self.staleness.version_of(sample))
            if stale and sample.prompt_index in self.admitted:
                self._discard("sample/dropped_stale_count")  # the rest of a group already partly trained
            elif stale:
                self._drop_stale_group(sample.prompt_index)
            elif sample.num_tokens > self.token_budget:
                warnings.warn(
                    f"a sample of {sample.num_tokens} tokens exceeds token_budget={self.token_budget}: dropped",
                    stacklevel=2,
                )
                self._discard("batch/dropped_oversize_count")
            else:
                self.stall = Stall()
                return sample
        return None

    def wait(self, timeout_s: float) -> Stall | None:
        """Wait up to `timeout_s` for the worker's next message, with the room the trainer took published first (the
        worker may need it to send what is waited for). Returns the stall when it is due to be said (it was, on `say`);
        raises StalledError past `stall_timeout`."""
        self.release()
        start = time.perf_counter()
        self.pull(timeout_s)
        waited = time.perf_counter() - start
        self.wait_s += waited
        if self.heard:  # a worker still starting (imports, the server's warm-up) is not a stall
            self.stall.waited += waited
        return self._check_stall()

    def _check_stall(self) -> Stall | None:
        """Say why no trainable sample arrives, once the wait or the drops grew long, and again every STALL_SAY_S
        while it lasts, at most once a STALL_SAY_S in all (a run whose reward saturates drops 50 groups between most
        steps: one line a minute says it); past `stall_timeout`, stop the run with the same numbers."""
        stall = self.stall
        if self.stall_timeout is not None and stall.waited > self.stall_timeout:
            raise StalledError(f"{stall.reason()} Stopped after stall_timeout={self.stall_timeout:g}s.")
        if stall.said is None:
            due = stall.waited >= STALL_SAY_S or stall.groups_dropped >= STALL_SAY_GROUPS
        else:
            due = stall.waited - stall.said >= STALL_SAY_S
        now = time.monotonic()
        if not due or (self.last_said is not None and now - self.last_said < STALL_SAY_S):
            return None
        stall.said, self.last_said = stall.waited, now
        self.say(stall.reason())
        return stall

    def peek_unit(self, model_version: int, same=None) -> list[Sample] | None:
        """The next trainable sample, and with `same` (a key: the group's prompt index, the rollout's id) the buffered
        samples after it that share its key (a group's samples arrive together); None when none is buffered."""
        first = self.peek(model_version)
        if first is None:
            return None
        unit = [first]
        if same is not None:
            unit += itertools.takewhile(lambda s: same(s) == same(first), itertools.islice(self.buffer, 1, None))
        return unit

    def take(self) -> Sample:
        """Remove the sample `peek` returned: it is in a row now, so the worker may generate its tokens again."""
        sample = self.buffer.popleft()
        self.admitted.add(sample.prompt_index)
        self.unpublished += sample.num_tokens
        return sample

    def trained(self, samples: list[Sample]) -> None:
        """A step trained `samples`."""
        for sample in samples:
            self._consume(sample)

    def publish(self, tokens_per_step: float) -> None:
        """The worker's next allowance, once the step's weight sync is done or started: what the last step consumed,
        and the room it made if not released yet."""
        self.counters.tokens_per_step.value = tokens_per_step
        self.release()
        self.counters.room.ring()  # the allowance itself moved

    def release(self) -> None:
        """Tell the worker the room the trainer took or dropped: it may start groups in its place."""
        self.counters.watermark.value = self.ledger.watermark
        if self.unpublished:
            self.counters.consumed_tokens.value += self.unpublished
            self.unpublished = 0.0
            self.counters.room.ring()

    def discard_oversize(self, count: int) -> None:
        """Drop the next `count` samples: together (one rollout) they fit no row."""
        warnings.warn(
            f"a rollout of {count} samples does not fit one micro-batch (token_budget={self.token_budget}): "
            "dropped (FlashREINFORCE trains a rollout in one step). Raise token_budget.",
            stacklevel=2,
        )
        for _ in range(count):
            self._discard("batch/dropped_oversize_count")

    def _consume(self, sample: Sample) -> None:
        self.ledger.consume(sample)
        if sample.prompt_index not in self.ledger.remaining:
            self.admitted.discard(sample.prompt_index)

    def _discard(self, counter: str) -> None:
        self.window.add(counter, 1)
        self.stall.stale += counter == "sample/dropped_stale_count"
        self.stall.oversize += counter == "batch/dropped_oversize_count"
        self._consume(self.take())

    def _drop_stale_group(self, prompt_index: int) -> None:
        """Every buffered sample of the group at `prompt_index` (they arrived together) leaves the queue; the worker
        generates the prompt index again, so it is not finished."""
        stale = [s for s in self.buffer if s.prompt_index == prompt_index]
        self.buffer = deque(s for s in self.buffer if s.prompt_index != prompt_index)
        self.unpublished += sum(s.num_tokens for s in stale)
        self.window.add("sample/dropped_stale_count", len(stale))
        self.stall.stale += len(stale)
        self.ledger.remaining.pop(prompt_index, None)
        self.pending.add(prompt_index)
        self.counters.retry.put(prompt_index)  # the worker generates it again
