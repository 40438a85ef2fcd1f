"""Tree attention: one attention call over a packed trie row, for any model that uses transformers'
attention interface (DESIGN.md §4).

The mask rule is `k <= q <= end[k]` (plus `pos[q] - pos[k] < window` on sliding-window layers). The
backend `tandem_tree` takes the mask in one of three forms and picks the kernel from it:
  * an additive float mask -> eager math with short query blocks padded to 16 rows, bitwise equal to
    what `tandem serve --decode-mode exact` samples with (the CPU default, and the fallback anywhere);
  * a boolean mask -> PyTorch SDPA (CPU and GPU);
  * a FlexAttention BlockMask -> flex_attention, compiled on GPU (the GPU default; no backward on CPU).
"""

import torch
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from tandem.exact_attention import additive_mask, exact_attention

NAME = "tandem_tree"
KERNELS = ("exact", "sdpa", "flex")
ATTENTION_LAYERS = ("full_attention", "sliding_attention")
SCANNING_MODULES = ("mamba", "rwkv", "shortconv", "deltanet", "recurrent", "xlstm", "linearattention")
"""Module class names that give away layers reading across tokens outside attention."""


def default_kernel(device: torch.device) -> str:
    return "flex" if device.type == "cuda" else "exact"


def check_supported(model: torch.nn.Module) -> None:
    """Refuse models whose outputs a packed row would change: layers that scan across tokens would read
    other samples' tokens, and sinks or score soft-capping are not in the tree kernels."""
    config = model.config.get_text_config()
    for layer_type in getattr(config, "layer_types", None) or []:
        if layer_type not in ATTENTION_LAYERS:
            raise NotImplementedError(f"{config.model_type}: layer type {layer_type!r} is not attention; tree packing "
                                      "would let it scan across the samples of a row. tandem packs only models made of "
                                      f"{' / '.join(ATTENTION_LAYERS)} layers.")
    for name, module in model.named_modules():
        kind = type(module).__name__.lower()
        if any(word in kind for word in SCANNING_MODULES):
            raise NotImplementedError(f"{name} ({type(module).__name__}) scans across tokens; tree packing would let it "
                                      "read the other samples of a row, so tandem cannot train this model.")
    if any(name.endswith("sinks") for name, _ in model.named_parameters()):
        raise NotImplementedError("the model has attention sinks, which the tree attention kernels do not implement")
    if getattr(config, "attn_logit_softcapping", None):
        raise NotImplementedError("the model soft-caps attention scores, which the tree attention kernels do not implement")


def prepare(model: torch.nn.Module) -> None:
    """Check the model can be tree-packed and switch its attention to `tandem_tree`."""
    check_supported(model)
    model.set_attn_implementation(NAME)


def tree_masks(end: torch.Tensor, position_ids: torch.Tensor, model: torch.nn.Module, kernel: str) -> dict:
    """One mask per layer type of the model, in the form `kernel` takes."""
    if kernel not in KERNELS:
        raise ValueError(f"tree attention kernel {kernel!r} is not one of {KERNELS}")
    config = model.config.get_text_config()
    layer_types = set(getattr(config, "layer_types", None) or ["full_attention"])
    windows = {t: getattr(config, "sliding_window", None) if t == "sliding_attention" else None for t in layer_types}
    dtype = next(model.parameters()).dtype
    return {t: _mask(end, position_ids, window, kernel, dtype) for t, window in windows.items()}


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
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
    return exact_attention(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs)


AttentionInterface.register(NAME, tree_attention)
AttentionMaskInterface.register(NAME, sdpa_mask)  # a plain forward (no tree) gets an ordinary causal boolean mask
