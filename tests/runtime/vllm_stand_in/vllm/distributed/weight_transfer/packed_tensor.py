"""Stand-in for vLLM's `packed_tensor`: its constants, producer signature and packing (tensors as bytes, concatenated
until a buffer exceeds its size), over the gloo group (what tandem serve receives, packed). `HANG` makes the producer wait like an NCCL peer that never arrives."""

import threading

import torch

DEFAULT_PACKED_BUFFER_SIZE_BYTES = 1024 * 1024 * 1024
DEFAULT_PACKED_NUM_BUFFERS = 2
CALLS: list = []
HANG = threading.Event()


def packed_nccl_broadcast_producer(
    iterator,
    group,
    src,
    post_iter_func,
    buffer_size_bytes=DEFAULT_PACKED_BUFFER_SIZE_BYTES,
    num_buffers=DEFAULT_PACKED_NUM_BUFFERS,
):
    names, buffer = [], []
    for item in iterator:
        if HANG.is_set():
            threading.Event().wait()
        names.append(item[0])
        buffer.append(post_iter_func(item).cpu().contiguous().view(-1).view(torch.uint8))
        if sum(len(part) for part in buffer) > buffer_size_bytes:
            group.broadcast(torch.cat(buffer), src).wait()
            buffer = []
    if buffer:
        group.broadcast(torch.cat(buffer), src).wait()
    CALLS.append(("producer", {"names": names, "buffer_size_bytes": buffer_size_bytes, "num_buffers": num_buffers}))
