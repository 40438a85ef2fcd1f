"""The rollout worker process: spawned (no GPU visible), it runs an `AsyncRolloutLoop` to completion.

`WorkerSpec` is everything the process needs, pickled across the boundary. `RolloutWorker` is the
trainer's handle: it starts the process and reads its messages, turning a crash, a silent death or a
missed heartbeat into an error that carries the worker's own traceback.
"""

import gc
import multiprocessing as mp
import os
import pickle
import queue
import time
import traceback
from contextlib import contextmanager
from dataclasses import dataclass

from tandem.contract.channels import Channels
from tandem.errors import COMMAND_VARIABLE, warnings_as_lines
from tandem.generation.client import EngineDead, ServerGone, ServerProblem, engine_died, server_gone
from tandem.rollout.settings import RolloutSettings


@dataclass
class WorkerSpec:
    loop_cls: type
    """An AsyncRolloutLoop (sub)class, importable in the spawned process."""
    settings: RolloutSettings


class WorkerError(RuntimeError):
    pass


class WorkerLost(WorkerError):
    """The worker died without reporting an error of its own (killed, out of memory) or stopped beating: the trainer
    may start another one. An error the worker reports (a traceback from the loop's code) is a WorkerError."""


def check_picklable(objects: dict[str, object]) -> None:
    """Everything sent to the worker is pickled; name the first object that is not, and the fix."""
    for label, obj in objects.items():
        try:
            pickle.dumps(obj)
        except Exception as exc:
            name = getattr(obj, "__qualname__", None) or type(obj).__name__
            raise TypeError(
                f"{label} {name!r} cannot be sent to the rollout worker process: it is not picklable ({exc}). "
                "Use a module-level function, a functools.partial of one, or an instance of a module-level "
                "class with __call__ (lambdas and closures cannot be pickled)."
            ) from None


def worker_main(spec: WorkerSpec, channels: Channels) -> None:
    channels.running.set()
    if os.environ.get(COMMAND_VARIABLE):  # started by `tandem train`: its warnings look like the trainer's
        warnings_as_lines(os.environ[COMMAND_VARIABLE])
    import asyncio

    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(spec.settings.tokenizer_path)
        loop = spec.loop_cls(spec.settings, processing_class=tokenizer, channels=channels)
        gc.freeze()  # what start-up made lives as long as the process: the garbage collector need not walk it
        asyncio.run(loop.run())
    except BaseException as exc:
        channels.out.put(stop_message(exc, spec.settings.config.vllm_server_timeout))
        channels.out.close()
        channels.out.join_thread()  # the message is in the pipe before the process exits
        raise SystemExit(1) from exc


def stop_message(exc: BaseException, timeout_s: float) -> tuple[str, str]:
    """The worker's last message: a server that stopped serving ("server": one line, no bug of the worker's), or
    the traceback of an error."""
    if isinstance(exc, EngineDead):
        return "server", engine_died(exc)
    if isinstance(exc, ServerGone):
        return "server", server_gone(exc, timeout_s)
    return "error", traceback.format_exc()


@contextmanager
def child_environment(**values: str):
    """Environment variables for a process started inside the block: a spawned multiprocessing child copies
    os.environ at start and takes no environment of its own, so they are set for the start and restored after."""
    saved = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                del os.environ[name]
            else:
                os.environ[name] = value


class RolloutWorker:
    def __init__(self, spec: WorkerSpec, timeout_s: float):
        context = mp.get_context("spawn")
        self.channels = Channels.create(context)
        self.timeout_s = timeout_s
        self.process = context.Process(
            target=worker_main, args=(spec, self.channels), name="tandem-rollout-worker", daemon=True
        )

    def start(self) -> None:
        self.channels.heartbeat.value = time.time()
        # No GPU for the worker; OpenMP threads that wait passively (spinning ones steal the cores the server and
        # the trainer share with it: a training step ran 20x slower on two cores).
        with child_environment(CUDA_VISIBLE_DEVICES="", OMP_WAIT_POLICY=os.environ.get("OMP_WAIT_POLICY", "PASSIVE")):
            self.process.start()

    def stop(self) -> None:
        """End the process and close this side of its queues (their pipes and the thread that feeds `retry`) and doorbell."""
        self.channels.stop.set()
        if self.process.is_alive():
            self.process.terminate()
        self.process.join(timeout=10)
        for channel in (self.channels.out, self.channels.retry, self.channels.evaluate):
            channel.close()
            channel.join_thread()
        self.channels.room.close()

    def get(self, timeout_s: float) -> tuple[str, object] | None:
        """The next message, or None after `timeout_s`; raises WorkerError if the worker failed or hung."""
        try:
            kind, payload = self.channels.out.get(timeout=timeout_s)
        except queue.Empty:
            self._check_alive()
            return None
        if kind == "error":
            raise WorkerError(f"the rollout worker failed:\n{payload}")
        if kind == "server":  # the server stopped serving: no bug of the worker's, no traceback
            raise ServerProblem(f"the rollout worker stopped: {payload}")
        return kind, payload

    def raise_if_stopped(self) -> None:
        """When the worker has failed (exited non-zero), raise the reason it sent (a ServerProblem, a WorkerError); the
        samples still queued are dropped with it, since the run ends. A worker that runs, or ended well, says nothing."""
        if self.process.is_alive() or self.process.exitcode in (0, None):
            return
        while True:
            self.get(timeout_s=1.0)  # raises at the worker's message, or at its exit once the queue is empty

    def _check_alive(self) -> None:
        if not self.process.is_alive() and self.process.exitcode not in (0, None):
            if not self.channels.running.is_set():
                raise WorkerError(
                    f"the rollout worker exited with code {self.process.exitcode} before it started: it is a spawned "
                    "process, which imports your main script first, and that failed (see the traceback above). A script "
                    'that starts training at module level must do it under `if __name__ == "__main__":`.'
                )
            raise WorkerLost(f"the rollout worker exited with code {self.process.exitcode} without reporting an error")
        silent = time.time() - self.channels.heartbeat.value
        if silent > self.timeout_s:
            raise WorkerLost(
                f"the rollout worker sent no heartbeat for {silent:.0f}s (rollout_worker_timeout="
                f"{self.timeout_s:.0f}s): it is hung. Raise rollout_worker_timeout if rewards are that slow."
            )
