"""What crosses the process boundary between the trainer and the rollout worker.

The worker puts tagged messages on `out`: ("samples", [Sample]), ("skip", prompt index), ("metrics",
{name: [values]}), ("end", None) when it has nothing left to generate, ("say", a line for the user: the server has
not answered for a while), ("error", traceback text), and ("server", message) when the server stopped serving for
good (vLLM's engine died, or it stayed away past vllm_server_timeout: no traceback, nothing to retry). The
trainer puts on `retry` the prompt indices of groups it dropped as stale, to be generated again (the worker then
sends their samples, and "end" once more), and on `evaluate` (step, policy version) to have the eval prompts generated and
scored (the worker answers ("eval", (step, {name: [values]}))). It publishes the policy version, when each version
began to be served, and its token consumption in shared values, and rings `room` whenever it frees some; the worker
beats `heartbeat` twice a second.
"""

import asyncio
import bisect
import multiprocessing as mp
import os
from dataclasses import dataclass
from multiprocessing.synchronize import Event


class Doorbell:
    """A wake-up across the process boundary: the trainer rings, the worker's event loop hears it at once. A waiting
    worker used to poll the shared values every 10 ms, which cost 0.05-0.1 of the overlap at max_staleness 1
    (`benchmarks/pipeline_overlap.py`: a step waits on a few such hand-offs)."""

    def __init__(self, context):
        self.reader, self.writer = context.Pipe(duplex=False)
        os.set_blocking(self.writer.fileno(), False)  # a ring never blocks the trainer

    def __getstate__(self) -> dict:
        """The worker gets the read end only: once the trainer's process is gone, the pipe reads as closed."""
        return {"reader": self.reader, "writer": None}

    def ring(self) -> None:
        """Nothing happens on a full pipe (it holds a ring not heard yet, which is as good) or a closed bell."""
        if self.writer is None or self.writer.closed:
            return
        try:
            os.write(self.writer.fileno(), b"\0")
        except BlockingIOError:
            pass

    def listen(self, heard: asyncio.Event) -> None:
        """Set `heard` on every ring, from the running event loop (until `stop_listening`)."""

        def drain():
            if not os.read(self.reader.fileno(), 4096):  # end of file: the trainer's process is gone
                self.stop_listening()
            heard.set()

        asyncio.get_running_loop().add_reader(self.reader.fileno(), drain)

    def stop_listening(self) -> None:
        asyncio.get_running_loop().remove_reader(self.reader.fileno())

    def close(self) -> None:
        """The trainer's side, once its worker is stopped: both ends' descriptors freed."""
        self.reader.close()
        if self.writer is not None:
            self.writer.close()


class ServedVersions:
    """When the server began to serve each recent policy version (monotonic seconds, one clock for every process of
    the host), written by the trainer's sync just before generation resumes on the new weights. A server that cannot
    say which weights sampled each token (vLLM) has its tokens labelled by when they arrived: a token that came after
    version v's resume was sent is v's. One that left the engine before the pause but reached this process only after
    the resume would be labelled one version too new: that takes vLLM's front end stalled for the whole sync (seen for
    seconds on a loaded 2-core machine; the `vllm` tier checks each token's label against the weights' log-probs)."""

    SLOTS = 64
    """Versions remembered: a generation spanning more syncs than this labels its oldest tokens with the oldest kept."""

    def __init__(self, context):
        self.versions = context.Array("q", [-1] * self.SLOTS)
        self.since = context.Array("d", [0.0] * self.SLOTS)

    def mark(self, version: int, since: float) -> None:
        """`version` is served from monotonic time `since` on."""
        slot = version % self.SLOTS
        with self.versions.get_lock():
            self.versions[slot], self.since[slot] = version, since

    def timeline(self) -> list[tuple[float, int]]:
        """(since, version) of every remembered version, oldest first."""
        with self.versions.get_lock():
            marks = [(t, v) for v, t in zip(self.versions[:], self.since[:]) if v >= 0]
        return sorted(marks)


def versions_at(timeline: list[tuple[float, int]], arrivals: list[float], floor: int) -> list[int]:
    """The version served when each token arrived (`timeline`: `ServedVersions.timeline()`), never older than `floor`
    (the version the request was sent under)."""
    times = [t for t, _ in timeline]
    versions = []
    for arrival in arrivals:
        index = bisect.bisect_right(times, arrival) - 1
        versions.append(max(floor, timeline[index][1]) if index >= 0 else floor)
    return versions


@dataclass
class Channels:
    out: mp.Queue
    retry: mp.Queue
    evaluate: mp.Queue
    model_version: "mp.sharedctypes.Synchronized"
    tokens_per_step: "mp.sharedctypes.Synchronized"
    consumed_tokens: "mp.sharedctypes.Synchronized"
    watermark: "mp.sharedctypes.Synchronized"
    """The first prompt index the trainer has not finished: the worker forgets the rows below it."""
    heartbeat: "mp.sharedctypes.Synchronized"
    stop: Event
    running: Event
    """Set by the worker as soon as its own code runs (before that, Python is still importing the main module)."""
    room: Doorbell
    """Rung by the trainer when it frees room in the queue (or publishes a new allowance): groups may start."""
    served: ServedVersions
    """When each recent policy version began to be served (labels a vLLM stream's tokens)."""

    @classmethod
    def create(cls, context) -> "Channels":
        return cls(
            out=context.Queue(),
            retry=context.Queue(),
            evaluate=context.Queue(),
            model_version=context.Value("q", 0),
            tokens_per_step=context.Value("d", 0.0),
            consumed_tokens=context.Value("d", 0.0),
            watermark=context.Value("q", 0),
            heartbeat=context.Value("d", 0.0),
            stop=context.Event(),
            running=context.Event(),
            room=Doorbell(context),
            served=ServedVersions(context),
        )
