"""The optimizer, the learning-rate schedule and gradient clipping, with transformers' conventions."""

import math

import torch

from tandem.config import AsyncGRPOConfig
from tandem.trainer.distributed import full_tensor


def make_optimizer(model: torch.nn.Module, args: AsyncGRPOConfig) -> torch.optim.Optimizer:
    """AdamW over the trainable parameters (with LoRA: the adapter only)."""
    trainable = [p for p in model.parameters() if p.requires_grad]
    return torch.optim.AdamW(trainable, lr=args.learning_rate, betas=(args.adam_beta1, args.adam_beta2),
                             eps=args.adam_epsilon, weight_decay=args.weight_decay)


def make_scheduler(optimizer: torch.optim.Optimizer, args: AsyncGRPOConfig) -> torch.optim.lr_scheduler.LambdaLR:
    """Linear warmup (`warmup_steps`, a fraction of max_steps when < 1), then constant, linear or cosine decay."""
    warmup = args.warmup_steps * args.max_steps if 0 < args.warmup_steps < 1 else args.warmup_steps
    total = max(args.max_steps, 1)

    def factor(step: int) -> float:
        if warmup and step < warmup:
            return (step + 1) / warmup
        if args.lr_scheduler_type in ("constant", "constant_with_warmup"):
            return 1.0
        progress = min(1.0, (step - warmup) / max(1.0, total - warmup))
        return 1.0 - progress if args.lr_scheduler_type == "linear" else 0.5 * (1 + math.cos(math.pi * progress))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def clip_gradients(model: torch.nn.Module, max_grad_norm: float | None) -> torch.Tensor:
    """The gradient norm before clipping; `max_grad_norm` of 0 or None means no clipping (transformers' and TRL's
    convention: clipping to 0 would zero every update)."""
    parameters = [p for p in model.parameters() if p.grad is not None]
    if not max_grad_norm:
        norm = torch.nn.utils.get_total_norm([p.grad for p in parameters])
    else:
        norm = torch.nn.utils.clip_grad_norm_(parameters, max_grad_norm)
    return full_tensor(norm)  # sharded gradients (FSDP2) give the norm as a DTensor
