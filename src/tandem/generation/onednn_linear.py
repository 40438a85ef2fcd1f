"""Fast decoding's linear layers on an x86 CPU: oneDNN's matmul on weights reordered once into its blocked layout.

`nn.Linear` calls MKL's sgemm, which reorders the weight on every call; with the few rows of a decode step that reorder
is most of the work (an 8 x 2048 @ 2048 x 768 matmul: 0.47-0.53 ms with MKL, 0.14-0.16 ms reordered once, on an AMD
EPYC). vLLM's CPU build computes with weights reordered so too. The copy costs the linear weights' memory again and is
made at a layer's first forward after each weight update (`forget`), so layers that never run (a vision tower) get
none. It rounds apart from MKL (~3e-6 against ~1e-6 of float64), so exact decoding keeps MKL. Serving only: the
forward carries no gradient to the weight.
"""

import platform

import torch

REORDERED_FOR_ROWS = 64
"""The row count oneDNN tunes the layout for; any count runs on it (1 to 200 rows measured: as fast or faster)."""
MIN_ELEMENTS = 1 << 17
"""Smaller weights stay on MKL: oneDNN's ~15 us a call outweighs the reorder it saves (192 x 512 at 1 row: 22 us against
MKL's 9). From 256 x 768 on it is about even at 1 row (by run) and faster at 8 rows (1.1-1.7x there, 2.6-3.8x at
768 x 2048)."""


def usable(dtype: torch.dtype) -> bool:
    """oneDNN in this torch, an x86 CPU (the only kind measured), and for bfloat16 the AVX-512 (or AVX-NE-CONVERT)
    its bfloat16 path needs."""
    if not torch.backends.mkldnn.is_available() or platform.machine().lower() not in ("x86_64", "amd64"):
        return False
    return dtype == torch.float32 or (dtype == torch.bfloat16 and torch.ops.mkldnn._is_mkldnn_bf16_supported())


def install(model: torch.nn.Module) -> int:
    """Route every large `nn.Linear` of `model` whose dtype oneDNN takes through it; returns how many."""
    count = 0
    for module in model.modules():
        # exactly nn.Linear: not a subclass that computes otherwise
        if type(module) is torch.nn.Linear and module.weight.numel() >= MIN_ELEMENTS and usable(module.weight.dtype):
            module.onednn_weight = None
            module.forward = _forward_on_reordered.__get__(module)
            count += 1
    return count


def forget(model: torch.nn.Module) -> None:
    """The weights changed in place: each routed layer reorders its weight again at its next forward."""
    for module in model.modules():
        if hasattr(module, "onednn_weight"):
            module.onednn_weight = None


def _forward_on_reordered(self: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    if self.onednn_weight is None:
        self.onednn_weight = torch.ops.mkldnn._reorder_linear_weight(self.weight.detach(), REORDERED_FOR_ROWS)
    return torch.ops.mkldnn._linear_pointwise(x, self.onednn_weight, self.bias, "none", [], "")
