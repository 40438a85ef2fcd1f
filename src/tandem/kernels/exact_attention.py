"""Exact attention (`tandem_exact`): eager attention whose every query row rounds as it would inside a long forward.

CPU matmuls with fewer than ~16 rows take a differently rounded code path. A decode step has one
query per sequence, so plain eager attention there differs from a full forward over the same tokens
in the last bits, and those bits grow through the layers. Padding short query blocks (by repeating the
last one) keeps each real row on the long-forward path, and a softmax whose denominator is summed by a
matmul (ExactSoftmax) and a values' matmul of 8 columns at a time (WeightedValues) round the same wherever a
key sits, so cached decoding gives log-probs bitwise
equal to a teacher-forced forward and to a tree-packed row. Where MKL runs in its strict reproducible
mode (ROWS_ROUND_ALIKE) every matmul needs only a few rows (MATMUL_ROWS, probed at import: 2 on one
x86 machine, 4 on another); elsewhere the engine pads them all to 16.

Shared by the server's exact decoding (serve/engine.py) and the trainer's packed forward
(packing/), which must round alike for the two sides' log-probs to agree bit for bit.
"""

import ctypes
import os
from collections.abc import Callable

import torch
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, eager_mask
from transformers.models.qwen2.modeling_qwen2 import repeat_kv

from tandem.kernels.openmp import in_passing_thread
from tandem.model.architecture import transformers_model

MIN_ROWS = 16
NAME = "tandem_exact"
MKL_CBWR_STRICT = 0x10000


def _rows_round_alike() -> bool:
    """Whether MKL runs in its strict reproducible mode (MKL_CBWR=AUTO,STRICT, which `import tandem` sets), where each
    row of a matmul rounds the same from a few rows on (MATMUL_ROWS). Without it MKL takes another kernel under 16 rows and
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


def _fewest_rows_rounding_alike() -> int:
    """The fewest rows from which each row of a matmul, plain or batched, rounds as in a 64-row one, up to MIN_ROWS.
    Which kernel MKL's strict mode takes for few rows differs by CPU (1 row apart on one machine, 1-3 on another), so it
    is measured: ~100 small matmuls, ~10 ms."""
    generator = torch.Generator().manual_seed(0)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator, dtype=torch.float32, device="cpu")

    def linear(x: torch.Tensor, w: torch.Tensor) -> Callable[[int], torch.Tensor]:
        return lambda rows: torch.nn.functional.linear(x[:rows], w)

    # functions of the row count: the matmuls exact attention and the linear layers run, the linear layers' inner sums
    # as long as a head dim, a hidden size and a wide down projection
    cases = [linear(randn(64, width), randn(32, width)) for width in (64, 768, 2048)]
    queries, keys = randn(2, 2, 64, 64), randn(2, 2, 24, 64)
    weights, values = randn(2, 2, 64, 250).abs(), randn(2, 2, 250, 8)
    cases += [
        lambda rows: torch.matmul(queries[:, :, :rows], keys.transpose(2, 3)),
        lambda rows: torch.matmul(weights[:, :, :rows], weights.new_ones(250, 2)),  # ExactSoftmax's denominator
        lambda rows: torch.matmul(weights[:, :, :rows], values),  # WeightedValues' 8 columns
    ]
    longs = [case(64) for case in cases]
    return fewest_rows(
        lambda rows: all(torch.equal(case(rows), long[..., :rows, :]) for case, long in zip(cases, longs))
    )


def fewest_rows(alike: Callable[[int], bool]) -> int:
    """The fewest rows from which `alike(rows)` holds, searching down from MIN_ROWS rows."""
    fewest = MIN_ROWS
    while fewest > 1 and alike(fewest - 1):
        fewest -= 1
    return fewest


MATMUL_ROWS = in_passing_thread(_fewest_rows_rounding_alike) if ROWS_ROUND_ALIKE else MIN_ROWS
"""Rows each matmul of exact decoding needs, padded with filler rows where it has fewer: without the strict mode,
16 (and layers 1024 or more wide may still drift); padding a 3:1 model's 3 stacked query rows to 16 was ~20% of an
exact decode step."""


def _fewest_keys_summing_alike(rows: int) -> int:
    """The fewest keys, a multiple of MIN_ROWS up to 8 of them, from which exact attention's sums over the keys
    (ExactSoftmax's denominator, WeightedValues) round as over a longer row of keys whose extra weights are 0, for
    every query block from `rows` to MIN_ROWS rows. One Sapphire Rapids machine summed 2 rows over 16-24 keys in
    another order (a decode step drifted 4e-6 from the trainer's forward); ~4,000 small matmuls a candidate, 30 ms there."""
    generator = torch.Generator().manual_seed(0)
    longest = 8 * MIN_ROWS + 64
    weights = torch.rand(2, 2, 64, longest, generator=generator)
    weights[..., 13:] = 0  # 13 keys seen, as a query early in its sequence; the rest masked
    values, ones = torch.randn(2, 2, longest, 8, generator=generator), weights.new_ones(longest, 2)
    sums, weighted = torch.matmul(weights, ones), torch.matmul(weights, values)

    def alike(keys: int) -> bool:
        return all(
            torch.equal(torch.matmul(weights[:, :, :r, :k], ones[:k]), sums[:, :, :r])
            and torch.equal(torch.matmul(weights[:, :, :r, :k], values[:, :, :k]), weighted[:, :, :r])
            for r in range(rows, MIN_ROWS + 1)
            for k in range(keys, keys + 64)
        )

    return next((keys for keys in range(MIN_ROWS, 8 * MIN_ROWS + 1, MIN_ROWS) if alike(keys)), 8 * MIN_ROWS)


MATMUL_KEYS = in_passing_thread(_fewest_keys_summing_alike, MATMUL_ROWS) if ROWS_ROUND_ALIKE else MIN_ROWS
"""Keys every attention of exact decoding reads at least, the extra ones masked: 16 where MKL's strict mode is off or
sums alike from 16 keys on, 32 on the machine where few query rows summed over 16-24 keys in another order."""


def exact_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """Eager attention's math (transformers' `eager_attention_forward`), with the query heads that share a key-value head
    stacked into one matmul, padded to MATMUL_ROWS rows: no copies of the keys and values per query head, and a third of
    the matmuls on a 3:1 model (their per-(sequence, head) overhead was ~half of a 256-row exact decode step)."""
    batch, heads, q_len, dim = query.shape
    kv_heads = key.shape[1]
    if attention_mask is not None and attention_mask.shape[1] != 1:  # a mask per head: stack nothing
        kv_heads, key, value = heads, repeat_kv(key, heads // kv_heads), repeat_kv(value, heads // kv_heads)
    rows = heads // kv_heads * q_len
    stacked = query.reshape(batch, kv_heads, rows, dim)  # row g * q_len + t: query head g of the group, token t
    if rows < MATMUL_ROWS:
        stacked = torch.cat([stacked, stacked[:, :, -1:].expand(-1, -1, MATMUL_ROWS - rows, -1)], dim=2)
    scores = torch.matmul(stacked, key.transpose(2, 3)) * scaling
    if attention_mask is not None:
        mask = attention_mask[:, :, :, : key.shape[-2]]
        if mask.shape[1] == 1:  # one mask for every head: each stacked query head's rows get it
            mask = mask.repeat(1, 1, rows // q_len, 1)
        if rows < MATMUL_ROWS:
            mask = torch.cat([mask, mask[:, :, -1:].expand(-1, -1, MATMUL_ROWS - rows, -1)], dim=2)
        scores = scores + mask
    weights = ExactSoftmax.apply(scores.float()).to(query.dtype)
    weights = torch.nn.functional.dropout(weights, p=dropout, training=module.training)
    output = WeightedValues.apply(weights, value)[:, :, :rows].reshape(batch, heads, q_len, value.shape[-1])
    return output.transpose(1, 2).contiguous(), None  # the weights are stacked and padded: none returned, as SDPA


class WeightedValues(torch.autograd.Function):
    """`weights @ value`, 8 columns of the values a matmul: MKL sums over the keys in one order for up to 8 columns
    whatever the keys' number and places, while from 16 columns on it splits 200 or more keys into blocks, and a key's
    place in a tree row changed the rounding. In a decode step ~30% faster than one matmul (4 query rows), in a
    600-token forward 2x slower (~2% of a 76M forward). The backward is the plain matmuls'."""

    @staticmethod
    def forward(ctx, weights: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(weights, value)
        device = weights.device.type  # under autocast the matmuls ran in its dtype: the backward's run in it too
        ctx.dtype = (
            torch.get_autocast_dtype(device)
            if torch.is_autocast_enabled(device)
            else torch.promote_types(weights.dtype, value.dtype)
        )
        dim = value.shape[-1]
        if dim % 8:  # zero columns up to a multiple of 8: a narrower last matmul could take another kernel (1: a gemv)
            value = torch.nn.functional.pad(value, (0, 8 - dim % 8))
        return torch.cat([torch.matmul(weights, value[..., start : start + 8]) for start in range(0, dim, 8)], dim=-1)[
            ..., :dim
        ]

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        weights, value = ctx.saved_tensors
        grad, w, v = (t.to(ctx.dtype) for t in (grad, weights, value))  # as the forward computed (bf16 under autocast)
        return torch.matmul(grad, v.transpose(-1, -2)).to(weights.dtype), torch.matmul(w.transpose(-1, -2), grad).to(
            value.dtype
        )


class ExactSoftmax(torch.autograd.Function):
    """Softmax over the last dimension whose weights do not depend on where the keys sit in the row: the denominator
    is a matmul with columns of ones, summed in MKL's order over the keys like the values' matmul after it. torch's
    softmax sums in SIMD lanes by position, so a tree row's later branches, further along the row than in the
    sampler's own sequence, rounded ~1e-6 apart. The backward is softmax's own."""

    @staticmethod
    def forward(ctx, scores: torch.Tensor) -> torch.Tensor:
        shifted = scores - scores.amax(-1, keepdim=True)
        # Keys scored 87 below the row's best weigh 0 (exp: under 1.7e-38). Masked keys took exp's underflow path, 3.5x
        # the time of torch's whole softmax. Literals: a compiled forward cannot read a module global in here.
        low = shifted < -87.0
        exps = shifted.clamp_(min=-87.0).exp_().masked_fill_(low, 0.0)
        # Two columns of ones, not one: MKL's one-column kernel (a gemv) rounds by the row count and the keys' places.
        weights = exps.div_(torch.matmul(exps, exps.new_ones(exps.shape[-1], 2))[..., :1])
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
    if transformers_model(model).config._attn_implementation not in ADDITIVE_MASK_IMPLEMENTATIONS:
        return mask
    return additive_mask(mask, next(model.parameters()).dtype)


def additive_mask(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A boolean mask (True = attend) as the additive form eager attention adds to its scores: 0 or dtype's minimum."""
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(~mask, torch.finfo(dtype).min)
