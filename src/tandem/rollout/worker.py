"""The rollout worker process: spawned (no GPU visible), it runs an `AsyncRolloutLoop` to completion.

`WorkerSpec` is everything the process needs, pickled across the boundary. `RolloutWorker` is the
trainer's handle: it starts the process and reads its messages, turning a crash, a silent death or a
missed heartbeat into an error that carries the worker's own traceback.
"""

import multiprocessing as mp
import os
import pickle
import queue
import time
import traceback
from dataclasses import dataclass

from tandem.config import AsyncGRPOConfig
from tandem.rollout.channels import Channels


@dataclass
class WorkerSpec:
    loop_cls: type
    config: AsyncGRPOConfig
    model_name: str
    tokenizer_path: str
    dataset: object
    reward_funcs: list
    eos_token_ids: list[int]
    base_url: str
    api_key: str | None
    tools: list | None
    environment_factory: object
    dataset_start_index: int
    full_step_tokens: float
    num_positions: int | None
    adapter_name: str | None = None


class WorkerError(RuntimeError):
    pass


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
    import asyncio

    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(spec.tokenizer_path)
        loop = spec.loop_cls(
            config=spec.config, model_name=spec.model_name, dataset=spec.dataset, reward_funcs=spec.reward_funcs,
            processing_class=tokenizer, eos_token_ids=spec.eos_token_ids, channels=channels, base_url=spec.base_url,
            api_key=spec.api_key, tools=spec.tools, environment_factory=spec.environment_factory,
            dataset_start_index=spec.dataset_start_index, full_step_tokens=spec.full_step_tokens,
            num_positions=spec.num_positions, adapter_name=spec.adapter_name,
        )
        asyncio.run(loop.run())
    except BaseException:
        channels.out.put(("error", traceback.format_exc()))
        time.sleep(0.5)  # let the queue's feeder thread flush the message
        raise SystemExit(1)


class RolloutWorker:
    def __init__(self, spec: WorkerSpec, timeout_s: float):
        context = mp.get_context("spawn")
        self.channels = Channels.create(context)
        self.timeout_s = timeout_s
        self.process = context.Process(target=worker_main, args=(spec, self.channels), name="tandem-rollout-worker", daemon=True)

    def start(self) -> None:
        self.channels.heartbeat.value = time.time()
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        os.environ["CUDA_VISIBLE_DEVICES"] = ""  # the spawned process inherits this: no GPU for the worker
        try:
            self.process.start()
        finally:
            if visible is None:
                del os.environ["CUDA_VISIBLE_DEVICES"]
            else:
                os.environ["CUDA_VISIBLE_DEVICES"] = visible

    def stop(self) -> None:
        self.channels.stop.set()
        if self.process.is_alive():
            self.process.terminate()
        self.process.join(timeout=10)

    def get(self, timeout_s: float) -> tuple[str, object] | None:
        """The next message, or None after `timeout_s`; raises WorkerError if the worker failed or hung."""
        try:
            kind, payload = self.channels.out.get(timeout=timeout_s)
        except queue.Empty:
            self._check_alive()
            return None
        if kind == "error":
            raise WorkerError(f"the rollout worker failed:\n{payload}")
        return kind, payload

    def _check_alive(self) -> None:
        if not self.process.is_alive() and self.process.exitcode not in (0, None):
            if not self.channels.running.is_set():
                raise WorkerError(
                    f"the rollout worker exited with code {self.process.exitcode} before it started: it is a spawned "
                    "process, which imports your main script first, and that failed (see the traceback above). A script "
                    "that starts training at module level must do it under `if __name__ == \"__main__\":`.")
            raise WorkerError(f"the rollout worker exited with code {self.process.exitcode} without reporting an error")
        silent = time.time() - self.channels.heartbeat.value
        if silent > self.timeout_s:
            raise WorkerError(f"the rollout worker sent no heartbeat for {silent:.0f}s (rollout_worker_timeout="
                              f"{self.timeout_s:.0f}s): it is hung. Raise rollout_worker_timeout if rewards are that slow.")
