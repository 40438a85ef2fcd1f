"""Stand-in for vLLM's `nccl_common.trainer_init`: the same call, a gloo group instead of NCCL."""

from tandem.serve.weight_receiver import join_group
from vllm.distributed.weight_transfer.packed_tensor import CALLS


def trainer_init(init_info: dict):
    CALLS.append(("trainer_init", {k: v for k, v in init_info.items() if k != "master_port"}))
    return join_group(init_info["master_address"], init_info["master_port"], 0, init_info["world_size"], 20)
