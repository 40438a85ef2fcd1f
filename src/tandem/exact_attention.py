"""Exact attention (`tandem_exact`): eager attention whose every query row rounds as it would inside a long forward.

CPU matmuls with fewer than ~16 rows take a differently rounded code path. A decode step has one
query per sequence, so plain eager attention there differs from a full forward over the same tokens
in the last bits, and those bits grow through the layers. Padding short query blocks to 16 rows (by
repeating the last one) keeps each real row on the long-forward path, so cached decoding gives
log-probs bitwise equal to a teacher-forced forward with eager attention.

Shared by the server's exact decoding (generation/engine.py) and the trainer's packed forward
(packing/), which must round alike for the two sides' log-probs to agree bit for bit.
"""

import torch
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, eager_mask
from transformers.models.qwen2.modeling_qwen2 import eager_attention_forward

MIN_ROWS = 16
NAME = "tandem_exact"


def exact_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    q_len = query.shape[2]
    if q_len < MIN_ROWS:
        extra = MIN_ROWS - q_len
        query = torch.cat([query, query[:, :, -1:].expand(-1, -1, extra, -1)], dim=2)
        if attention_mask is not None:
            attention_mask = torch.cat([attention_mask, attention_mask[:, :, -1:].expand(-1, -1, extra, -1)], dim=2)
    output, weights = eager_attention_forward(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs)
    return output[:, :q_len], weights


AttentionInterface.register(NAME, exact_attention)
AttentionMaskInterface.register(NAME, eager_mask)  # plain forwards build the additive mask eager attention takes

ADDITIVE_MASK_IMPLEMENTATIONS = ("eager", NAME)


def model_mask(mask: torch.Tensor, model: torch.nn.Module) -> torch.Tensor:
    """A boolean [B, 1, Q, K] mask (True = attend) in the form the model's attention implementation takes:
    eager-style implementations add the mask to the scores, SDPA takes it as booleans."""
    if model.config._attn_implementation not in ADDITIVE_MASK_IMPLEMENTATIONS:
        return mask
    return additive_mask(mask, next(model.parameters()).dtype)


def additive_mask(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A boolean mask (True = attend) as the additive form eager attention adds to its scores: 0 or dtype's minimum."""
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(~mask, torch.finfo(dtype).min)
