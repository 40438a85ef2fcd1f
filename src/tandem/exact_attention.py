"""Exact attention (`tandem_exact`): eager attention whose every query row rounds as it would inside a long forward.

CPU matmuls with fewer than ~16 rows take a differently rounded code path. A decode step has one
query per sequence, so plain eager attention there differs from a full forward over the same tokens
in the last bits, and those bits grow through the layers. Padding short query blocks (by repeating the
last one) keeps each real row on the long-forward path, and a softmax whose denominator is summed by a
matmul (ExactSoftmax) rounds the same wherever a key sits, so cached decoding gives log-probs bitwise
equal to a teacher-forced forward and to a tree-packed row. Where MKL runs in its strict reproducible
mode (ROWS_ROUND_ALIKE) the model's linear layers need no padding and attention needs two rows
(QUERY_ROWS); elsewhere the engine pads them all to 16.

Shared by the server's exact decoding (generation/engine.py) and the trainer's packed forward
(packing/), which must round alike for the two sides' log-probs to agree bit for bit.
"""

import ctypes
import os

import torch
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, eager_mask
from transformers.models.qwen2.modeling_qwen2 import repeat_kv

MIN_ROWS = 16
NAME = "tandem_exact"
MKL_CBWR_STRICT = 0x10000


def _rows_round_alike() -> bool:
    """Whether MKL runs in its strict reproducible mode (MKL_CBWR=AUTO,STRICT, which `import tandem` sets), where each
    row of a matmul rounds the same whatever the number of rows. Without it MKL takes another kernel under 16 rows and
    splits a wide inner sum over threads when rows are few (1024+ wide at 2 threads: a 76M model's down projection
    drifted ~1e-6 from the trainer's forward even at 16 rows). False on a torch without MKL."""
    if not torch.backends.mkl.is_available():
        return False
    try:
        library = ctypes.CDLL(os.path.join(os.path.dirname(torch.__file__), "lib", "libtorch_cpu.so"))
        return bool(library.mkl_serv_cbwr_get(ctypes.c_int(-1)) & MKL_CBWR_STRICT)
    except (OSError, AttributeError):  # another library layout: pad, as without the mode
        return False


ROWS_ROUND_ALIKE = _rows_round_alike()
"""Read once: MKL's mode is fixed at its first call in the process."""

QUERY_ROWS = 2 if ROWS_ROUND_ALIKE else MIN_ROWS
"""Stacked query rows an attention matmul needs: under the strict mode a batched matmul of one row still takes
another path, of two or more rounds as in a long forward (checked at 2-480 rows, 16-256 keys, head dims 32-128);
padding a 3:1 model's 3 rows to 16 was ~20% of an exact decode step."""


def exact_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """Eager attention's math (transformers' `eager_attention_forward`), with the query heads that share a key-value head
    stacked into one matmul, padded to QUERY_ROWS rows: no copies of the keys and values per query head, and a third of
    the matmuls on a 3:1 model (their per-(sequence, head) overhead was ~half of a 256-row exact decode step)."""
    batch, heads, q_len, dim = query.shape
    kv_heads = key.shape[1]
    if attention_mask is not None and attention_mask.shape[1] != 1:  # a mask per head: stack nothing
        kv_heads, key, value = heads, repeat_kv(key, heads // kv_heads), repeat_kv(value, heads // kv_heads)
    rows = heads // kv_heads * q_len
    stacked = query.reshape(batch, kv_heads, rows, dim)  # row g * q_len + t: query head g of the group, token t
    if rows < QUERY_ROWS:
        stacked = torch.cat([stacked, stacked[:, :, -1:].expand(-1, -1, QUERY_ROWS - rows, -1)], dim=2)
    scores = torch.matmul(stacked, key.transpose(2, 3)) * scaling
    if attention_mask is not None:
        mask = attention_mask[:, :, :, : key.shape[-2]]
        if mask.shape[1] == 1:  # one mask for every head: each stacked query head's rows get it
            mask = mask.repeat(1, 1, rows // q_len, 1)
        if rows < QUERY_ROWS:
            mask = torch.cat([mask, mask[:, :, -1:].expand(-1, -1, QUERY_ROWS - rows, -1)], dim=2)
        scores = scores + mask
    weights = ExactSoftmax.apply(scores.float()).to(query.dtype)
    weights = torch.nn.functional.dropout(weights, p=dropout, training=module.training)
    output = torch.matmul(weights, value)[:, :, :rows].reshape(batch, heads, q_len, dim)
    return output.transpose(1, 2).contiguous(), None  # the weights are stacked and padded: none returned, as SDPA


class ExactSoftmax(torch.autograd.Function):
    """Softmax over the last dimension whose weights do not depend on where the keys sit in the row: the denominator
    is a matmul with a column of ones, summed in MKL's order over the keys like the values' matmul after it. torch's
    softmax sums in SIMD lanes by position, so a tree row's later branches, further along the row than in the
    sampler's own sequence, rounded ~1e-6 apart. The backward is softmax's own."""

    @staticmethod
    def forward(ctx, scores: torch.Tensor) -> torch.Tensor:
        shifted = scores - scores.amax(-1, keepdim=True)
        # Keys scored 87 below the row's best weigh 0 (exp: under 1.7e-38). Masked keys took exp's underflow path, 3.5x
        # the time of torch's whole softmax. Literals: a compiled forward cannot read a module global in here.
        low = shifted < -87.0
        exps = shifted.clamp_(min=-87.0).exp_().masked_fill_(low, 0.0)
        weights = exps.div_(torch.matmul(exps, exps.new_ones(exps.shape[-1], 1)))
        ctx.save_for_backward(weights)
        return weights

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        (weights,) = ctx.saved_tensors
        return torch._softmax_backward_data(grad, weights, -1, weights.dtype)


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
