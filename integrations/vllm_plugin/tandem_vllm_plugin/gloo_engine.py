"""vLLM's end of tandem's gloo weight stream (the trainer's end is tandem/runtime/weight_transfer.py, `GlooPlane`).

    init_info   {master_address, master_port, rank_offset, world_size}: join the trainer's gloo group
    update_info {names, dtype_names, shapes}: receive each tensor from rank 0, in order, into model.load_weights

Each update runs inside vLLM's layerwise reload (like its NCCL engine): a layer is processed for its kernels once
all its weights have arrived. A layer that owns no checkpoint name, the LM head tied to the embedding, is never
processed by that reload, and on CPU its kernel keeps a packed copy of the *old* weight (an LM head 2% off after
one step of the tiny model): `finish_weight_update` processes such tied layers again. An MoE layer on vLLM's CPU
experts is processed but not packed again: `pack_experts_when_processed` has it packed.
"""

import os
import socket
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)

TIMEOUT_S = float(os.environ.get("TANDEM_WEIGHT_TRANSFER_TIMEOUT_S", "600"))
"""How long one broadcast may wait for the trainer before the update fails instead of hanging."""
JOIN_S = 15.0
"""How long joining the trainer's group may take: both ends are running, so a longer wait means one cannot reach the
other (the trainer then names the direction, by this module's "cannot reach the trainer's rendezvous at")."""


def address_toward(peer: str) -> str:
    """This machine's address that the route to `peer` leaves from (a connected UDP socket sends nothing)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect((peer, 9))
        return probe.getsockname()[0]


def gloo_options(local_address: str, timeout: timedelta) -> dist.ProcessGroupGloo._Options:
    """A gloo device bound to `local_address` (or to GLOO_SOCKET_IFNAME's interface when set): left to itself, gloo
    advertises the hostname's address, 127.0.0.1 on many machines, which a trainer on another host cannot reach. The
    same rule as tandem's own servers (tandem/network.py); this package runs in vLLM's environment, without tandem."""
    options = dist.ProcessGroupGloo._Options()
    chosen = os.environ.get("GLOO_SOCKET_IFNAME", "").split(",")[0]
    create = dist.ProcessGroupGloo.create_device
    options._devices = [create(interface=chosen) if chosen else create(hostname=local_address)]
    options._timeout = timeout
    return options


@dataclass
class GlooInitInfo(WeightTransferInitInfo):
    master_address: str
    master_port: int
    rank_offset: int
    world_size: int


@dataclass
class GlooUpdateInfo(WeightTransferUpdateInfo):
    names: list[str]
    dtype_names: list[str]
    shapes: list[list[int]]

    def __post_init__(self):
        if not len(self.names) == len(self.dtype_names) == len(self.shapes):
            raise ValueError(
                f"update_info: names, dtype_names and shapes must have equal lengths, got "
                f"{len(self.names)}, {len(self.dtype_names)} and {len(self.shapes)}"
            )


def tied_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """Layers whose weight is processed for a kernel (`quant_method`) and shares its storage with another such layer's:
    one of each pair gets no checkpoint name, so no reload processes it. Both are processed again (cheap: one pair)."""
    by_storage: dict[int, list[torch.nn.Module]] = {}
    for layer in model.modules():
        weight = getattr(layer, "weight", None)
        if getattr(layer, "quant_method", None) is None or not isinstance(weight, torch.Tensor) or weight.is_meta:
            continue
        by_storage.setdefault(weight.untyped_storage().data_ptr(), []).append(layer)
    return [layer for layers in by_storage.values() if len(layers) > 1 for layer in layers]


def pack_experts_when_processed(model: torch.nn.Module) -> None:
    """Have each MoE layer whose experts run on vLLM's CPU kernels pack its weights again whenever a reload processes
    it. vLLM 0.32 packs them into a grouped-GEMM layout on the first load only: a reload processes the layer's new
    weights without packing them (`UnquantizedFusedMoEMethod._setup_kernel` skips it on a weight update) and copies them
    into the packed storage, which served a random Qwen3-MoE 0.067 off after a stream of the very weights it held. The
    reload processes only the layers it loaded, so only those are packed, and before the copy (padded shapes agree)."""
    try:
        from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts
    except ImportError:  # a build without CPU experts
        return
    for layer in model.modules():
        method = getattr(layer, "quant_method", None)
        experts = getattr(getattr(method, "moe_kernel", None), "fused_experts", None)
        if not isinstance(experts, CPUUnquantizedExperts) or getattr(method, "packs_on_reload", False):
            continue

        def process_and_pack(layer, process=method.process_weights_after_loading, experts=experts):
            process(layer)
            experts.process_weights_after_loading(layer)

        method.process_weights_after_loading, method.packs_on_reload = process_and_pack, True


class GlooWeightTransferEngine(WeightTransferEngine[GlooInitInfo, GlooUpdateInfo]):
    init_info_cls = GlooInitInfo
    update_info_cls = GlooUpdateInfo
    supports_draft_weight_update = False
    group: dist.ProcessGroup | None = None

    def init_transfer_engine(self, init_info: GlooInitInfo) -> None:
        config = self.parallel_config
        rank = init_info.rank_offset + config.data_parallel_index * config.world_size + config.rank
        rendezvous = timedelta(seconds=min(TIMEOUT_S, JOIN_S))
        address, port = init_info.master_address, init_info.master_port
        local = address
        try:
            local = address_toward(address)
            store = dist.TCPStore(
                address, port, init_info.world_size, is_master=False, timeout=rendezvous, wait_for_workers=False
            )
        except (OSError, dist.DistNetworkError) as exc:
            source = f" from {local}" if local != address else ""
            raise dist.DistNetworkError(
                f"this server cannot reach the trainer's rendezvous at {address}:{port}{source} within "
                f"{rendezvous.seconds} s: {exc}"
            ) from None
        group = dist.ProcessGroupGloo(store, rank, init_info.world_size, gloo_options(local, rendezvous))
        group.set_timeout(timedelta(seconds=TIMEOUT_S))
        self.group = group

    def start_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        pack_experts_when_processed(self.model)
        initialize_layerwise_reload(self.model)

    def update_weights(self, update_info: dict) -> None:
        """Receive the announced tensors (gloo is synchronous: nothing to wait for after). On a failure the reload is
        finalised before the error goes on: vLLM's worker then refuses /finish_weight_update, and layers left on the meta
        device would crash the next step. The model may hold part of the update: the trainer stops and says so."""
        try:
            self.receive_weights(self.parse_update_info(update_info))
        except BaseException:
            self.finish_weight_update()
            raise

    def receive_weights(self, update_info: GlooUpdateInfo) -> None:
        if self.group is None:
            raise RuntimeError("gloo weight transfer: /update_weights before /init_weight_transfer_engine")
        from vllm.model_executor.model_loader.mtp_validation import disable_mtp_completeness_check

        with disable_mtp_completeness_check():
            for name, dtype, shape in zip(update_info.names, update_info.dtype_names, update_info.shapes):
                tensor = torch.empty(shape, dtype=getattr(torch, dtype))
                self.group.broadcast(tensor, 0).wait()
                self.model.load_weights([(name, tensor.to(self.device))])

    def finish_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        finalize_layerwise_reload(self.model, self.model_config)
        for layer in tied_layers(self.model):
            layer.quant_method.process_weights_after_loading(layer)

    def shutdown(self) -> None:
        self.group = None
