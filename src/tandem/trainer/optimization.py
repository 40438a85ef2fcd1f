"""The optimizer, the learning-rate schedule and gradient clipping, with transformers' conventions: its `optim`
names, its weight-decay groups and its schedules, taken from transformers itself."""

import math
from collections.abc import Callable
from typing import TYPE_CHECKING, cast

import torch

from tandem.config import AsyncGRPOConfig, mapping
from tandem.errors import UsageError
from tandem.model.distributed import full_tensor

if TYPE_CHECKING:
    from transformers import PreTrainedModel, TrainingArguments


def make_optimizer(model: torch.nn.Module, args: AsyncGRPOConfig) -> torch.optim.Optimizer:
    """transformers' optimizer for `args.optim` over the trainable parameters (with LoRA: the adapter only); weight
    decay spares biases and normalisation weights, as in transformers' Trainer. The low-rank optimizers (galore_*,
    apollo_*) take the groups transformers makes from `optim_target_modules`."""
    from transformers import Trainer  # heavy: imported when a trainer is built, not with tandem

    try:  # transformers reads the optimizer fields AsyncGRPOConfig shares with its TrainingArguments
        cls, kwargs = Trainer.get_optimizer_cls_and_kwargs(
            cast("TrainingArguments", args), cast("PreTrainedModel", model)
        )
    except ValueError as exc:
        raise UsageError(
            f"AsyncGRPOConfig.optim={args.optim!r}: {exc}. Try adamw_torch_fused, adamw_torch, adafactor "
            "or sgd (transformers' OptimizerNames lists the rest)."
        ) from None
    if "params" in kwargs:  # GaLore / APOLLO: transformers grouped the projected weights (optim_target_modules)
        groups = kwargs.pop("params")
        return cls([{"weight_decay": args.weight_decay, **group} for group in groups], **kwargs)
    decayed = set(Trainer.get_decay_parameter_names(None, model))  # type: ignore[arg-type]  # reads no Trainer state
    trainable = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
    groups = [
        {"params": [p for name, p in trainable if name in decayed], "weight_decay": args.weight_decay},
        {"params": [p for name, p in trainable if name not in decayed], "weight_decay": 0.0},
    ]
    return cls([group for group in groups if group["params"]], **kwargs)


def make_scheduler(optimizer: torch.optim.Optimizer, args: AsyncGRPOConfig) -> torch.optim.lr_scheduler.LRScheduler:
    """transformers' schedule `lr_scheduler_type` with `lr_scheduler_kwargs`, after `warmup_steps` of linear warm-up
    (a fraction of max_steps when below 1). Warm-up applies to 'constant' too (transformers would ignore it)."""
    from transformers import get_scheduler

    warmup = math.ceil(args.warmup_steps * args.max_steps) if 0 < args.warmup_steps < 1 else int(args.warmup_steps)
    name = "constant_with_warmup" if args.lr_scheduler_type == "constant" and warmup else args.lr_scheduler_type
    schedule_kwargs = mapping(args.lr_scheduler_kwargs)
    return get_scheduler(
        name,
        optimizer,
        num_warmup_steps=warmup,
        num_training_steps=max(args.max_steps, 1),
        scheduler_specific_kwargs=schedule_kwargs,
    )


def clip_gradients(model: torch.nn.Module, max_grad_norm: float | None) -> torch.Tensor:
    """The gradient norm before clipping; `max_grad_norm` of 0 or None means no clipping (transformers' and TRL's
    convention: clipping to 0 would zero every update)."""
    if not max_grad_norm:
        norm = torch.nn.utils.get_total_norm([p.grad for p in model.parameters() if p.grad is not None])
    else:
        norm = torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.grad is not None], max_grad_norm)
    return full_tensor(norm)  # sharded gradients (FSDP2) give the norm as a DTensor


def step_optimizer(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    scaler: torch.amp.GradScaler | None,
    max_grad_norm: float | None,
    event: Callable[[str], None],
) -> float:
    """Clip the accumulated gradients, step the optimizer and the schedule, zero the gradients; returns the gradient
    norm before clipping. `event` tells the callbacks, as transformers does: `on_pre_optimizer_step` with the clipped
    gradients, `on_optimizer_step` with the stepped weights and the gradients still there. With fp16's `scaler`, the
    gradients are clipped and measured unscaled, and a step with inf/NaN ones is skipped."""
    if scaler:
        scaler.unscale_(optimizer)
    grad_norm = clip_gradients(model, max_grad_norm)
    event("on_pre_optimizer_step")
    if scaler:
        scaler.step(optimizer)
        scaler.update()
    else:
        optimizer.step()
    event("on_optimizer_step")
    scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    return float(grad_norm)
