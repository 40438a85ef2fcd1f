"""Log-probs and entropy at the trained positions of a packed row, a chunk at a time (DESIGN.md §4).

The model runs without its head; the head is applied only to the hidden states that predict trained
tokens, `chunk_size` of them at a time, and each chunk is recomputed in the backward pass instead of
kept, so peak memory holds one chunk's `chunk_size x vocab` logits, never the row's. Logits are divided
by the sampling temperature (the sampler's processed log-probs are on that scale), and when the
sampler truncated the distribution (top-k / top-p) the log-softmax runs over its kept set only.
"""

import sys
from dataclasses import dataclass

import torch
from torch.utils.checkpoint import checkpoint

from tandem.exact_attention import MIN_ROWS
from tandem.packing.attention import tree_masks
from tandem.packing.trie import PADDED, TREE, PackedRow

CHUNK_SIZE = 1024


@dataclass
class TokenLogprobs:
    log_probs: torch.Tensor  # [N] log π_θ(target), differentiable
    entropy: torch.Tensor   # [N] entropy of the (renormalised) distribution, detached
    extra: torch.Tensor | None = None  # [N, K] log-probs of `extra_ids` (the sampler's top-K), differentiable
    aux_loss: torch.Tensor | None = None  # MoE router load-balancing loss of the row (unscaled), differentiable


def chunked_logprobs(hidden: torch.Tensor, head: torch.nn.Module, targets: torch.Tensor, temperature: float = 1.0,
                     sampling_mask: torch.Tensor | None = None, softcap: float | None = None,
                     chunk_size: int = CHUNK_SIZE, extra_ids: torch.Tensor | None = None) -> TokenLogprobs:
    """log softmax(head(hidden) / temperature)[target] for each of the N rows of `hidden` ([N, H]), and at
    `extra_ids` ([N, K]) when given."""
    logprobs, entropy, extra = [], [], []
    recompute = torch.is_grad_enabled()
    for start in range(0, hidden.shape[0], chunk_size):
        part = slice(start, start + chunk_size)
        kept = sampling_mask[part] if sampling_mask is not None else None
        more = extra_ids[part] if extra_ids is not None else None
        args = (head, hidden[part], targets[part], temperature, kept, softcap, more)
        lp, ent, ex = checkpoint(_chunk, *args, use_reentrant=False) if recompute else _chunk(*args)
        logprobs.append(lp)
        entropy.append(ent)
        extra.append(ex)
    if not logprobs:  # no trained token: an empty result still attached to the graph, so backward() works
        empty = hidden.new_zeros(0, dtype=torch.float32)
        width = extra_ids.shape[1] if extra_ids is not None else 0
        return TokenLogprobs(empty + hidden.sum() * 0, empty, hidden.new_zeros(0, width) + hidden.sum() * 0)
    return TokenLogprobs(torch.cat(logprobs), torch.cat(entropy), torch.cat(extra) if extra_ids is not None else None)


def _chunk(head, hidden, targets, temperature, kept, softcap, extra_ids):
    rows = hidden.shape[0]
    if rows < MIN_ROWS:  # as in the sampler: CPU matmuls with fewer rows round differently
        hidden = torch.cat([hidden, hidden[-1:].expand(MIN_ROWS - rows, -1)])
    logits = head(hidden)[:rows]
    logits = logits.float() if logits.dtype != torch.float64 else logits  # half-precision logits are scored in fp32
    if softcap:
        logits = torch.tanh(logits / softcap) * softcap
    logits = logits / temperature
    if kept is not None:
        keep = torch.zeros_like(logits, dtype=torch.bool)
        keep.scatter_(1, torch.where(kept >= 0, kept, kept[:, :1]), True)  # pads repeat the first kept id
        logits = logits.masked_fill(~keep, float("-inf"))
    all_logprobs = logits.log_softmax(-1)
    with torch.no_grad():
        entropy = -(all_logprobs.exp() * all_logprobs.nan_to_num(neginf=0.0)).sum(-1)
    extra = all_logprobs.gather(1, extra_ids) if extra_ids is not None else None
    return all_logprobs.gather(1, targets[:, None])[:, 0], entropy, extra


def row_logprobs(model: torch.nn.Module, row: PackedRow, kernel: str, temperature: float = 1.0,
                 chunk_size: int = CHUNK_SIZE) -> TokenLogprobs:
    """Forward a row through `model` and score its loss terms: a tree row as one sequence under the tree mask
    (attention set to `tandem_tree`), a padded row as a batch of plain causal sequences (the model's own attention)."""
    device = next(model.parameters()).device
    lengths = _sequence_lengths(row)
    width = row.num_tokens // len(lengths)
    wide = max(width, MIN_ROWS)  # CPU matmuls with fewer rows round differently (exact_attention.py)
    inputs = _tree_inputs(row, wide, model, kernel, device) if row.layout == TREE else {}
    input_ids = torch.nn.functional.pad(row.input_ids.view(len(lengths), width), (0, wide - width))
    moe = hasattr(model.config.get_text_config(), "output_router_logits")
    router = {"output_router_logits": False} if moe else {}  # the model's own aux loss cannot read a tree or padding
    out = decoder_output(model, {"output_router_logits": True} if moe else {}, input_ids=input_ids.to(device),
                         use_cache=False, **inputs, **router)
    hidden = out.last_hidden_state[:, :width].flatten(0, 1)[row.predict_index.to(device)]
    kept = row.sampling_mask.to(device) if row.sampling_mask is not None else None
    top = row.sampler_ids.to(device) if row.sampler_ids is not None else None
    scored = chunked_logprobs(hidden, model.get_output_embeddings(), row.targets.to(device), temperature, kept,
                              _softcap(model), chunk_size, extra_ids=top)
    if moe:
        real = torch.arange(wide)[None] < lengths[:, None]
        scored.aux_loss = _load_balancing_loss(model, out.router_logits, real.long().to(device))
    return scored


def _sequence_lengths(row: PackedRow) -> torch.Tensor:
    """The real tokens of each sequence a row forwards: the whole tree row, or each padded sample."""
    return torch.tensor([s.num_tokens for s in row.samples] if row.layout == PADDED else [row.num_tokens])


def _tree_inputs(row: PackedRow, wide: int, model: torch.nn.Module, kernel: str, device: torch.device) -> dict:
    """A tree row's depths and tree masks, `wide` tokens long: filler tokens at depth 0 that see only themselves."""
    filler = torch.arange(row.num_tokens, wide)
    position_ids = torch.cat([row.position_ids, filler * 0]).to(device)
    end = torch.cat([row.end, filler]).to(device)
    return {"position_ids": position_ids[None], "attention_mask": tree_masks(end, position_ids, model, kernel)}


def decoder_output(model: torch.nn.Module, decoder_kwargs: dict, **inputs):
    """The decoder's output (hidden states before the head, and `decoder_kwargs` passed to the decoder alone), from a
    call of the model itself with one logit kept: under FSDP2 the root module's forward is what gathers the
    embeddings and the head, which the chunked head then reads (the root keeps them gathered until its backward)."""
    captured = []
    decoder = model.get_decoder()
    hooks = [decoder.register_forward_pre_hook(lambda module, args, kwargs: (args, kwargs | decoder_kwargs), with_kwargs=True),
             decoder.register_forward_hook(lambda module, args, output: captured.append(output))]
    try:
        model(**inputs, logits_to_keep=1)
    finally:
        for hook in hooks:
            hook.remove()
    return captured[-1]


def _load_balancing_loss(model, router_logits, real: torch.Tensor) -> torch.Tensor:
    """The model's own router load-balancing loss over the row's real tokens (`real`, [sequences, width]: fillers and
    padding left out)."""
    config = model.config.get_text_config()
    balance = sys.modules[type(model).__module__].load_balancing_loss_func
    experts = getattr(config, "num_experts", None) or config.num_local_experts
    return balance(router_logits, experts, config.num_experts_per_tok, real)


def check_head(model: torch.nn.Module) -> None:
    """Make sure `head(decoder(x))` is the model's own logits: a model that scales or post-processes its
    logits in its forward would otherwise be trained on a different distribution than it samples from."""
    device = next(model.parameters()).device
    ids = torch.arange(1, 9, device=device)[None] % model.config.get_text_config().vocab_size
    with torch.no_grad():
        expected = model(input_ids=ids, use_cache=False).logits.float()
        hidden = model.get_decoder()(input_ids=ids, use_cache=False).last_hidden_state
        logits = model.get_output_embeddings()(hidden).float()
        if softcap := _softcap(model):
            logits = torch.tanh(logits / softcap) * softcap
    if not torch.allclose(logits, expected, atol=1e-3, rtol=1e-3):
        raise NotImplementedError(f"{type(model).__name__} computes its logits other than as lm_head(hidden states) "
                                  "(e.g. a logit scale); tandem's chunked log-prob head would not reproduce them.")


def _softcap(model) -> float | None:
    return getattr(model.config.get_text_config(), "final_logit_softcapping", None)
