"""Model FLOPs utilisation (`perf/fwd_bwd_mfu`, `perf/wall_clock_mfu`): the FLOPs a step's packed rows need, over
what the step's GPUs could have done in the time. Logged only on GPUs of known peak; never on CPU.

A decoder-only model's forward and backward over a row costs, in multiply-adds counted twice (the usual 6ND rule,
made exact for tree packing):

    6 · N · T           the weight matmuls: N parameters outside the embedding and the head, T forwarded tokens
    6 · H · V · P       the head, applied only at the P positions that predict trained tokens (packing/log_probs.py)
    12 · L · H · K      attention scores and values: L layers, K the keys every query sees (a row's `load`)

Recomputation (gradient checkpointing) is not counted: MFU measures useful work.
"""

from dataclasses import dataclass

import torch
from peft import PeftModel
from transformers import PreTrainedModel

from tandem.metrics.window import MetricWindow
from tandem.trainer.step_metrics import StepTimes

PEAK_TFLOPS = {  # dense tensor-core peak per GPU, (bf16, fp32 / tf32), from the vendors' data sheets
    "B200": (2250.0, 1100.0),
    "H200": (989.0, 495.0),
    "H100 SXM": (989.0, 495.0),
    "H100 NVL": (835.0, 418.0),
    "H100 PCIe": (756.0, 378.0),
    "H100": (989.0, 495.0),
    "GH200": (989.0, 495.0),
    "A100": (312.0, 156.0),
    "L40S": (362.0, 183.0),
    "L4": (121.0, 60.0),
    "A10G": (70.0, 35.0),
    "A10": (125.0, 62.5),
}
"""Matched against torch.cuda.get_device_name() in this order (the first name it contains wins)."""


def peak_flops(device: torch.device, bf16: bool) -> float | None:
    """FLOP/s one `device` can do at most, or None (CPU, or a GPU not in the table)."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for known, (half, single) in PEAK_TFLOPS.items():
        if known in name:
            return (half if bf16 else single) * 1e12
    return None


def model_shape(model: PreTrainedModel | PeftModel) -> tuple[int, int, int, int]:
    """(the decoder's parameters outside the embedding, hidden size, vocabulary, layers): a vision tower, which text rows
    never run, is left out."""
    config = model.config.get_text_config()
    embedding = model.get_input_embeddings().weight
    assert isinstance(embedding, torch.Tensor), "an input embedding holds its table as `weight`"
    outside = sum(p.numel() for p in model.get_decoder().parameters()) - embedding.numel()
    return outside, config.hidden_size, config.vocab_size, config.num_hidden_layers


def rows_flops(rows, shape: tuple[int, int, int, int]) -> float:
    """The FLOPs of forwarding and backwarding `rows` once (the module docstring's formula)."""
    params, hidden, vocab, layers = shape
    tokens = sum(row.num_tokens for row in rows)
    predicting = sum(row.predict_index.unique().numel() for row in rows)
    keys = sum(row.load for row in rows)
    return 6.0 * params * tokens + 6.0 * hidden * vocab * predicting + 12.0 * layers * hidden * keys


@dataclass
class StepFlops:
    """A run's `perf/*_mfu` metrics: each step's FLOPs over what all its GPUs (`peak` FLOP/s together) could have done
    in the step's time."""

    peak: float
    shape: tuple[int, int, int, int]

    @classmethod
    def of(cls, model: PreTrainedModel | PeftModel, device: torch.device, bf16: bool, gpus: int) -> "StepFlops | None":
        """The run's meter; None where MFU is not logged (CPU, or a GPU of unknown peak)."""
        peak = peak_flops(device, bf16)
        return None if peak is None else cls(peak * gpus, model_shape(model))

    def record(self, window: MetricWindow, rows, times: StepTimes) -> None:
        flops = rows_flops(rows, self.shape)
        window.add("perf/fwd_bwd_mfu", flops / (times.forward_backward * self.peak))
        window.add("perf/wall_clock_mfu", flops / (times.total * self.peak))
