"""Fast decoding's linear layers on a CPU: oneDNN's matmul on weights reordered once into its blocked layout.

`nn.Linear` calls MKL's sgemm, which reorders the weight on every call; with the few rows of a decode step that reorder
is most of the work (an 8 x 2048 @ 2048 x 768 matmul: 0.53 ms with MKL, 0.14 ms packed, on an AMD EPYC). vLLM's CPU build
packs its weights so too. The packed copy costs the linear weights' memory again and must follow every weight update
(`Engine.weights_changed`); it rounds apart from MKL (~3e-6 against ~1e-6 of float64), so exact decoding keeps MKL.
"""

import types

import torch

PACKED_FOR_ROWS = 64
"""The row count oneDNN tunes the layout for; any count runs on it (1 to 200 rows measured: as fast or faster)."""
MIN_PACKED_ELEMENTS = 1 << 17
"""Smaller weights stay on MKL: oneDNN's ~15 us a call outweighs the reorder it saves (192 x 512 at 1 row: 22 us against
MKL's 9; 256 x 768 and up: as fast at 1 row, 1.3-3.8x faster at 8)."""


def can_pack(model: torch.nn.Module) -> bool:
    """A CPU model of float32 or bfloat16 weights, and a torch built with oneDNN."""
    weight = next(model.parameters())
    return (torch.backends.mkldnn.is_available() and weight.device.type == "cpu"
            and weight.dtype in (torch.float32, torch.bfloat16))


def pack(model: torch.nn.Module) -> None:
    """Give every large `nn.Linear` of `model` a packed copy of its current weight, which its forward uses from then on.
    Call again whenever the weights change."""
    for module in model.modules():
        # exactly nn.Linear: not a subclass that computes otherwise
        if type(module) is torch.nn.Linear and module.weight.numel() >= MIN_PACKED_ELEMENTS:
            module.packed_weight = torch.ops.mkldnn._reorder_linear_weight(module.weight.detach(), PACKED_FOR_ROWS)
            module.forward = types.MethodType(_packed_forward, module)


def _packed_forward(self: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, self.bias, "none", [], "")
