"""What the rollout worker will run, checked when the trainer is built (before any training work): the tools and
environments, the chat template multi-turn rollouts render with, and that all of it can be sent to the worker; then
the settings it starts with (`worker_spec`)."""

import copy
import math
import warnings

from tandem.chat.prompts import check_prefix_preserving, training_chat_template
from tandem.chat.tool_calls import tool_schema
from tandem.errors import UsageError
from tandem.generation.server_facts import ServerFacts
from tandem.rollout.environments import factories_of, validate_environments
from tandem.rollout.loop import AsyncRolloutLoop
from tandem.rollout.scoring import reward_name
from tandem.rollout.settings import RolloutSettings
from tandem.rollout.tools import validate_tools
from tandem.rollout.worker import WorkerSpec, check_picklable


def check_agents(tools: list, environment_factory, dataset, eval_dataset=None, harness=None) -> bool:
    """Tools and environments, checked before any training work (the eval rows' environments too); returns whether
    an environment (or a harness's environment) owns a reward."""
    if harness is not None:
        if tools or environment_factory is not None:
            raise UsageError(
                f"{type(harness).__name__}: its environment's sessions offer each rollout's tools, so tools= "
                "and environment_factory= do not apply; give the tools to the environment"
            )
        check_picklable({type(harness).__name__: harness})
        return True
    validate_tools(tools)
    labels = {f"tool {getattr(tool, '__name__', tool)!r}": tool for tool in tools}
    factories = factories_of(environment_factory)
    labels |= {f"environment_factory {name!r}" if name else "environment_factory": f for name, f in factories.items()}
    check_picklable(labels)
    if environment_factory is None:
        return False
    classes = validate_environments(
        environment_factory, tools, {"train_dataset": dataset, "eval_dataset": eval_dataset}
    )
    return any(callable(getattr(cls, "get_reward", None)) for cls in classes)


def loop_class(loop_cls: type | None, harness) -> type | None:
    """The loop the worker runs: the trainer's, or a harness's own; a trainer's loop over a harness must extend it."""
    if harness is None:
        return loop_cls
    if loop_cls is None:
        return harness.loop_cls
    if not issubclass(loop_cls, harness.loop_cls):
        raise UsageError(
            f"loop_cls {loop_cls.__name__} does not extend {harness.loop_cls.__name__}, which plays the "
            f"episodes of {type(harness).__name__}: subclass it to customise the hooks"
        )
    return loop_cls


def check_reward_names(reward_funcs: list) -> None:
    """Scores and metrics are kept by the function's name: a second function of the same name would replace the first
    (two partials of one function summed to the second's score alone)."""
    names = [reward_name(func) for func in reward_funcs]
    twice = sorted({name for name in names if names.count(name) > 1})
    if twice:
        raise UsageError(
            f"reward functions share the name {', '.join(map(repr, twice))}: give each its own (a def of "
            "its own, or a partial given a __name__ with functools.update_wrapper)"
        )


def check_sendable(reward_funcs: list, loop_cls: type | None) -> None:
    """The reward functions and the loop class reach the worker pickled: name the first that cannot."""
    check_picklable({f"reward function {i}": f for i, f in enumerate(reward_funcs)} | {"loop_cls": loop_cls})


def rollout_template(tokenizer, tools: list, chat_template_kwargs: dict | None) -> str | None:
    """Multi-turn rollouts re-render the conversation every turn; a template that renders earlier turns differently once
    the conversation grows makes every turn fork. A training-safe template for known families (None: the model's own
    is prefix-preserving, or tandem has none for it, which is warned about)."""
    schemas = [tool_schema(tool) for tool in tools] or None
    problem = check_prefix_preserving(tokenizer, schemas, chat_template_kwargs)
    if problem is None:
        return None
    known = training_chat_template(tokenizer)
    if known is None:
        warnings.warn(
            f"the chat template is not prefix-preserving ({problem}) and tandem has no training template for "
            "it: multi-turn rollouts will fork at every re-rendered turn (rollout/fork_frac). Pass a "
            "processing_class whose chat_template renders earlier turns unchanged.",
            stacklevel=4,
        )
        return None
    family, template = known
    print(
        f"tandem: the chat template is not prefix-preserving ({problem}); training with tandem's {family} training "
        "template, which renders earlier turns unchanged"
    )
    return template


def worker_spec(
    spec,
    point,
    *,
    served_name: str,
    served_url: str,
    token_budget: int,
    server: ServerFacts,
    world_size: int,
    adapter_name: str | None,
) -> WorkerSpec:
    """The worker's loop and settings for the run of `spec` (a runtime.RuntimeSpec), generating from the ResumePoint
    `point` on; its tokenizer is saved under output_dir with the template rollouts render with."""
    args = spec.args
    tokenizer_path = spec.output_dir / ".tokenizer"
    tokenizer = copy.copy(spec.tokenizer)  # the training template renders rollouts; checkpoints keep the model's own
    tokenizer.chat_template = spec.rollout_template or spec.tokenizer.chat_template
    tokenizer.save_pretrained(tokenizer_path)
    settings = RolloutSettings(
        config=args,
        model_name=served_name,
        tokenizer_path=str(tokenizer_path),
        dataset=spec.dataset,
        reward_funcs=spec.reward_funcs,
        eos_token_ids=spec.eos_token_ids,
        base_url=served_url,
        tools=spec.tools,
        environment_factory=spec.environment_factory,
        harness=spec.harness,
        api_key=args.vllm_server_api_key,
        dataset_start_index=point.dataset_start_index,
        received=point.received,
        queued_tokens=point.queued_tokens,
        full_step_tokens=full_step_tokens(token_budget, args.gradient_accumulation_steps, world_size),
        num_prompts=num_prompts(args, spec.dataset),
        eval_dataset=spec.eval_dataset,
        server=server,
        adapter_name=adapter_name,
    )
    return WorkerSpec(loop_cls=spec.loop_cls or AsyncRolloutLoop, settings=settings)


def num_prompts(args, dataset) -> int | None:
    """Where the prompt stream ends: epochs × rows; None for an endless stream (max_steps decides, or environments
    sample their own tasks)."""
    if args.max_steps > 0 or dataset is None:
        return None
    return math.ceil(args.num_train_epochs * len(dataset))


def full_step_tokens(token_budget: int, gradient_accumulation_steps: int, world_size: int) -> int:
    """The pacing allowance's step before the first one trained: as if every row were full, one row per
    rank in each of the step's micro-batches."""
    return token_budget * gradient_accumulation_steps * world_size
