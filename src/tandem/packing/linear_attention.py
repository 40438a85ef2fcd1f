"""Gated DeltaNet layers (Qwen3.5, Qwen3-Next) on tree rows: each branch of the trie continues the convolution
window and the recurrent state of the token it branches from, so a packed row computes what
each sample's own sequence would, to the rounding of the layer's chunked kernel (its 64-token chunks start where a
segment starts, not where the sequence does).

A row is cut into segments: runs of tokens that each follow the one before, ended wherever another branch leaves
from. Segments are forwarded in the row's order (a parent before its children) through the layer's own functions:
`causal_conv1d_fn` over the segment with its path's last kernel-1 inputs in front, and
`torch_chunk_gated_delta_rule` from the state the parent segment ended in. Projections, gates and the output norm
act token by token, over the whole row at once.
"""

import sys
from dataclasses import dataclass

import torch
import torch.nn.functional as F

LAYER_SUFFIX = "GatedDeltaNet"


@dataclass(frozen=True)
class TreeScan:
    """A tree row's segments, handed to the Gated DeltaNet layers in place of an attention mask."""

    segments: list[tuple[int, int, int]]
    """(start, stop, parent): tokens start..stop-1, which continue token `parent` (-1: a root), the last of an
    earlier segment."""
    parents: list[int]
    """Each token's parent in the trie (-1: a root)."""


def tree_scan(position_ids: list[int]) -> TreeScan:
    """The segments of a row packed depth-first, from each token's depth: a token's parent is the last token seen one
    level up. Filler tokens at the end (depth 0, seeing only themselves) are roots of their own."""
    parents: list[int] = []
    path: list[int] = []
    for token, depth in enumerate(position_ids):
        del path[depth:]
        parents.append(path[-1] if path else -1)
        path.append(token)
    branch_points = {parent for token, parent in enumerate(parents) if parent not in (-1, token - 1)}
    segments, start = [], 0
    for token in range(1, len(parents) + 1):
        if token == len(parents) or parents[token] != token - 1 or token - 1 in branch_points:
            segments.append((start, token, parents[start]))
            start = token
    return TreeScan(segments, parents)


def supported(layer: torch.nn.Module) -> bool:
    """A Gated DeltaNet layer whose forward `tree_forward` reproduces (Qwen3.5's or Qwen3-Next's projections)."""
    module = sys.modules[type(layer).__module__]
    return (
        type(layer).__name__.endswith(LAYER_SUFFIX)
        and hasattr(module, "torch_chunk_gated_delta_rule")
        and hasattr(module, "causal_conv1d_fn")
        and (hasattr(layer, "in_proj_qkv") or hasattr(layer, "in_proj_qkvz"))
    )


def tree_packs(model: torch.nn.Module, scanning: list[str]) -> bool:
    """Whether the model's only layers that read across tokens outside attention (`scanning`, as architecture.py names
    them) are Gated DeltaNet layers this module runs on tree rows."""
    layers = [m for m in model.modules() if type(m).__name__.endswith(LAYER_SUFFIX)]
    return (
        bool(layers)
        and all(supported(m) for m in layers)
        and set(scanning) <= {"linear_attention"} | {type(m).__name__ for m in layers}
    )


def install(model: torch.nn.Module) -> None:
    """Each Gated DeltaNet layer takes the tree path when its `attention_mask` is a TreeScan, its own otherwise."""
    for layer in model.modules():
        if type(layer).__name__.endswith(LAYER_SUFFIX):
            layer.forward = _tree_aware(layer, layer.forward)


def _tree_aware(layer, own_forward):
    def forward(hidden_states, cache=None, attention_mask=None, **kwargs):
        if isinstance(attention_mask, TreeScan):
            return tree_forward(layer, hidden_states, attention_mask)
        return own_forward(hidden_states, cache=cache, attention_mask=attention_mask, **kwargs)

    return forward


def tree_forward(layer, hidden_states: torch.Tensor, scan: TreeScan) -> torch.Tensor:
    """The layer's forward over one tree row ([1, T, hidden]), segment by segment (module docstring)."""
    kernels = sys.modules[type(layer).__module__]
    mixed, z, b, a = _projections(layer, hidden_states)
    beta = b.sigmoid()
    g = -layer.A_log.float().exp() * F.softplus(a.float() + layer.dt_bias)  # as the layer computes it
    weight, window = layer.conv1d.weight.squeeze(1), layer.conv_kernel_size - 1
    outputs = []
    states: dict[int, torch.Tensor] = {}  # each segment's final state, by its last token
    for start, stop, parent in scan.segments:
        context = _path(scan.parents, parent, window)
        index = torch.tensor(context + list(range(start, stop)), device=mixed.device)
        conv = kernels.causal_conv1d_fn(
            mixed[:, index].transpose(1, 2), weight, layer.conv1d.bias, activation=layer.activation
        )[:, :, len(context) :].transpose(1, 2)
        query, key, value = torch.split(conv, [layer.key_dim, layer.key_dim, layer.value_dim], dim=-1)
        shape = (1, stop - start, -1)
        out, states[stop - 1] = kernels.torch_chunk_gated_delta_rule(
            query.reshape(*shape, layer.head_k_dim),
            key.reshape(*shape, layer.head_k_dim),
            value.reshape(*shape, layer.head_v_dim),
            g=g[:, start:stop],
            beta=beta[:, start:stop],
            initial_state=states.get(parent),
            output_final_state=True,
            use_qk_l2norm_in_kernel=True,
        )
        outputs.append(out)
    core = torch.cat(outputs, dim=1)
    length = hidden_states.shape[1]
    core = layer.norm(core.reshape(-1, layer.head_v_dim), z.reshape(-1, layer.head_v_dim)).reshape(1, length, -1)
    return layer.out_proj(core)


def _path(parents: list[int], token: int, length: int) -> list[int]:
    """The last `length` tokens of the path ending at `token` (itself included), oldest first."""
    path: list[int] = []
    while token != -1 and len(path) < length:
        path.append(token)
        token = parents[token]
    return path[::-1]


def _projections(layer, hidden_states: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """(qkv before the convolution [1, T, C], z [1, T, heads, d_v], b, a [1, T, heads]), as the layer's own forward
    makes them: Qwen3.5 projects each apart, Qwen3-Next projects qkvz and ba together and reorders them."""
    length = hidden_states.shape[1]
    if hasattr(layer, "in_proj_qkvz"):
        query, key, value, z, b, a = layer.fix_query_key_value_ordering(
            layer.in_proj_qkvz(hidden_states), layer.in_proj_ba(hidden_states)
        )
        mixed = torch.cat([x.reshape(1, length, -1) for x in (query, key, value)], dim=-1)
        return mixed, z, b, a
    z = layer.in_proj_z(hidden_states).reshape(1, length, -1, layer.head_v_dim)
    return layer.in_proj_qkv(hidden_states), z, layer.in_proj_b(hidden_states), layer.in_proj_a(hidden_states)
