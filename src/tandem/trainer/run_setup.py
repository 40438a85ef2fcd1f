"""What the trainer checks and chooses before its first step: the datasets and reward functions it is given, the
attention kernel, the MoE router's loss weight, the random state and the log level."""

import warnings
from dataclasses import dataclass

import torch
from transformers.trainer_utils import enable_full_determinism
from transformers.utils import logging as hf_logging

from tandem import integrations
from tandem.chat.tool_formats import tool_call_format
from tandem.config import AsyncGRPOConfig, mapping
from tandem.contract.agents import EnvironmentFactories, Harness
from tandem.dataset_rows import Rows, RowTable, is_iterable
from tandem.errors import UsageError
from tandem.packing import tree_attention
from tandem.runtime.rollout_inputs import check_agents, check_reward_names, rollout_template
from tandem.trainer import OPENMP_POLICY_TOO_LATE
from tandem.trainer.model import check_dataset, drop_unused_columns


@dataclass
class Inputs:
    """What the trainer is given to train on and score with, checked and adapted (another library's environments
    turned into a harness, a dataset's unused columns dropped)."""

    dataset: Rows | None
    eval_dataset: RowTable | None
    reward_funcs: list
    tools: list
    environment_factory: EnvironmentFactories | None
    harness: Harness | None

    @property
    def agent(self) -> bool:
        """The rollouts call tools or play environments."""
        return bool(self.tools) or self.environment_factory is not None or self.harness is not None


def check_inputs(
    args: AsyncGRPOConfig, train_dataset, eval_dataset, reward_funcs, tools, environment_factory, harness
) -> Inputs:
    """The trainer's datasets, reward functions, tools and environments, each refused with its reason when it cannot
    be trained on as given."""
    train_dataset, eval_dataset, reward_funcs, harness = integrations.adapt(
        train_dataset, eval_dataset, reward_funcs, harness
    )
    tools = list(tools or [])
    environments = environment_factory is not None or harness is not None
    dataset = check_train_dataset(train_dataset, args, environments)
    eval_dataset = check_eval_dataset(eval_dataset, args, environments)
    reward_funcs = reward_list(reward_funcs, check_agents(tools, environment_factory, dataset, eval_dataset, harness))
    if args.remove_unused_columns:
        dataset = drop_unused_columns(dataset, reward_funcs, environments)
    return Inputs(dataset, eval_dataset, reward_funcs, tools, environment_factory, harness)


def warn_train_arguments(ignore_keys_for_eval, device: torch.device) -> None:
    """train()'s warnings: an argument that has no effect here, and OpenMP threads that will spin."""
    if ignore_keys_for_eval is not None:
        warnings.warn(
            "train(ignore_keys_for_eval=...) has no effect: evaluation generates and scores completions, "
            "it returns no model outputs to leave out",
            stacklevel=3,
        )
    if OPENMP_POLICY_TOO_LATE and device.type == "cpu" and torch.get_num_threads() > 1:
        warnings.warn(
            "torch was imported before tandem, so its OpenMP threads spin while they wait and slow the "
            "embedded server and the rollout worker (the demo ran 1.4x slower). Start Python with "
            "OMP_WAIT_POLICY=PASSIVE, or import tandem before torch.",
            stacklevel=3,
        )


def seed_run(args: AsyncGRPOConfig) -> None:
    """The trainer's random state from `seed`; with full_determinism also deterministic algorithms (transformers')."""
    if args.full_determinism:
        enable_full_determinism(args.seed)
    else:
        torch.manual_seed(args.seed)


def run_log_level(args: AsyncGRPOConfig, main: bool, local_main: bool) -> str:
    """log_level on the job's first process (and each machine's first with log_on_each_node), else log_level_replica."""
    return args.log_level if main or (args.log_on_each_node and local_main) else args.log_level_replica


def set_log_level(level: str) -> None:
    """transformers' logging verbosity for the run, as its Trainer sets it (`passive` leaves it alone)."""
    if level != "passive":
        hf_logging.set_verbosity(hf_logging.log_levels[level])


def check_train_dataset(dataset, args: AsyncGRPOConfig, environments: bool) -> Rows | None:
    """The training prompts, if they can be ordered as asked (an IterableDataset streams in its own order, as in
    transformers) and have the epochs an 'epoch' strategy counts."""
    dataset = check_dataset(dataset, environments=environments, max_steps=args.max_steps)
    by_epoch = [
        name for name in ("logging_strategy", "save_strategy", "eval_strategy") if getattr(args, name) == "epoch"
    ]
    if by_epoch and (dataset is None or is_iterable(dataset)):
        raise UsageError(
            f"{by_epoch[0]}='epoch' needs a dataset with a length to count epochs by, and "
            f"{'an IterableDataset has none' if dataset is not None else 'the environments make their own tasks'}"
            ": use 'steps'."
        )
    if is_iterable(dataset) and args.data_seed is not None:  # 'random' (the default) orders indexed datasets only
        raise UsageError(
            f"data_seed={args.data_seed} orders a dataset by its indices, and an IterableDataset has none: "
            "shuffle the stream itself (dataset.shuffle(seed=..., buffer_size=...)), or drop data_seed."
        )
    return dataset


def check_eval_dataset(eval_dataset, args: AsyncGRPOConfig, environments: bool) -> RowTable | None:
    """The eval prompts, when evaluation is asked for and they can be generated; neither is silently ignored."""
    if eval_dataset is None:
        if args.eval_strategy != "no" or args.eval_on_start:
            raise UsageError(
                f"eval_strategy={args.eval_strategy!r} / eval_on_start={args.eval_on_start} needs an "
                "eval_dataset (prompts generated and scored, never trained): pass one to AsyncGRPOTrainer, "
                "or an eval_dataset key in the recipe"
            )
        return None
    if args.eval_strategy == "no" and not args.eval_on_start:
        warnings.warn(
            "an eval_dataset was given but eval_strategy='no' and eval_on_start=False: it is never evaluated. "
            "Set eval_strategy='steps' (every eval_steps steps) or eval_on_start=True.",
            stacklevel=4,
        )
    if is_iterable(eval_dataset):
        raise UsageError(
            "eval_dataset is an IterableDataset: each evaluation generates all of it, so it needs a length. "
            "Take a fixed set of rows, e.g. Dataset.from_list(list(eval_dataset.take(256)))."
        )
    try:
        return check_dataset(eval_dataset, environments=environments)
    except ValueError as exc:
        raise UsageError(f"eval_dataset: {exc}".replace("train_dataset", "eval_dataset")) from None


def reward_list(reward_funcs, environment_rewards: bool) -> list:
    funcs = list(reward_funcs) if isinstance(reward_funcs, (list, tuple)) else [reward_funcs] if reward_funcs else []
    if not funcs and not environment_rewards:
        raise UsageError(
            "reward_funcs is empty and no environment defines get_reward(): pass at least one reward function "
            "(e.g. tandem.rewards.accuracy_reward), or give the environment a get_reward() method"
        )
    for func in funcs:
        if isinstance(func, (str, torch.nn.Module)):  # TRL's GRPOTrainer takes these; its AsyncGRPOTrainer does not
            raise UsageError(
                f"reward function {type(func).__name__} {str(func)[:80]!r}: reward models are not supported "
                "(as in TRL's AsyncGRPOTrainer); pass a function that scores the completions, "
                "calling the model there"
            )
        if not callable(func):
            raise TypeError(f"reward function {func!r} is not callable; pass functions, not {type(func).__name__}")
    check_reward_names(funcs)
    return funcs


def attention_kernel(args: AsyncGRPOConfig, device: torch.device) -> str:
    """The tree-attention kernel the rows are trained with: the configured one, or the device's default."""
    kernel = args.tree_attention_kernel or tree_attention.default_kernel(device)
    if kernel == "flex" and device.type != "cuda":
        raise UsageError(
            "tree_attention_kernel='flex' needs a GPU: FlexAttention has no backward pass on CPU. "
            "Use 'exact' or 'sdpa'."
        )
    return kernel


def router_coefficient(args: AsyncGRPOConfig, model) -> float:
    """The weight of a Mixture-of-Experts model's balancing loss: the config's, else the model's own (0 without a router)."""
    text_config = model.config.get_text_config()
    if args.router_aux_loss_coef is not None and not hasattr(text_config, "router_aux_loss_coef"):
        raise UsageError(
            f"AsyncGRPOConfig.router_aux_loss_coef={args.router_aux_loss_coef}: the model is not a "
            "Mixture-of-Experts model (its config has no router), so there is no balancing loss to weigh. "
            "Leave it None."
        )
    if args.router_aux_loss_coef is not None:
        return args.router_aux_loss_coef
    return getattr(text_config, "router_aux_loss_coef", 0.0) or 0.0


def empty_device_cache(device: torch.device) -> None:
    """torch_empty_cache_steps: hand the accelerator's cached free blocks back (the CPU keeps no such cache)."""
    if device.type != "cpu":
        getattr(torch, device.type).empty_cache()  # torch.cuda / torch.xpu / torch.mps


def rollout_chat_template(tokenizer, inputs: Inputs, args: AsyncGRPOConfig) -> str | None:
    """The training-safe chat template the worker renders multi-turn rollouts with when the model's own is not
    prefix-preserving (None: the model's own, or no tools and environments); and the tokenizer checked to have the
    tokens of `tool_call_parser`'s format."""
    if args.tool_call_parser is not None:
        tool_call_format(args.tool_call_parser, tokenizer)
    return rollout_template(tokenizer, inputs.tools, mapping(args.chat_template_kwargs)) if inputs.agent else None
