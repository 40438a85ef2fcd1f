"""The `transfer` sync: the trained weights streamed to the server without the disk (vLLM's weight-transfer API).

One protocol layer, two data planes. `TransferSync` speaks vLLM's routes, the same for every server: once, at
connect, the trainer (rank 0 of the group) opens a rendezvous at `weight_transfer_address` and, while it waits
there, asks the server (or every replica behind `tandem proxy`) to join with `/init_weight_transfer_engine`. Each
sync: pause (keep) where the plane needs it, `/start_weight_update`, then `/update_weights` with every trained
parameter's name, dtype and shape, in order (a frozen part, a vision tower, stays as the server loaded it; vLLM gets the
checkpoint's names and layouts, `checkpoint_tensors`, tandem serve the model's own) — on a
thread, since it returns only when the server has received them — while the plane sends the tensors;
`/finish_weight_update`, resume. The plane carries the tensors:
- `GlooPlane`, into `--weight-transfer-config '{"backend":"gloo"}'`: a torch.distributed gloo group. `tandem serve`
  (serve/weight_receiver.py) takes the tensors packed in a few byte buffers, stages them and swaps them in between
  two engine steps, so it generates while the weights arrive; `vllm serve` with tandem's plugin
  (integrations/vllm_plugin) takes one CPU tensor at a time and loads it in place, paused;
- `VllmNcclPlane`, into `vllm serve --weight-transfer-config '{"backend":"nccl"}'`: vLLM's own trainer-side
  helpers (the `vllm` extra) join its NCCL group and broadcast in its packed format from the trainer's GPU.
A sharded (FSDP2) parameter is gathered whole just before it is sent and freed right after, so the trainer never
holds more than one layer's tensor beyond its shard (plus vLLM's packing buffers on NCCL). A failure sends
`/finish_weight_update` and raises what went wrong: `TransferFailed` when the server keeps its previous weights
(tandem serve), `ServerProblem` when it loads in place and may hold part of the update
(vllm serve: the run stops). Every wait is bounded by `timeout_s`.
"""

import asyncio
import collections
import re
import socket
import threading
import time
from collections.abc import Awaitable, Callable, Coroutine, Iterator
from typing import Any, Generic, Protocol, TypeVar, cast

import torch
from transformers import PreTrainedModel
from transformers.core_model_loading import revert_weight_conversion

from tandem.errors import install_command
from tandem.generation.client import ENGINE_WATCH_S, ControlClient, EngineDead, ServerProblem, engine_died
from tandem.model.distributed import Ranks, full_tensor
from tandem.network import machine_addresses
from tandem.serve.weight_receiver import (
    JOIN_S,
    PACKED_BUFFER_BYTES,
    UNREACHABLE,
    BroadcastGroup,
    join_group,
)

NCCL_JOIN_S = 120.0
"""How long vLLM's NCCL group may take to form (its members are started already; NCCL's own set-up takes seconds)."""
Tensors = Iterator[tuple[str, torch.Tensor]]
T = TypeVar("T")
Announce = Callable[[int, float], None]
"""Told once the server serves a new version: (version, since), `since` the monotonic time just before generation
could go on under it (a resume sent, or the update's finish for a server that swaps it in itself)."""


def no_one(version: int, since: float) -> None:
    """An announcement nobody hears (a sync outside a run: a test, the dry run)."""


ENGINE_DEATH_CHECKS = 4
"""How many times, ENGINE_WATCH_S apart, a failed transfer asks /health whether the engine died."""


class TransferFailed(RuntimeError):
    """The weights did not reach the server; it still serves the previous version."""


class LoopRunner(Protocol):
    """What runs a client call to completion: an `asyncio.Runner`, or a `Session` (which also reports a dead server)."""

    def run(self, coroutine: Coroutine[Any, Any, T], /) -> T: ...


def checkpoint_tensors(model: PreTrainedModel, name: str, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """Parameter `name` of `model` as its checkpoint holds it, which is what vLLM loads: transformers fuses some weights
    as it loads them (an MoE's experts into one 3D tensor per layer), so one parameter may be several checkpoint tensors.
    Each parameter converts on its own (what `save_pretrained` writes, key for key)."""
    return list(revert_weight_conversion(model, {name: tensor}).items())


def free_port(address: str) -> int:
    with socket.socket() as s:
        s.bind((address, 0))
        return s.getsockname()[1]


class InThread(Generic[T]):
    """A call run to completion on its own (daemon) thread while this thread goes on, e.g. into the collective
    the call waits for. `result` bounds the wait: a peer that never arrives is an error, not a hang."""

    def __init__(self, call: Callable[[], T]):
        self.value: T | None = None
        self.error: BaseException | None = None
        self.done = False
        self.thread = threading.Thread(target=self._run, args=(call,), daemon=True)
        self.thread.start()

    def _run(self, call: Callable[[], T]) -> None:
        try:
            self.value = call()
        except BaseException as exc:  # noqa: BLE001 - reported by result() on the caller's thread
            self.error = exc
        finally:
            self.done = True

    def result(self, timeout_s: float | None, what: str = "the server did not answer") -> T:
        """The call's value once it returned (None for `timeout_s`: however long it takes), or its error."""
        self.thread.join(timeout_s)
        if not self.done:  # not is_alive(): a call that has ended may still be on its way out of the thread
            raise TimeoutError(f"{what} within {timeout_s:.0f}s")
        if self.error is not None:
            raise self.error
        return cast(T, self.value)  # set: the call ended without an error


def first_failure(first: InThread[Any], second: InThread[Any], timeout_s: float) -> None:
    """Wait for two calls that wait on each other (the server's /update_weights and the broadcast it receives): the first
    error ends the wait at once (the other call, stuck on its peer, is left to its daemon thread). Each call is bounded
    by `timeout_s` itself; this wait's own bound, a little later, only backs them up."""
    settle([first, second], timeout_s + 10, grace_s=0.0)
    for call in (first, second):
        if call.done and call.error is not None:
            raise call.error
    if not (first.done and second.done):
        raise TimeoutError(f"the server did not take the weights within {timeout_s:.0f}s")


def settle(calls: list[InThread[Any]], bound_s: float, grace_s: float = 5.0) -> None:
    """Wait until every call has ended, or one failed and the others had `grace_s` more to end (their errors tell
    what failed), or `bound_s` passed."""
    end = time.monotonic() + bound_s
    while not all(call.done for call in calls) and time.monotonic() < end:
        if any(call.done and call.error is not None for call in calls):
            end = min(end, time.monotonic() + grace_s)
        time.sleep(0.02)


def control_call(
    control: ControlClient, timeout_s: float, call: Callable[[ControlClient], Awaitable[object]]
) -> Callable[[], None]:
    """`call(client)` as a plain function, with its own client and event loop (for `InThread`)."""

    async def main() -> None:
        client = ControlClient(control.base_url, api_key=control.api_key, timeout_s=timeout_s)
        try:
            await call(client)
        finally:
            await client.close()

    return lambda: asyncio.run(main())


def unjoined(url: str, group_address: str, asked: InThread[Any], opened: InThread[Any]) -> str:
    """One line for a transfer group that did not form: which side could not reach which address, and the fix."""
    server_said, own = str(asked.error or ""), str(opened.error or "")
    if UNREACHABLE in server_said:
        return (
            f"weight transfer: the server cannot reach {group_address}, this trainer's weight_transfer_address (the "
            f"server at {url} answered: {server_said}). Set weight_transfer_address to an address of this machine "
            f"that the server's host can connect to (this machine has {', '.join(machine_addresses()) or 'none'} beside "
            "loopback), and let that host reach its ports."
        )
    for who, said in (("the server", server_said), ("this trainer", own)):
        mesh = re.search(r"remote=\[([^\]]+)\]:?(\d*)", said) if "connectFullMesh" in said else None
        if mesh:
            return (
                f"weight transfer: {who} cannot reach {mesh.group(1)}:{mesh.group(2)}, a gloo port of the group "
                f"that met at {group_address} (the server at {url}). Let each host reach the other's ports, or set "
                "GLOO_SOCKET_IFNAME on the side that gave that address to the interface of one the other can reach."
            )
    problems = "; ".join(
        f"{who}: {error}" for who, error in (("the server", asked.error), ("this trainer", opened.error)) if error
    )
    return (
        f"weight transfer: the server at {url} did not join the group at {group_address} "
        f"({problems or 'no answer within the time to join'}). It must reach that address: set "
        "weight_transfer_address to one of this machine's addresses the server can connect to, and open the port."
    )


class GlooPlane:
    """The gloo data plane: a torch.distributed group. Into tandem serve, which stages what arrives and swaps it in between
    two engine steps (generation goes on meanwhile), packed into a few byte buffers; or into vllm serve with tandem's
    plugin (integrations/vllm_plugin), which loads each tensor into the running model (generation pauses), one CPU
    tensor per broadcast, in order."""

    def __init__(self, stages: bool = True, buffer_bytes: int = PACKED_BUFFER_BYTES):
        self.pauses_generation = not stages
        self.after_failure = (
            "The server keeps serving the previous weights."
            if stages
            else "vllm serve may hold part of the new weights: restart it before training on."
        )
        self.init_fields = {"packed": True, "packed_buffer_size_bytes": buffer_bytes} if stages else {}

    join_s = JOIN_S
    """How long forming the group may take."""

    def open(self, address: str, port: int, world_size: int, timeout_s: float) -> None:
        self.group: BroadcastGroup = join_group(address, port, 0, world_size, timeout_s)

    def send(self, tensors: Tensors, timeout_s: float) -> None:
        if not self.init_fields:
            for _, tensor in tensors:  # the group's own timeout bounds each broadcast
                self._broadcast(tensor.to("cpu").contiguous())
                del tensor  # before the next gather: one whole layer held at a time
            return
        pending, filled = [], 0  # one buffer's tensors as bytes, closed as pack_chunks closes it (the receiver's split)
        for _, tensor in tensors:
            pending.append(tensor.to("cpu").contiguous().view(-1).view(torch.uint8))
            filled += len(pending[-1])
            if filled > self.init_fields["packed_buffer_size_bytes"]:
                self._broadcast(torch.cat(pending))
                pending, filled = [], 0
        if pending:
            self._broadcast(torch.cat(pending))

    def _broadcast(self, tensor: torch.Tensor) -> None:
        self.group.broadcast(tensor, 0).wait()


class VllmNcclPlane:
    """vllm serve's data plane: the rendezvous (`nccl_common.trainer_init`) and the packed double-buffered broadcast
    (`packed_tensor.packed_nccl_broadcast_producer`) are vLLM's own (0.30+), so the format always matches the
    server's. The packing is agreed in `init_info`, as vLLM's trainer engine does. NCCL calls cannot be
    interrupted, so both run on a thread and a peer that never arrives ends in a clear error after `timeout_s`
    (the group is unusable after that: the run stops)."""

    def __init__(self, device: torch.device):
        try:
            from vllm.distributed.weight_transfer import nccl_common, packed_tensor
        except ImportError as exc:
            raise ImportError(
                f"vllm serve transfers weights over NCCL with vLLM's own helpers, and they did not import "
                f"({exc}). Install them with: {install_command('vllm')}, or start "
                "vllm serve without --weight-transfer-config to sync through a folder it reloads."
            ) from exc
        self.nccl_common, self.packed_tensor, self.device = nccl_common, packed_tensor, device
        self.init_fields = {
            "packed": True,
            "packed_buffer_size_bytes": packed_tensor.DEFAULT_PACKED_BUFFER_SIZE_BYTES,
            "packed_num_buffers": packed_tensor.DEFAULT_PACKED_NUM_BUFFERS,
        }

    after_failure = (
        "vllm serve's workers may still wait inside the broadcast, unable to take another update: restart "
        "the server (it serves the previous weights until then). This process's transfer group is unusable."
    )
    join_s = NCCL_JOIN_S
    """How long forming the group may take (NCCL's own set-up takes seconds)."""
    pauses_generation = True
    """vLLM loads each tensor into the running model as it arrives: generation must wait for the whole update."""

    def _on_device(self, call: Callable[[], T]) -> Callable[[], T]:
        """`call` on a new thread's CUDA device set to the trainer's (the current device is per thread)."""

        def run() -> T:
            if self.device.type == "cuda":
                torch.cuda.set_device(self.device)
            return call()

        return run

    def open(self, address: str, port: int, world_size: int, timeout_s: float) -> None:
        rendezvous = {"master_address": address, "master_port": port, "world_size": world_size}
        opening = InThread(self._on_device(lambda: self.nccl_common.trainer_init(rendezvous)))
        self.group = opening.result(min(timeout_s, NCCL_JOIN_S), "the server's workers did not join the NCCL group")

    def send(self, tensors: Tensors, timeout_s: float) -> None:
        sending = InThread(
            self._on_device(
                lambda: self.packed_tensor.packed_nccl_broadcast_producer(
                    iterator=tensors,
                    group=self.group,
                    src=0,
                    post_iter_func=lambda item: item[1],
                    buffer_size_bytes=self.init_fields["packed_buffer_size_bytes"],
                    num_buffers=self.init_fields["packed_num_buffers"],
                )
            )
        )
        sending.result(timeout_s, "the NCCL broadcast of the weights did not complete")


class TransferSync:
    def __init__(
        self,
        control: ControlClient | None,
        run: LoopRunner | None,
        served_name: str,
        ranks: Ranks = Ranks(),
        address: str = "127.0.0.1",
        timeout_s: float = 600.0,
        plane: GlooPlane | VllmNcclPlane | None = None,
        checkpoint_names: bool = False,
    ):
        self.control, self.run, self.served_name, self.ranks = control, run, served_name, ranks
        self.address, self.timeout_s = address, timeout_s
        self.plane = plane or GlooPlane()
        self.checkpoint_names = checkpoint_names
        """Send the checkpoint's names and layouts (vLLM), not the model's (tandem serve loads through transformers)."""

    def name_for(self, version: int) -> str:
        return self.served_name

    def _server(self) -> tuple[ControlClient, LoopRunner]:
        """The control client and what runs its calls: rank 0 alone has them (the other ranks only join the gathers)."""
        assert self.control is not None and self.run is not None, "only rank 0 talks to the server"
        return self.control, self.run

    def connect(self) -> int:
        """Form the group with the server's workers (rank 0 only); returns how many joined. A server that cannot reach
        `address`, or whose gloo address this machine cannot reach, stops the run in one line naming the direction,
        within the plane's `join_s` (gloo: 15 s) of asking."""
        control, run = self._server()
        workers = run.run(control.world_size())
        port = free_port(self.address)
        info = {
            "master_address": self.address,
            "master_port": port,
            "rank_offset": 1,
            "world_size": 1 + workers,
        } | self.plane.init_fields
        asked = InThread(control_call(control, self.timeout_s, lambda client: client.init_weight_transfer(info)))
        opened = InThread(lambda: self.plane.open(self.address, port, 1 + workers, self.timeout_s))
        settle([asked, opened], self.plane.join_s + 10)
        if not (asked.done and opened.done) or asked.error or opened.error:
            raise ServerProblem(unjoined(control.base_url, f"{self.address}:{port}", asked, opened))
        return workers

    def push(self, model: torch.nn.Module, version: int, announce: Announce = no_one) -> dict[str, float]:
        """Stream every trained parameter to the server as `version` (every rank takes part in the gathers); a frozen part
        (a vision-language model's vision tower) keeps the weights the server loaded."""
        params = [(name, p) for name, p in model.named_parameters() if p.requires_grad]  # tied weights once, as served

        def as_sent(name: str, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
            if not self.checkpoint_names:
                return [(name, tensor)]
            assert isinstance(model, PreTrainedModel), "checkpoint names are a transformers model's"
            return checkpoint_tensors(model, name, tensor)

        tensors = (sent for name, param in params for sent in as_sent(name, full_tensor(param.detach())))
        if not self.ranks.main:
            collections.deque(tensors, maxlen=0)  # take part in every gather, keeping none
            return {}
        control, run = self._server()
        announced = [
            sent
            for name, param in params  # names, dtypes and shapes, from the full shapes on no device
            for sent in as_sent(name, torch.empty(param.shape, dtype=param.dtype, device="meta"))
        ]
        start = time.perf_counter()
        if self.plane.pauses_generation:
            run.run(control.pause("keep"))
        paused = time.perf_counter()
        run.run(control.start_weight_update())
        self._transfer(version, announced, tensors)
        since = time.monotonic()  # tandem serve swaps the update in between two steps after its finish
        run.run(control.finish_weight_update(str(version)))
        if self.plane.pauses_generation:  # vLLM: its prefix cache outlives a transfer (tandem serve's drops its own)
            run.run(control.reset_prefix_cache())
            since = time.monotonic()
        announce(version, since)  # before a resume: a token sampled after it must find its version marked
        if self.plane.pauses_generation:
            run.run(control.resume())
        done = time.perf_counter()
        return {
            "perf/weight_sync_s": done - start,
            "perf/weight_sync_pause_s": paused - start,
            "perf/weight_sync_transfer_s": done - paused,
        }

    def _transfer(self, version: int, announced: list[tuple[str, torch.Tensor]], tensors: Tensors) -> None:
        """The open update's `/update_weights` (names, dtypes and shapes from `announced`) while the plane sends
        `tensors`; on a failure the update is abandoned and the error says whether the server kept its weights."""
        control, _ = self._server()
        names = [name for name, _ in announced]
        dtypes = [str(tensor.dtype).removeprefix("torch.") for _, tensor in announced]
        shapes = [list(tensor.shape) for _, tensor in announced]
        call = InThread(
            control_call(control, self.timeout_s, lambda client: client.update_weights(names, dtypes, shapes))
        )
        try:
            if self.ranks.several:  # the gathers are collectives: on the thread the other ranks run them on
                self.plane.send(tensors, self.timeout_s)
                call.result(self.timeout_s)
            else:
                first_failure(call, InThread(lambda: self.plane.send(tensors, self.timeout_s)), self.timeout_s)
        except BaseException as exc:
            error = self._engine_death(exc)
            self._abandon()
            if isinstance(error, EngineDead):
                raise ServerProblem(f"weight transfer of version {version} failed: {engine_died(error)}") from None
            # A server that loads in place (vLLM) may now hold part of the new weights: no sync again can be trusted.
            failed = ServerProblem if self.plane.pauses_generation else TransferFailed
            raise failed(f"weight transfer of version {version} failed: {error}. {self.plane.after_failure}") from error

    def push_in_thread(
        self, model: torch.nn.Module, version: int, announce: Announce = no_one
    ) -> InThread[dict[str, float]]:
        """`push` on a thread of its own, with its own event loop and client, while the caller trains on: the caller's loop
        stays free for its own calls, and nothing may change the weights until the thread's `result`."""

        def push() -> dict[str, float]:
            leader, _ = self._server()
            with asyncio.Runner() as runner:
                control = ControlClient(leader.base_url, api_key=leader.api_key, timeout_s=self.timeout_s)
                own = TransferSync(
                    control,
                    runner,
                    self.served_name,
                    self.ranks,
                    self.address,
                    self.timeout_s,
                    self.plane,
                    self.checkpoint_names,
                )
                try:
                    return own.push(model, version, announce)
                finally:
                    runner.run(control.close())

        return InThread(push)

    def _engine_death(self, error: BaseException) -> BaseException:
        """`error`, or `EngineDead` when the engine died: the plane's broken connection is how a dead engine shows first,
        a moment before the server's /health says so (vLLM: about a second), so /health is asked for a few seconds."""
        if isinstance(error, EngineDead) or not isinstance(error, Exception):
            return error
        control, run = self._server()
        for _ in range(ENGINE_DEATH_CHECKS):
            try:
                run.run(control.raise_if_engine_dead())
            except EngineDead as dead:
                return dead
            except Exception:  # noqa: BLE001 - the transfer's own error is the one to report
                return error
            time.sleep(ENGINE_WATCH_S)
        return error

    def _abandon(self) -> None:
        """Close the failed update (the server swaps nothing in) and let generation go on, as far as it answers."""
        control, run = self._server()
        for call in (control.finish_weight_update(None), control.resume()):
            try:
                run.run(asyncio.wait_for(call, 30))
            except Exception:  # noqa: BLE001 - best effort: the transfer's own error is the one to report
                pass
