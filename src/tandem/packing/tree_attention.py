"""Tree attention: one attention call over a packed trie row, for any model that uses transformers'
attention interface.

The mask rule is `k <= q <= end[k]` (plus `pos[q] - pos[k] < window` on sliding-window layers). The
backend `tandem_tree` takes the mask in one of three forms and picks the kernel from it:
  * an additive float mask -> `tandem_exact`'s eager math (exact_attention.py), bitwise equal to what
    `tandem serve --decode-mode exact` samples with (the CPU default, and the fallback anywhere);
  * a boolean mask -> PyTorch SDPA (CPU and GPU);
  * a FlexAttention BlockMask -> flex_attention, compiled on GPU (the GPU default; no backward on CPU).

`prepare` decides a model's row layout once: a model a tree row would change (layers that scan across tokens,
attention sinks, soft-capped scores) keeps its own attention and trains on padded rows (trie.py).
"""

import torch
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from tandem.kernels.exact_attention import additive_mask, exact_attention
from tandem.model import architecture
from tandem.packing import linear_attention
from tandem.packing.trie import PADDED, TREE

NAME = "tandem_tree"
LINEAR = "linear_attention"
"""The layer type of Gated DeltaNet layers: their "mask" is the row's TreeScan."""
KERNELS = ("exact", "sdpa", "flex")


def default_kernel(device: torch.device) -> str:
    return "flex" if device.type == "cuda" else "exact"


def padded_reasons(model: torch.nn.Module) -> list[str]:
    """Why a tree row would change `model`'s outputs (none: tree packing reproduces its own forward; Gated DeltaNet
    layers continue their parent's state on tree rows, linear_attention.py)."""
    layers = architecture.scanning_layers(model)
    scanning = (
        []
        if linear_attention.tree_packs(model, layers)
        else [f"{name} reads across tokens outside attention" for name in layers]
    )
    return scanning + [
        f"{extra}, which the tree kernels do not compute" for extra in architecture.attention_extras(model)
    ]


def prepare(model: torch.nn.Module) -> str:
    """The model's row layout, decided once: TREE, its attention switched to `tandem_tree` (and its Gated DeltaNet
    layers to their tree path), when tree packing reproduces its own forward; else PADDED (one sequence per sample,
    through the model's own attention)."""
    if padded_reasons(model):
        return PADDED
    architecture.transformers_model(model).set_attn_implementation(NAME)
    linear_attention.install(model)
    return TREE


def tree_masks(end: torch.Tensor, position_ids: torch.Tensor, model: torch.nn.Module, kernel: str):
    """The tree mask in the form `kernel` takes and the model's forward reads (architecture.layer_masks): a
    linear-attention layer's "mask" is the row's TreeScan."""
    if kernel not in KERNELS:
        raise ValueError(f"tree attention kernel {kernel!r} is not one of {KERNELS}")
    dtype = next(model.parameters()).dtype
    return architecture.layer_masks(
        model.config,
        lambda layer_type, window: (
            linear_attention.tree_scan(position_ids.tolist())
            if layer_type == LINEAR
            else _mask(end, position_ids, window, kernel, dtype)
        ),
    )


def _mask(end, position_ids, window, kernel, dtype):
    if kernel == "flex":

        def mask_mod(batch, head, q, k):
            visible = (k <= q) & (q <= end[k])
            return visible & (position_ids[q] - position_ids[k] < window) if window else visible

        size = end.numel()
        return create_block_mask(mask_mod, None, None, size, size, device=end.device)
    index = torch.arange(end.numel(), device=end.device)
    q, k = index[:, None], index[None, :]
    visible = (k <= q) & (q <= end[None, :])
    if window:
        visible &= position_ids[:, None] - position_ids[None, :] < window
    visible = visible[None, None]
    return visible if kernel == "sdpa" else additive_mask(visible, dtype)


_compiled_flex = None


def _flex(query, key, value, block_mask, scale):
    global _compiled_flex
    if query.device.type != "cuda":  # eager flex: forward only, used to check the block masks on CPU
        return flex_attention(query, key, value, block_mask=block_mask, scale=scale, enable_gqa=True)
    if _compiled_flex is None:
        _compiled_flex = torch.compile(flex_attention, dynamic=True)
    return _compiled_flex(query, key, value, block_mask=block_mask, scale=scale, enable_gqa=True)


def tree_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """The `tandem_tree` attention function: the mask's form picks the kernel (module docstring)."""
    if isinstance(attention_mask, BlockMask):
        if dropout:
            raise NotImplementedError("attention dropout is not supported by the flex tree kernel; use kernel 'sdpa'")
        return _flex(query, key, value, attention_mask, scaling).transpose(1, 2).contiguous(), None
    if attention_mask is None or attention_mask.dtype == torch.bool:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    return exact_attention(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs)


AttentionInterface.register(NAME, tree_attention)
AttentionMaskInterface.register(NAME, sdpa_mask)  # a plain forward (no tree) gets an ordinary causal boolean mask
