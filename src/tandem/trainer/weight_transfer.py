"""The `transfer` sync: the whole model streamed to the server over a torch.distributed group, without the disk
(reference/vllm_protocol.md §6.4; the server's end is generation/weight_transfer.py).

Once, at connect: the trainer (rank 0 of the group) opens a rendezvous at `weight_transfer_address` and, while it
waits there, asks the server (or every replica behind `tandem proxy`) to join with `/init_weight_transfer_engine`.
Each sync: pause (keep), `/start_weight_update`, then `/update_weights` with every parameter's name, dtype and
shape, in order — on a thread, since it returns only when the server has received them — while the trainer
broadcasts the tensors one at a time; `/finish_weight_update`, resume. A sharded (FSDP2) parameter is gathered
whole just before its broadcast and freed right after, so the trainer never holds more than one layer's tensor
beyond its shard. A failure sends `/finish_weight_update` (the server then keeps its previous weights) and stops
training with what went wrong; every wait is bounded by `timeout_s`.
"""

import asyncio
import socket
import threading
import time

import torch

from tandem.generation.client import ControlClient
from tandem.generation.weight_transfer import join_group
from tandem.trainer.distributed import Ranks, full_tensor


class TransferFailed(RuntimeError):
    """The weights did not reach the server; it still serves the previous version."""


def free_port(address: str) -> int:
    with socket.socket() as s:
        s.bind((address, 0))
        return s.getsockname()[1]


class InThread:
    """One control call run to completion on its own thread (with its own client and event loop) while this thread
    takes part in the collective the call waits for."""

    def __init__(self, base_url: str, api_key: str | None, timeout_s: float, call):
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, args=(base_url, api_key, timeout_s, call), daemon=True)
        self.thread.start()

    def _run(self, base_url, api_key, timeout_s, call) -> None:
        async def main():
            client = ControlClient(base_url, api_key=api_key, timeout_s=timeout_s)
            try:
                await call(client)
            finally:
                await client.close()

        try:
            asyncio.run(main())
        except BaseException as exc:  # noqa: BLE001 - reported by result() on the caller's thread
            self.error = exc

    def result(self, timeout_s: float) -> None:
        self.thread.join(timeout_s)
        if self.thread.is_alive():
            raise TimeoutError(f"the server did not answer within {timeout_s:.0f}s")
        if self.error is not None:
            raise self.error


class TransferSync:
    def __init__(self, control: ControlClient | None, run, served_name: str, ranks: Ranks = Ranks(),
                 address: str = "127.0.0.1", timeout_s: float = 600.0):
        self.control, self.run, self.served_name, self.ranks = control, run, served_name, ranks
        self.address, self.timeout_s = address, timeout_s
        self.group = None

    def name_for(self, version: int) -> str:
        return self.served_name

    def connect(self) -> int:
        """Form the group with the server's workers (rank 0 only); returns how many joined."""
        workers = self.run.run(self.control.world_size())
        port = free_port(self.address)
        info = {"master_address": self.address, "master_port": port, "rank_offset": 1, "world_size": 1 + workers}
        call = InThread(self.control.base_url, self.control.api_key, self.timeout_s,
                        lambda client: client.init_weight_transfer(info))
        try:
            self.group = join_group(self.address, port, 0, 1 + workers, self.timeout_s)
            call.result(self.timeout_s)
        except Exception as exc:
            raise TransferFailed(f"weight transfer: the server at {self.control.base_url} did not join the group at "
                                 f"{self.address}:{port} ({exc}). It must reach that address: set "
                                 "weight_transfer_address to one of this machine's addresses the server can connect "
                                 "to, and open the port.") from exc
        return workers

    def push(self, model: torch.nn.Module, version: int, announce=lambda version: None) -> dict[str, float]:
        """Stream every parameter to the server as `version` (every rank takes part in the gathers)."""
        params = list(model.named_parameters())  # tied weights once, as the server's own named_parameters
        if not self.ranks.main:
            for _, param in params:
                full_tensor(param.detach())
            return {}
        start = time.perf_counter()
        self.run.run(self.control.pause("keep"))
        paused = time.perf_counter()
        self.run.run(self.control.start_weight_update())
        names = [name for name, _ in params]
        dtypes = [str(param.dtype).removeprefix("torch.") for _, param in params]
        shapes = [list(param.shape) for _, param in params]
        call = InThread(self.control.base_url, self.control.api_key, self.timeout_s,
                        lambda client: client.update_weights(names, dtypes, shapes))
        try:
            for _, param in params:
                tensor = full_tensor(param.detach()).to("cpu").contiguous()  # gloo moves CPU tensors
                self.group.broadcast(tensor, 0).wait()
                del tensor
            call.result(self.timeout_s)
        except BaseException as exc:
            self._abandon()
            raise TransferFailed(f"weight transfer of version {version} failed: {exc}. The server keeps serving the "
                                 "previous weights.") from exc
        self.run.run(self.control.finish_weight_update(str(version)))
        self.run.run(self.control.reset_prefix_cache())  # vLLM keeps its prefix cache across a transfer
        self.run.run(self.control.resume())
        announce(version)
        done = time.perf_counter()
        return {"perf/weight_sync_s": done - start, "perf/weight_sync_pause_s": paused - start,
                "perf/weight_sync_transfer_s": done - paused}

    def _abandon(self) -> None:
        """Close the failed update (the server swaps nothing in) and let generation go on, as far as it answers."""
        for call in (self.control.finish_weight_update(None), self.control.resume()):
            try:
                self.run.run(asyncio.wait_for(call, 30))
            except Exception:  # noqa: BLE001 - best effort: the transfer's own error is the one to report
                pass
