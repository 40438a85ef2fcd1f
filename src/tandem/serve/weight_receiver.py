"""Weights over the network instead of the disk: vLLM's weight-transfer protocol (`--weight-transfer-config`)
with a torch.distributed gloo group as its data plane, for `tandem serve --weight-transfer-config '{"backend":"gloo"}'`.

    /init_weight_transfer_engine  join the group the trainer holds (rank 0); this server is rank `rank_offset`
    /start_weight_update          open an update
    /update_weights               receive `names` in order, each broadcast by rank 0 with its dtype and shape
    /finish_weight_update         the received tensors replace the served ones between two engine steps

Received tensors are staged until `finish`, so an update that fails midway (a dead trainer, a timeout, a name the
model lacks) leaves the previous weights served. With `packed` in init_info (as vLLM's NCCL backend takes it) the
tensors arrive as a few byte buffers of up to `packed_buffer_size_bytes` (`pack_chunks`) instead of one broadcast each:
the receiving thread takes the GIL from the engine's once per buffer, not once per tensor (the tiny model's 50
tensors took 53 ms under load). `join_group` is also the trainer's; its sender closes buffers by the same rule as it
streams.
"""

from dataclasses import dataclass, field
from datetime import timedelta
from typing import Protocol, cast

import torch
import torch.distributed as dist

from tandem.network import address_toward, gloo_options

INIT_FIELDS = ("master_address", "master_port", "rank_offset", "world_size")
PACKED_BUFFER_BYTES = 64 * 2**20
"""A packed buffer's default size: what the two sides hold beyond the weights during a transfer."""


class TransferError(ValueError):
    """A weight-transfer call that does not fit the protocol's state or the served model (answered 400)."""


JOIN_S = 15.0
"""How long joining a gloo group may take: its members are running already (the server answered, the trainer holds the
rendezvous), so a longer wait means one cannot reach another, and the run says so well within 30 s."""
UNREACHABLE = "cannot reach the trainer's rendezvous at"
"""The phrase of a server's error when it could not connect to the trainer (the trainer names the direction by it)."""


class BroadcastGroup(Protocol):
    """What the transfer uses of a torch.distributed group: broadcasts from one rank."""

    def broadcast(self, tensor: torch.Tensor, root: int, /) -> dist.Work: ...


def join_group(address: str, port: int, rank: int, world_size: int, timeout_s: float) -> BroadcastGroup:
    """A gloo group of `world_size` processes rendezvousing at address:port; it returns once all have joined, or fails
    after JOIN_S. Rank 0 hosts the store and binds its gloo device to `address`; the others bind theirs to the address
    their route to it leaves from (network.py: never the hostname's, often 127.0.0.1). Every later collective fails
    after `timeout_s` instead of hanging."""
    rendezvous = timedelta(seconds=min(timeout_s, JOIN_S))
    local = address
    try:
        if rank:
            local = address_toward(address)
        store = dist.TCPStore(
            address, port, world_size, is_master=rank == 0, timeout=rendezvous, wait_for_workers=False
        )
    except (OSError, dist.DistNetworkError) as exc:
        if rank == 0:
            raise
        source = f" from {local}" if local != address else ""
        raise dist.DistNetworkError(
            f"this server {UNREACHABLE} {address}:{port}{source} within {rendezvous.seconds} s: {exc}"
        ) from None
    group = dist.ProcessGroupGloo(store, rank, world_size, gloo_options(local, rendezvous))
    group.set_timeout(timedelta(seconds=timeout_s))
    return cast(BroadcastGroup, group)  # torch's stubs leave the collectives off the gloo backend it has at runtime


def pack_chunks(sizes: list[int], buffer_bytes: int) -> list[range]:
    """Consecutive tensors (by their sizes in bytes) grouped into packed buffers as vLLM's packed_tensor groups them: a
    buffer takes tensors until its size exceeds `buffer_bytes`, the tensor that crosses it included."""
    chunks, start, filled = [], 0, 0
    for index, size in enumerate(sizes):
        filled += size
        if filled > buffer_bytes:
            chunks.append(range(start, index + 1))
            start, filled = index + 1, 0
    return chunks + ([range(start, len(sizes))] if start < len(sizes) else [])


@dataclass
class Receiver:
    """The server's end of the protocol: its group, the open update and the tensors received for it."""

    timeout_s: float = 600.0
    group: BroadcastGroup | None = None
    rank: int = 0
    packed_bytes: int | None = None
    """The packed buffers' size (init_info's `packed`), or None: one broadcast per tensor."""
    active: bool = False
    failed: bool = False
    """A call of the open update failed: `finish` swaps nothing in."""
    staged: dict[str, torch.Tensor] = field(default_factory=dict)

    def init(self, init_info: dict) -> None:
        """Join the trainer's group (blocks until every member has joined)."""
        missing = [name for name in INIT_FIELDS if name not in init_info]
        if missing:
            raise TransferError(
                f"init_info lacks {missing}: tandem serve's gloo backend rendezvouses at "
                "master_address:master_port with rank_offset and world_size"
            )
        self.group = join_group(
            str(init_info["master_address"]),
            int(init_info["master_port"]),
            int(init_info["rank_offset"]),
            int(init_info["world_size"]),
            self.timeout_s,
        )
        self.rank = int(init_info["rank_offset"])
        packed = init_info.get("packed", False)
        self.packed_bytes = int(init_info.get("packed_buffer_size_bytes", PACKED_BUFFER_BYTES)) if packed else None
        self.active, self.failed, self.staged = False, False, {}  # an update left open in the old group is dropped

    def start(self) -> None:
        if self.group is None:
            raise TransferError(
                "start_weight_update before /init_weight_transfer_engine: initialise the transfer first."
            )
        if self.active:
            raise TransferError(
                "start_weight_update called while a weight update is already active. Call finish_weight_update first."
            )
        self.active, self.failed, self.staged = True, False, {}

    def receive(self, update_info: dict, served: dict[str, torch.Tensor]) -> None:
        """Receive every tensor `update_info` announces, in order. A name the model lacks or a wrong shape is
        reported after all tensors arrived (the sender broadcasts them anyway). Any failure drops the whole update."""
        if not self.active:
            raise TransferError("start_weight_update must be called before update_weights.")
        names, dtypes, shapes = (update_info.get(key) or [] for key in ("names", "dtype_names", "shapes"))
        if not (len(names) == len(dtypes) == len(shapes)):
            self.failed = True
            raise TransferError(
                f"update_info: names, dtype_names and shapes must have equal lengths, got "
                f"{len(names)}, {len(dtypes)} and {len(shapes)}"
            )
        problems, received = [], {}
        try:
            for name, tensor in zip(names, self._tensors(dtypes, shapes)):
                if name not in served:
                    problems.append(f"{name!r} is not a parameter of the served model")
                elif tuple(served[name].shape) != tuple(tensor.shape):
                    problems.append(
                        f"{name!r} has shape {tuple(tensor.shape)}, the model expects {tuple(served[name].shape)}"
                    )
                received[name] = tensor
        except Exception:
            self.failed = True
            raise
        if problems:
            self.failed = True
            raise TransferError(
                "update_weights: " + "; ".join(problems[:5]) + " (the update is dropped; the server keeps "
                "its previous weights)"
            )
        self.staged |= received

    def _tensors(self, dtypes: list[str], shapes: list[list[int]]):
        """The update's tensors in order, as they arrive: one broadcast each, or unpacked from each packed buffer."""
        group = self.group
        assert group is not None, "start() refuses an update before the group is joined"
        empties = [torch.empty(shape, dtype=getattr(torch, dtype)) for dtype, shape in zip(dtypes, shapes)]
        if self.packed_bytes is None:
            for tensor in empties:
                group.broadcast(tensor, 0).wait()
                yield tensor
            return
        sizes = [t.numel() * t.element_size() for t in empties]
        for chunk in pack_chunks(sizes, self.packed_bytes):
            buffer = torch.empty(sum(sizes[i] for i in chunk), dtype=torch.uint8)
            group.broadcast(buffer, 0).wait()
            offset = 0
            for i in chunk:
                empties[i].view(-1).view(torch.uint8).copy_(buffer[offset : offset + sizes[i]])
                offset += sizes[i]
                yield empties[i]

    def finish(self, discard: bool = False) -> dict[str, torch.Tensor]:
        """Close the update; returns what to swap in: nothing when any part of it failed, or when told to discard it
        (tandem proxy does, when the update failed on another replica: all replicas or none)."""
        if not self.active:
            raise TransferError("finish_weight_update called without a matching start_weight_update.")
        staged = {} if self.failed or discard else self.staged
        self.active, self.failed, self.staged = False, False, {}
        return staged
