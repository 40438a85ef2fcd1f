"""Log-probs and entropy at the trained positions of a packed row, a chunk at a time.

The model runs without its head; the head is applied only to the hidden states that predict trained
tokens, a chunk of them at a time, and each chunk's logits are recomputed in the backward pass instead of
kept, so peak memory holds one chunk's `chunk x vocab` logits, never the row's. Logits are divided
by the sampling temperature (the sampler's processed log-probs are on that scale), and when the
sampler truncated the distribution (top-k / top-p) the log-softmax runs over its kept set only.
"""

import sys
from dataclasses import dataclass
from typing import NamedTuple, TypeGuard

import torch
from torch.utils.checkpoint import checkpoint

from tandem.kernels import onednn_linear
from tandem.kernels.exact_attention import MIN_ROWS
from tandem.model.architecture import transformers_model
from tandem.packing.tree_attention import tree_masks
from tandem.packing.trie import PADDED, TREE, PackedRow

CHUNK_BYTES = 64 * 2**20
"""One chunk's fp32 logits at most (512 tokens at a 32k vocabulary): the chunk's temporaries then stay below the
head's own weight gradient, which every chunk size pays."""
CHUNK_SIZE_RANGE = (64, 1024)


def default_chunk_size(vocab_size: int) -> int:
    """How many trained tokens one chunk scores: as many as fit CHUNK_BYTES of logits, within CHUNK_SIZE_RANGE (below
    64 rows the matmuls slow down; above 1024 a small vocabulary gains nothing)."""
    low, high = CHUNK_SIZE_RANGE
    return max(low, min(high, CHUNK_BYTES // (4 * vocab_size)))


@dataclass
class TokenLogProbs:
    log_probs: torch.Tensor  # [N] log π_θ(target), differentiable
    entropy: torch.Tensor  # [N] entropy of the (renormalised) distribution, detached
    extra: torch.Tensor | None = None  # [N, K] log-probs of `extra_ids` (the sampler's top-K), differentiable
    aux_loss: torch.Tensor | None = None  # MoE router load-balancing loss of the row (unscaled), differentiable


def chunked_log_probs(
    hidden: torch.Tensor,
    head: torch.nn.Module,
    targets: torch.Tensor,
    temperature: float = 1.0,
    sampling_mask: torch.Tensor | None = None,
    softcap: float | None = None,
    chunk_size: int | None = None,
    extra_ids: torch.Tensor | None = None,
    logits_scaling: float | None = None,
) -> TokenLogProbs:
    """log softmax(head(hidden) / temperature)[target] for each of the N rows of `hidden` ([N, H]), and at
    `extra_ids` ([N, K]) when given. The model's own logits come first: divided by `logits_scaling` (Granite), then
    soft-capped (`softcap`, Gemma 2), in the order its forward computes them."""
    if not chunk_size:
        weight = head.weight  # a LoRA-wrapped head passes its base layer's through
        assert isinstance(weight, torch.Tensor), "an output head holds its matrix as `weight`"
        chunk_size = default_chunk_size(weight.shape[0])
    if hidden.shape[0] == 0:  # no trained token: an empty result still attached to the graph, so backward() works
        empty = hidden.new_zeros(0, dtype=torch.float32)
        width = extra_ids.shape[1] if extra_ids is not None else 0
        return TokenLogProbs(empty + hidden.sum() * 0, empty, hidden.new_zeros(0, width) + hidden.sum() * 0)
    settings = HeadSettings(temperature, sampling_mask, softcap, chunk_size, extra_ids, logits_scaling)
    if plain_linear(head):
        return _linear_head_log_probs(hidden, head, targets, settings)
    return _checkpointed_log_probs(hidden, head, targets, settings)


class HeadSettings(NamedTuple):
    """How `chunked_log_probs` reads the head's logits (its arguments past the head and the targets)."""

    temperature: float
    sampling_mask: torch.Tensor | None
    softcap: float | None
    chunk_size: int
    extra_ids: torch.Tensor | None
    logits_scaling: float | None


def _linear_head_log_probs(
    hidden: torch.Tensor, head: torch.nn.Linear, targets: torch.Tensor, settings: HeadSettings
) -> TokenLogProbs:
    """`chunked_log_probs` through a plain Linear head: its backward written out (LinearHeadLogProbs)."""
    temperature, sampling_mask, softcap, chunk_size, extra_ids, logits_scaling = settings
    extra = extra_ids if extra_ids is not None else targets.new_zeros(len(targets), 0)
    project = onednn_linear.projection(head)  # what head(x) computes
    logprobs, entropy, scored = LinearHeadLogProbs.apply(
        hidden,
        head.weight,
        head.bias,
        targets,
        extra,
        sampling_mask,
        temperature,
        softcap,
        chunk_size,
        project,
        logits_scaling,
    )
    return TokenLogProbs(logprobs, entropy, scored if extra_ids is not None else None)


def _checkpointed_log_probs(
    hidden: torch.Tensor, head: torch.nn.Module, targets: torch.Tensor, settings: HeadSettings
) -> TokenLogProbs:
    """`chunked_log_probs` through any other head (a LoRA-wrapped one): autograd, each chunk checkpointed."""
    temperature, sampling_mask, softcap, chunk_size, extra_ids, logits_scaling = settings
    parts = []
    for start in range(0, hidden.shape[0], chunk_size):
        part = slice(start, start + chunk_size)
        args = (
            head,
            hidden[part],
            targets[part],
            temperature,
            sampling_mask[part] if sampling_mask is not None else None,
            softcap,
            extra_ids[part] if extra_ids is not None else None,
            logits_scaling,
        )
        parts.append(checkpoint(_chunk, *args, use_reentrant=False) if torch.is_grad_enabled() else _chunk(*args))
    logprobs, entropy, extra = zip(*parts)
    return TokenLogProbs(torch.cat(logprobs), torch.cat(entropy), torch.cat(extra) if extra_ids is not None else None)


def plain_linear(head: torch.nn.Module) -> TypeGuard[torch.nn.Linear]:
    """Whether `head(x)` is `F.linear(x, head.weight, head.bias)` (FSDP2's dynamic subclass included): no other forward,
    no hooks (a head sharded on its own gathers its weight in one)."""
    return (
        isinstance(head, torch.nn.Linear)
        and type(head).forward is torch.nn.Linear.forward
        and not (head._forward_hooks or head._forward_pre_hooks)
    )


class LinearHeadLogProbs(torch.autograd.Function):
    """`chunked_log_probs` through a plain Linear head, its backward written out (§ log-softmax: d lp[t] / d logits =
    onehot(t) - softmax): each chunk's logits are recomputed and turned into their gradient in place, and the weight
    gradient is accumulated into one buffer. Autograd with checkpointing kept about five chunk-sized temporaries and a
    second [vocab, hidden] gradient per chunk: 855 MiB against about 300 at 8192 tokens x 32k vocabulary (benchmarks)."""

    @staticmethod
    def forward(
        ctx, hidden, weight, bias, targets, extra_ids, kept, temperature, softcap, chunk_size, project, scaling
    ):
        def head(x):
            return project(x, weight, bias)

        with torch.no_grad():  # the forward of the autograd path, value for value (the staleness-0 ratio is exactly 1)
            parts = [
                _chunk(
                    head,
                    hidden[part],
                    targets[part],
                    temperature,
                    kept[part] if kept is not None else None,
                    softcap,
                    extra_ids[part],
                    scaling,
                )
                for part in _chunks(hidden.shape[0], chunk_size)
            ]
        ctx.save_for_backward(hidden, weight, bias, targets, extra_ids, kept)
        ctx.settings = temperature, softcap, chunk_size, project, scaling
        logprobs, entropy, extra = (torch.cat(values) for values in zip(*parts))
        ctx.mark_non_differentiable(entropy)
        return logprobs, entropy, extra

    @staticmethod
    def backward(ctx, grad_log_probs, _grad_entropy, grad_extra):
        hidden, weight, bias, targets, extra_ids, kept = ctx.saved_tensors
        temperature, softcap, chunk_size, project, scaling = ctx.settings
        wants_hidden, wants_weight, wants_bias = ctx.needs_input_grad[:3]
        grad_hidden = torch.empty_like(hidden) if wants_hidden else None
        grad_weight = torch.zeros_like(weight) if wants_weight else None
        grad_bias = torch.zeros_like(bias) if wants_bias else None
        for part in _chunks(hidden.shape[0], chunk_size):
            grad = _logits_grad(
                project(hidden[part], weight, bias),
                weight.dtype,
                targets[part],
                grad_log_probs[part],
                extra_ids[part],
                grad_extra[part],
                kept[part] if kept is not None else None,
                temperature,
                softcap,
                scaling,
            )
            if wants_hidden:
                torch.mm(grad, weight, out=grad_hidden[part])
            if wants_weight:
                grad_weight.addmm_(grad.T, hidden[part])
            if wants_bias:
                grad_bias += grad.sum(0)
        return grad_hidden, grad_weight, grad_bias, None, None, None, None, None, None, None, None


def _chunks(rows: int, chunk_size: int) -> list[slice]:
    return [slice(start, start + chunk_size) for start in range(0, rows, chunk_size)]


def _logits_grad(logits, dtype, targets, grad_target, extra_ids, grad_extra, kept, temperature, softcap, scaling):
    """d loss / d logits for one chunk's recomputed logits, built in their buffer: onehot(targets) * g + onehot(extra) *
    g_extra - softmax * (g + sum g_extra), zero where the sampler masked, then back through temperature, softcap and
    the logits' scaling."""
    logits = logits.float() if logits.dtype != torch.float64 else logits
    if scaling:
        logits = logits.div_(scaling)
    capped = torch.tanh(logits / softcap) if softcap else None
    scaled = (capped * softcap if softcap else logits).div_(temperature)
    keep = None
    if kept is not None:
        keep = torch.zeros_like(scaled, dtype=torch.bool).scatter_(1, torch.where(kept >= 0, kept, kept[:, :1]), True)
        scaled.masked_fill_(~keep, float("-inf"))
    grad = scaled.sub_(scaled.amax(-1, keepdim=True)).exp_()  # the softmax, in the logits' own buffer
    grad.div_(grad.sum(-1, keepdim=True)).mul_(-(grad_target + grad_extra.sum(-1))[:, None])
    grad.scatter_add_(1, targets[:, None], grad_target[:, None].to(grad.dtype))
    grad.scatter_add_(1, extra_ids, grad_extra.to(grad.dtype))
    if keep is not None:
        grad.masked_fill_(~keep, 0.0)
    grad.div_(temperature)
    if softcap:
        grad.mul_(capped.square_().neg_().add_(1))
    if scaling:
        grad.div_(scaling)
    return grad.to(dtype)


def _chunk(head, hidden, targets, temperature, kept, softcap, extra_ids, scaling=None):
    """One chunk's log-probs at `targets` and `extra_ids`, and its entropy. Without autograd (LinearHeadLogProbs'
    forward) every step runs in place, the same kernels on the same values: two chunk-sized buffers alive, not six."""
    rows, in_place = hidden.shape[0], not torch.is_grad_enabled()
    if rows < MIN_ROWS:  # as in the sampler: CPU matmuls with fewer rows round differently
        hidden = torch.cat([hidden, hidden[-1:].expand(MIN_ROWS - rows, -1)])
    logits = head(hidden)[:rows]
    logits = logits.float() if logits.dtype != torch.float64 else logits  # half-precision logits are scored in fp32
    if scaling:
        logits = logits.div_(scaling) if in_place else logits / scaling
    if softcap:
        logits = logits.div_(softcap).tanh_().mul_(softcap) if in_place else torch.tanh(logits / softcap) * softcap
    logits = logits.div_(temperature) if in_place else logits / temperature
    if kept is not None:
        keep = torch.zeros_like(logits, dtype=torch.bool)
        keep.scatter_(1, torch.where(kept >= 0, kept, kept[:, :1]), True)  # pads repeat the first kept id
        logits = logits.masked_fill_(~keep, float("-inf")) if in_place else logits.masked_fill(~keep, float("-inf"))
    all_logprobs = logits.log_softmax(-1)
    del logits
    chosen = all_logprobs.gather(1, targets[:, None])[:, 0]
    extra = all_logprobs.gather(1, extra_ids) if extra_ids is not None else None
    with torch.no_grad():
        probs = all_logprobs.exp()
        finite = all_logprobs.nan_to_num_(neginf=0.0) if in_place else all_logprobs.nan_to_num(neginf=0.0)
        entropy = -(probs.mul_(finite)).sum(-1)
    return chosen, entropy, extra


def row_log_probs(
    model: torch.nn.Module, row: PackedRow, kernel: str, temperature: float = 1.0, chunk_size: int | None = None
) -> TokenLogProbs:
    """Forward a row through `model` and score its loss terms: a tree row as one sequence under the tree mask
    (attention set to `tandem_tree`), a padded row as a batch of plain causal sequences (the model's own attention)."""
    device = next(model.parameters()).device
    lengths = _sequence_lengths(row)
    width = row.num_tokens // len(lengths)
    wide = max(width, MIN_ROWS)  # CPU matmuls with fewer rows round differently (exact_attention.py)
    inputs = _tree_inputs(row, wide, model, kernel, device) if row.layout == TREE else {}
    input_ids = torch.nn.functional.pad(row.input_ids.view(len(lengths), width), (0, wide - width))
    moe = _balancing_loss_func(model) is not None
    router = {"output_router_logits": False} if moe else {}  # the model's own aux loss cannot read a tree or padding
    out = decoder_output(
        model,
        {"output_router_logits": True} if moe else {},
        input_ids=input_ids.to(device),
        use_cache=False,
        **inputs,
        **router,
    )
    hidden = out.last_hidden_state[:, :width].flatten(0, 1)[row.predict_index.to(device)]
    kept = row.sampling_mask.to(device) if row.sampling_mask is not None else None
    top = row.sampler_ids.to(device) if row.sampler_ids is not None else None
    scored = chunked_log_probs(
        hidden,
        transformers_model(model).get_output_embeddings(),
        row.targets.to(device),
        temperature,
        kept,
        _softcap(model),
        chunk_size,
        extra_ids=top,
        logits_scaling=_logits_scaling(model),
    )
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
    decoder = transformers_model(model).get_decoder()
    hooks = [
        decoder.register_forward_pre_hook(
            lambda module, args, kwargs: (args, kwargs | decoder_kwargs), with_kwargs=True
        ),
        decoder.register_forward_hook(lambda module, args, output: captured.append(output)),
    ]
    try:
        model(**inputs, logits_to_keep=1)
    finally:
        for hook in hooks:
            hook.remove()
    return captured[-1]


def _load_balancing_loss(model: torch.nn.Module, router_logits, real: torch.Tensor) -> torch.Tensor:
    """The model's own router load-balancing loss over the row's real tokens (`real`, [sequences, width]: fillers and
    padding left out)."""
    config = transformers_model(model).config.get_text_config()
    balance = _balancing_loss_func(model)
    experts = getattr(config, "num_experts", None) or config.num_local_experts
    return balance(router_logits, experts, config.num_experts_per_tok, real)


def _balancing_loss_func(model: torch.nn.Module):
    """The router load-balancing loss of an MoE model that trains with one (Mixtral, Qwen-MoE), else None: a dense
    model, or one that balances its experts without a loss (DeepSeek-V3's bias on the routing scores)."""
    if not hasattr(transformers_model(model).config.get_text_config(), "output_router_logits"):
        return None
    return getattr(sys.modules[type(model).__module__], "load_balancing_loss_func", None)


def check_head(model: torch.nn.Module) -> None:
    """Make sure `head(decoder(x))` is the model's own logits: a model that scales or post-processes its
    logits in its forward would otherwise be trained on a different distribution than it samples from."""
    device = next(model.parameters()).device
    transformers = transformers_model(model)
    ids = torch.arange(1, 9, device=device)[None] % transformers.config.get_text_config().vocab_size
    with torch.no_grad():
        expected = model(input_ids=ids, use_cache=False).logits.float()
        hidden = transformers.get_decoder()(input_ids=ids, use_cache=False).last_hidden_state
        logits = transformers.get_output_embeddings()(hidden).float()
        if scaling := _logits_scaling(model):
            logits = logits / scaling
        if softcap := _softcap(model):
            logits = torch.tanh(logits / softcap) * softcap
    if not torch.allclose(logits, expected, atol=1e-3, rtol=1e-3):
        raise NotImplementedError(
            f"{type(model).__name__} computes its logits other than as lm_head(hidden states) "
            "(e.g. a logit scale); tandem's chunked log-prob head would not reproduce them."
        )


def _logits_scaling(model) -> float | None:
    """What a Granite model divides its logits by (`logits_scaling`, 8 or 16 in released checkpoints)."""
    return getattr(model.config.get_text_config(), "logits_scaling", None)


def _softcap(model) -> float | None:
    return getattr(model.config.get_text_config(), "final_logit_softcapping", None)
