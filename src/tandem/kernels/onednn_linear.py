"""Large linear layers on an x86 CPU through oneDNN's matmul, in the server and in the trainer alike.

`nn.Linear` calls MKL's sgemm, which reorders the weight on every call; with the few rows of a decode step that reorder
is most of the work (an 8 x 2048 @ 2048 x 768 matmul: 0.47-0.53 ms with MKL, 0.14-0.16 ms reordered once, on an AMD
EPYC). vLLM's CPU build computes with weights reordered so too. The server keeps a reordered copy (the linear weights'
memory again), made at a layer's first forward after each weight update (`forget`), so layers that never run (a vision
tower) get none. The trainer passes the weight as it is, which oneDNN reorders inside the call (a 2048-row forward matmul:
1.1-1.7x faster than MKL's even so; its backward stays on MKL) and which rounds the same as the reordered copy.

Exact decoding depends on one more fact: oneDNN's float32 matmul rounds each row the same whatever the row count from
EXACT_ROWS on (2 here: 1 row takes a gemv) and whatever the thread count (1 and 2 here, up to 3000 rows). So where that
holds (each process probes its own thread count at import) the trainer's forward and exact decoding both run their
large layers on it, and their log-probs stay equal bit for bit.
"""

import platform
from collections.abc import Callable

import torch

from tandem.kernels.exact_attention import MIN_ROWS, fewest_rows
from tandem.kernels.openmp import in_passing_thread

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


def _matmul(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """`x @ weight.T + bias` on oneDNN; `weight` plain or reordered, the same rounding either way. Shaped back as
    F.linear does (`_unsafe_view`): oneDNN's own result for a 3-D input is a view, which autograd forbids modifying in
    place when a custom Function returns it."""
    rows = torch.ops.mkldnn._linear_pointwise(x.reshape(-1, x.shape[-1]), weight, bias, "none", [], "")
    return torch.ops.aten._unsafe_view(rows, (*x.shape[:-1], rows.shape[-1]))


def _fewest_rows_rounding_alike() -> int | None:
    """The fewest rows from which each row of a float32 matmul, plain weight or reordered, at this process's thread
    count, rounds as in a 300-row one (past oneDNN's blocks of rows) on one thread with the plain weight; None if not
    even at MIN_ROWS. Each process probes its own thread count against the same one-thread reference, so the trainer
    and the server agree wherever both find a number. ~40 small matmuls, a few ms."""
    if not usable(torch.float32):
        return None
    generator = torch.Generator().manual_seed(0)
    cases, references = [], []
    threads = torch.get_num_threads()
    for width in (768, 2048):  # a hidden size, a wide down projection
        x, weight = torch.randn(300, width, generator=generator), torch.randn(64, width, generator=generator)
        torch.set_num_threads(1)
        references.append(_matmul(x, weight, None))
        torch.set_num_threads(threads)
        cases += [
            (x, weight, references[-1]),
            (x, torch.ops.mkldnn._reorder_linear_weight(weight, REORDERED_FOR_ROWS), references[-1]),
        ]

    def alike(rows: int) -> bool:
        return all(torch.equal(_matmul(x[:rows], weight, None), reference[:rows]) for x, weight, reference in cases)

    if not (alike(len(references[0])) and alike(MIN_ROWS)):
        return None
    return fewest_rows(alike)


EXACT_ROWS = in_passing_thread(_fewest_rows_rounding_alike)
"""Rows each matmul of exact decoding needs on oneDNN, or None where its rows do not round alike (exact stays on MKL)."""


def _routable(module: torch.nn.Module, exact: bool) -> bool:
    """Exactly an `nn.Linear` (not a subclass that computes otherwise) with MIN_ELEMENTS weights or more, in a dtype
    oneDNN takes here; for exact decoding and the trainer, float32 only and only where its rows round alike."""
    if type(module) is not torch.nn.Linear or module.weight.numel() < MIN_ELEMENTS or not usable(module.weight.dtype):
        return False
    return not exact or (module.weight.dtype == torch.float32 and EXACT_ROWS is not None)


def install(model: torch.nn.Module, *, exact: bool, reorder: bool) -> int:
    """Route every routable `nn.Linear` of `model` through oneDNN; returns how many. `reorder`: keep a reordered copy of
    the weight (the server, until `forget`); else pass the weight each call, with a gradient (the trainer)."""
    forward = _forward_on_reordered if reorder else _forward_with_gradient
    count = 0
    for module in model.modules():
        if _routable(module, exact):
            _reorder_at_next_forward(module)
            module.forward = forward.__get__(module)
            count += 1
    return count


def routed(module: torch.nn.Module) -> bool:
    """Whether `install` routed this layer: what a caller computing with its weight directly must match."""
    return hasattr(module, "onednn_weight")


def forget(model: torch.nn.Module) -> None:
    """The weights changed in place: each routed layer reorders its weight again at its next forward."""
    for module in model.modules():
        if routed(module):
            _reorder_at_next_forward(module)


def _reorder_at_next_forward(layer: torch.nn.Module) -> None:
    """Drop the layer's reordered weight (`routed` stays true): its next forward reorders the weight again."""
    layer.onednn_weight = None  # type: ignore[assignment]  # torch types a module's attributes as tensors or modules


def projection(layer: torch.nn.Linear) -> Callable:
    """What a trainer's `layer(x)` computes, as a function of (x, weight, bias): oneDNN's matmul with a gradient where
    `install` routed it, else F.linear. F.linear also under autocast, whose cast oneDNN's call would skip; under
    torch.compile, which lowers oneDNN's call for frozen weights only (a compiled decoder rounds apart from exact
    decoding anyway: model.py warns); and once the layer left the CPU or float32."""
    weight = layer.weight
    if (
        not routed(layer)
        or weight.device.type != "cpu"
        or weight.dtype != torch.float32
        or torch.is_autocast_enabled("cpu")
        or torch.compiler.is_compiling()
    ):
        return torch.nn.functional.linear
    return _Linear.apply


def _forward_on_reordered(self: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    weight = self.onednn_weight
    if not isinstance(weight, torch.Tensor):  # None: the first forward since `install` or `forget`
        weight = self.onednn_weight = torch.ops.mkldnn._reorder_linear_weight(self.weight.detach(), REORDERED_FOR_ROWS)
    return _matmul(x, weight, self.bias)


def _forward_with_gradient(self: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    return projection(self)(x, self.weight, self.bias)


class _Linear(torch.autograd.Function):
    """oneDNN's forward; the backward is F.linear's, as plain matmuls (its rounding is no one else's to match)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        return _matmul(x, weight, bias)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, weight = ctx.saved_tensors
        wants_x, wants_weight, wants_bias = ctx.needs_input_grad
        rows = grad.reshape(-1, grad.shape[-1])
        grad_x = grad.matmul(weight) if wants_x else None
        grad_weight = rows.T.mm(x.reshape(-1, x.shape[-1])) if wants_weight else None
        grad_bias = rows.sum(0) if wants_bias else None
        return grad_x, grad_weight, grad_bias
