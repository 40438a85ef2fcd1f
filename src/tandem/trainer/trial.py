"""`train(trial=...)`: transformers' hyperparameter-search hook, for a trial given as a dict of config fields.

transformers' Trainer sets each key of a dict trial on its arguments before it trains; tandem does the same for the
fields a search tunes and that training reads after the trainer is built (the optimizer and its schedule, the
sampling, the loss, the pacing), and refuses the fields read only while the trainer is built (the model, its
tokenizer, its precision and kernels), which a trial could not change.
"""

import dataclasses
import difflib

from tandem.config import AsyncGRPOConfig
from tandem.errors import UsageError

OPTIMIZER_FIELDS = frozenset(
    {
        "learning_rate",
        "weight_decay",
        "adam_beta1",
        "adam_beta2",
        "adam_epsilon",
        "optim",
        "optim_args",
        "lr_scheduler_type",
        "lr_scheduler_kwargs",
        "warmup_steps",
        "max_steps",
        "num_train_epochs",
    }
)
"""Fields the optimizer and its schedule are built from: a trial rebuilds both."""
TRIAL_FIELDS = OPTIMIZER_FIELDS | {
    "max_grad_norm",
    "gradient_accumulation_steps",
    "seed",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "repetition_penalty",
    "max_completion_length",
    "epsilon",
    "epsilon_high",
    "score_centering",
    "vllm_importance_sampling_clip_min",
    "vllm_importance_sampling_clip_max",
    "num_sampler_logprobs",
    "flash_delta",
    "flash_negative_token_fraction",
    "flash_batch_size",
    "router_aux_loss_coef",
    "max_staleness",
    "token_budget",
    "max_concurrent_rollouts",
    "weight_sync_steps",
    "logging_steps",
    "save_steps",
    "eval_steps",
}
"""Fields a trial may set: each is read when training runs, or by a part the trial rebuilds."""


def trial_args(args: AsyncGRPOConfig, trial, optimizer_given: bool) -> AsyncGRPOConfig:
    """`args` with the trial's values, checked as any config is. A key that is no field, a field read only while the
    trainer is built, or an optimizer field when the optimizer was given (`optimizers=`) is refused, naming it."""
    if not isinstance(trial, dict):
        raise NotImplementedError(
            f"train(trial={type(trial).__name__}): tandem takes a trial as a dict of AsyncGRPOConfig fields; an "
            "Optuna or Ray trial object needs transformers' hyperparameter_search, which tandem does not run"
        )
    fields = [item.name for item in dataclasses.fields(args)]
    for key in trial:
        if key not in fields:
            near = difflib.get_close_matches(key, fields, n=1)
            hint = f" (did you mean {near[0]!r}?)" if near else ""
            raise UsageError(f"train(trial=...): {key!r} is not an AsyncGRPOConfig field{hint}")
        if key not in TRIAL_FIELDS:
            raise UsageError(
                f"train(trial=...): {key} is read while the trainer is built (its model, tokenizer, precision or "
                f"kernels), so a trial cannot change it: pass it in args=AsyncGRPOConfig({key}=...) instead"
            )
        if optimizer_given and key in OPTIMIZER_FIELDS:
            raise UsageError(
                f"train(trial=...): {key} builds the optimizer or its schedule, and this trainer was given its own "
                "(optimizers=...): set it on them instead"
            )
    return dataclasses.replace(args, **trial)
