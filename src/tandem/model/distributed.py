"""Training across processes started by `torchrun`: the process group, FSDP2 sharding and the few collectives
the trainer needs.

Without torchrun a run is one rank of one and every helper here is the identity, so the trainer reads the
same either way. Rank 0 alone owns the rollout worker, the server and the metric sinks; it plans each step's
micro-batches and sends them to every rank, and each rank trains its own row of every micro-batch.
"""

import os
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

from tandem.config_checks import reshard_after_forward
from tandem.network import gloo_bound_toward


@dataclass(frozen=True)
class Ranks:
    """Where this process stands: its rank, how many there are, and the group that carries Python objects
    (gloo, also under NCCL, so that rows and metric records never need a GPU copy)."""

    rank: int = 0
    world_size: int = 1
    # quoted: torch builds without distributed lack the class
    objects: "dist.ProcessGroup | None" = field(default=None, repr=False)

    @property
    def main(self) -> bool:
        return self.rank == 0

    @property
    def several(self) -> bool:
        return self.world_size > 1

    def broadcast(self, value):
        """Rank 0's `value`, on every rank."""
        if not self.several:
            return value
        box = [value if self.main else None]
        dist.broadcast_object_list(box, src=0, group=self.objects)
        return box[0]

    def all_gather(self, value) -> list:
        """Every rank's `value`, in rank order, on every rank."""
        if not self.several:
            return [value]
        gathered = [None] * self.world_size
        dist.all_gather_object(gathered, value, group=self.objects)
        return gathered

    def gather(self, value) -> list | None:
        """Every rank's `value`, in rank order, on rank 0 (None elsewhere)."""
        if not self.several:
            return [value]
        gathered = [None] * self.world_size if self.main else None
        dist.gather_object(value, gathered, dst=0, group=self.objects)
        return gathered

    def total(self, value: float) -> float:
        """The sum of `value` over the ranks."""
        return sum(self.all_gather(value)) if self.several else value

    def barrier(self) -> None:
        if self.several:
            dist.barrier(group=self.objects)


def local_main() -> bool:
    """This process is its machine's first (torchrun's LOCAL_RANK 0, or no torchrun)."""
    return int(os.environ.get("LOCAL_RANK", 0)) == 0


def join(timeout_s: float) -> Ranks:
    """This process's place in the torchrun group (gloo on CPU, NCCL on GPU, one GPU per local rank), or a single
    process when torchrun did not start it. `timeout_s` bounds every collective, so a rank that died is an error."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if world_size == 1:
        return Ranks()
    # gloo (the CPU backend, and the object group beside NCCL) binds to the hostname's address unless told, and a
    # hostname that resolves to 127.0.0.1 (many containers) cannot be reached from another host
    with gloo_bound_toward(os.environ.get("MASTER_ADDR", "127.0.0.1")):
        if not dist.is_initialized():
            cuda = torch.cuda.is_available()
            if cuda:
                torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
            dist.init_process_group("nccl" if cuda else "gloo", timeout=timedelta(seconds=timeout_s))
        objects = dist.new_group(backend="gloo") if dist.get_backend() != "gloo" else dist.group.WORLD
    return Ranks(dist.get_rank(), dist.get_world_size(), objects)


def shard(model: torch.nn.Module, ranks: Ranks, fsdp_config: dict | None, bf16: bool) -> None:
    """FSDP2 in place: `fully_shard` on every decoder layer, then on the root (embeddings, final norm, head).
    Gradients are summed across ranks, not averaged: each rank's loss is already its share of the step's."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

    device = next(model.parameters()).device
    mesh = init_device_mesh(device.type, (ranks.world_size,))
    precision = (
        MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 else MixedPrecisionPolicy()
    )
    layer_classes = set(getattr(_base(model), "_no_split_modules", None) or [])
    layers = [m for m in model.modules() if type(m).__name__ in layer_classes]
    if not layers:
        raise NotImplementedError(
            f"{type(_base(model)).__name__} names no decoder layer class (_no_split_modules), so "
            "tandem cannot shard it layer by layer with FSDP2"
        )
    for layer in layers:
        fully_shard(layer, mesh=mesh, mp_policy=precision, reshard_after_forward=reshard_after_forward(fsdp_config))
    # the root keeps its weights (embeddings, head) gathered until the backward
    fully_shard(model, mesh=mesh, mp_policy=precision)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)  # gloo has no pre-multiplied sum


def _base(model: torch.nn.Module) -> torch.nn.Module:
    """The transformers model under a PEFT wrapper."""
    get_base_model = getattr(model, "get_base_model", None)
    return get_base_model() if get_base_model is not None else model


def full_tensor(value: torch.Tensor) -> torch.Tensor:
    """A parameter's whole value: a sharded one (DTensor) is all-gathered, a collective every rank must join."""
    return value.full_tensor() if hasattr(value, "full_tensor") else value
