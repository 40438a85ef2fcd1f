"""`AsyncGRPOConfig`: every knob of a run as plain values, with the spec's names and defaults.

Fields that tandem does not implement are absent (passing one is a TypeError naming it), and every
value is checked up front so a bad one fails before any process starts, with the fix in the message.
`load_recipe` reads the YAML recipes of `tandem train`: config fields plus `model`, `dataset`,
`reward_funcs`, `tools` and `environment_factory` (import paths) and `lora`.
"""

import dataclasses
import difflib
import importlib
import json
import numbers
import os
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

ALGORITHMS = ("grpo", "flash_reinforce")


@dataclass
class AsyncGRPOConfig:
    # ---- run and optimisation ----
    output_dir: str = "runs/tandem"
    num_train_epochs: float = 3.0
    """Passes over the prompt dataset (filtered and dropped prompts count). Ignored when max_steps > 0."""
    max_steps: int = -1
    learning_rate: float = 1e-6
    lr_scheduler_type: str = "constant"
    """constant | linear | cosine | constant_with_warmup (decaying schedules need max_steps)."""
    lr_scheduler_kwargs: dict | None = None
    warmup_steps: float = 0
    """Steps of linear warm-up; a value below 1 is a fraction of max_steps."""
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_epsilon: float = 1e-8
    gradient_accumulation_steps: int = 1
    max_grad_norm: float = 1.0
    bf16: bool | None = None
    """Autocast the trainer's forward to bfloat16. Default: on with CUDA, off on CPU (where it is slow)."""
    gradient_checkpointing: bool = True
    logging_steps: int = 1
    report_to: str | list[str] | None = "none"
    """Extra metric sinks: trackio, tensorboard, wandb (offline). metrics.jsonl is always written."""
    run_name: str | None = None
    save_strategy: str = "steps"
    """steps | no. Checkpoints are also written at the end of training unless 'no'."""
    save_steps: int = 500
    save_total_limit: int | None = None
    enable_jit_checkpoint: bool = False
    """On SIGTERM (a preemption notice), finish the step in progress, write a checkpoint and stop, so the job resumes
    where it stopped (default off, as in transformers: SIGTERM then ends the process at once)."""
    seed: int = 42
    model_init_kwargs: dict | None = None
    dtype: str = "float32"
    router_aux_loss_coef: float | None = None
    fsdp_config: dict | str | None = None
    """Under torchrun (FSDP2): {"reshard_after_forward": bool} (default true; false keeps each layer's gathered
    weights from its forward to its backward: more memory, one all-gather fewer); as in transformers, also a JSON
    string or the path of a JSON file."""

    # ---- generation ----
    num_generations: int = 8
    max_completion_length: int = 2048
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float | None = None
    repetition_penalty: float = 1.0
    chat_template_kwargs: dict | None = None
    max_tool_calling_iterations: int | None = None
    """Tool-calling turns per rollout at most; None: until a reply calls no tool."""
    tool_call_timeout: float = 60.0
    """Seconds one tool call may take; a late call is an error message to the model and a failure. tandem's own field."""

    # ---- the generation server ----
    vllm_server_base_url: str | None = None
    """URL of `vllm serve` / `tandem serve` / `tandem proxy`. None: start `tandem serve` for the model."""
    vllm_server_timeout: float = 1800.0
    vllm_server_api_key: str | None = None
    """Sent as `Authorization: Bearer KEY` to a server started with --api-key. None: $VLLM_API_KEY if set. tandem's own."""
    vllm_server_host: str = "127.0.0.1"
    """The embedded server's bind address (0.0.0.0 to let other machines generate from it). tandem's own."""
    weight_transfer_address: str = "127.0.0.1"
    """Where servers with a weight-transfer backend reach the trainer's rank 0 to join its transfer group: an address of
    this machine they can connect to (loopback for servers on this machine). tandem's own."""

    # ---- the loss ----
    algorithm: str = "grpo"
    """"grpo", or "flash_reinforce" (spec 004: one rollout per prompt, batch-mean baseline, Sequence Trust Region)."""
    flash_delta: float = 3e-3
    """FlashREINFORCE: a trajectory trains only if its mean Bernoulli KL to the sampler is at most this."""
    flash_negative_token_fraction: float = 1.0
    """FlashREINFORCE: failed trajectories (reward <= 0) keep only this fraction of their tokens, the highest-entropy ones."""
    epsilon: float = 0.2
    epsilon_high: float | None = None
    score_centering: bool = True
    vllm_importance_sampling_clip_min: float = 0.5
    vllm_importance_sampling_clip_max: float = 5.0
    num_sampler_logprobs: int = 8
    token_budget: int | None = None
    tree_attention_kernel: str | None = None
    """"exact" (eager math, bitwise equal to `tandem serve --decode-mode exact`), "sdpa" or "flex" (GPU).
    None: flex on GPU, exact on CPU. tandem's own field, not in the spec."""

    # ---- the asynchronous pipeline ----
    max_concurrent_rollouts: int = 512
    max_staleness: int = 4
    weight_sync_steps: int = 1
    weight_sync_check_atol: float | None = None
    """After each sync, sample a short completion under the synced name and stop training if the server's log-probs
    differ from the trainer's forward by more than this (1e-5 holds in fp32 with exact decoding). None: no check.
    tandem's own field, not in the spec."""
    rollout_worker_timeout: float = 300.0
    reward_timeout: float | None = 600.0
    """Seconds one reward function may take on a group; a late or raising call is made once more, then the group is
    dropped (rollout/failed_count). None: no limit. tandem's own field."""
    stall_timeout: float | None = 3600.0
    """Seconds without a trainable sample before the run stops, saying why (groups dropped without reward variance
    and their rewards, stale and oversize drops, retried requests); it says so every minute before that. None: wait
    for ever (sparse rewards may legitimately take long). tandem's own field."""
    log_completions: bool = False
    num_completions_to_print: int | None = None

    def __post_init__(self):
        for item in dataclasses.fields(self):  # the type first: a value check on a wrong type would be a TypeError
            value = getattr(self, item.name)
            expected = type_problem(value, item.type)
            if expected:
                raise ValueError(f"AsyncGRPOConfig.{item.name}={value!r}: expected {expected}, got {type(value).__name__}.")
        checks = [
            ("num_generations", self.num_generations >= 2 or self.algorithm != "grpo",
             "GRPO needs at least 2 generations per prompt to compare them"),
            ("num_generations", self.num_generations == 1 or self.algorithm != "flash_reinforce",
             "FlashREINFORCE samples one rollout per prompt: set num_generations=1"),
            ("flash_delta", self.flash_delta >= 0, "the trust-region threshold must be >= 0 (inf admits everything)"),
            ("flash_negative_token_fraction", 0 <= self.flash_negative_token_fraction <= 1, "must be in [0, 1]"),
            ("max_completion_length", self.max_completion_length >= 1, "must be at least 1"),
            ("max_tool_calling_iterations", self.max_tool_calling_iterations is None or self.max_tool_calling_iterations >= 0,
             "must be >= 0, or None for no limit"),
            ("tool_call_timeout", self.tool_call_timeout > 0, "must be a positive number of seconds"),
            ("temperature", 0 < self.temperature <= 2, "must be in (0, 2]: RL needs sampling, not greedy decoding"),
            ("top_p", 0 < self.top_p <= 1, "must be in (0, 1]"),
            ("top_k", self.top_k >= 0, "must be 0 (off) or positive"),
            ("learning_rate", self.learning_rate >= 0, "must be >= 0"),
            ("gradient_accumulation_steps", self.gradient_accumulation_steps >= 1, "must be at least 1"),
            ("max_staleness", self.max_staleness >= 0, "must be >= 0"),
            ("weight_sync_steps", self.weight_sync_steps >= 1, "must be at least 1"),
            ("weight_sync_check_atol", self.weight_sync_check_atol is None or self.weight_sync_check_atol > 0,
             "must be a positive tolerance (e.g. 1e-5), or None to skip the check"),
            ("max_concurrent_rollouts", self.max_concurrent_rollouts >= 1, "must be at least 1"),
            ("reward_timeout", self.reward_timeout is None or self.reward_timeout > 0,
             "must be a positive number of seconds, or None for no limit"),
            ("stall_timeout", self.stall_timeout is None or self.stall_timeout > 0,
             "must be a positive number of seconds, or None to wait for ever"),
            ("vllm_importance_sampling_clip_min", 0 <= self.vllm_importance_sampling_clip_min <= 1,
             "must be in [0, 1] (a ratio of 1 must never be masked)"),
            ("vllm_importance_sampling_clip_max", self.vllm_importance_sampling_clip_max >= 1,
             "must be >= 1 (a ratio of 1 must never be masked)"),
            ("epsilon", self.epsilon >= 0, "must be >= 0"),
            ("logging_steps", self.logging_steps >= 1, "must be at least 1"),
            ("save_strategy", self.save_strategy in ("steps", "no"), "must be 'steps' or 'no'"),
            ("dtype", self.dtype in ("auto", "float32", "bfloat16", "float16"), "must be auto, float32, bfloat16 or float16"),
            ("algorithm", self.algorithm in ALGORITHMS, f"must be one of {ALGORITHMS}"),
            ("lr_scheduler_type", self.lr_scheduler_type in ("constant", "constant_with_warmup", "linear", "cosine"),
             "must be constant, constant_with_warmup, linear or cosine"),
            ("token_budget", self.token_budget is None or self.token_budget >= 2, "must be at least 2 tokens"),
            ("tree_attention_kernel", self.tree_attention_kernel in (None, "exact", "sdpa", "flex"),
             "must be 'exact', 'sdpa', 'flex' or None (the device's default)"),
        ]
        for name, ok, message in checks:
            if not ok:
                raise ValueError(f"AsyncGRPOConfig.{name}={getattr(self, name)!r}: {message}.")
        if self.lr_scheduler_type in ("linear", "cosine") and self.max_steps <= 0:
            raise ValueError(f"AsyncGRPOConfig.lr_scheduler_type={self.lr_scheduler_type!r} decays over max_steps, "
                             "but max_steps is not set: set max_steps, or use 'constant'.")
        if self.vllm_server_api_key is None:
            self.vllm_server_api_key = os.environ.get("VLLM_API_KEY") or None
        if isinstance(self.fsdp_config, str):  # transformers accepts a JSON string (or a file) here
            self.fsdp_config = json.loads(Path(self.fsdp_config).read_text() if Path(self.fsdp_config).is_file() else self.fsdp_config)
        reshard_after_forward(self.fsdp_config)
        if self.epsilon_high is None:
            self.epsilon_high = self.epsilon
        if self.min_p == 0:
            self.min_p = None

    @property
    def uses_truncated_sampling(self) -> bool:
        return self.top_k > 0 or self.top_p < 1 or self.min_p is not None

    def to_dict(self) -> dict[str, Any]:
        """Every field, the API key masked (this is what logs, sinks and dry runs show)."""
        values = dataclasses.asdict(self)
        if values["vllm_server_api_key"]:
            values["vllm_server_api_key"] = "***"
        return values


TYPE_WORDS = {int: "a whole number", float: "a number", bool: "true or false", str: "a string", dict: "a mapping",
              list: "a list", type(None): "null (None)"}


def type_problem(value: Any, annotation: Any) -> str | None:
    """None when `value` fits a field's annotation (any whole number is a number, numpy's included; a bool is
    neither; an annotation this check does not know refuses nothing); else what was expected, in words."""
    is_bool = type(value).__name__ in ("bool", "bool_")  # Python's and numpy's, without importing numpy
    for kind in kinds(annotation):
        if kind not in TYPE_WORDS or (kind is type(None) and value is None) or (kind is bool and is_bool):
            return None
        if is_bool:
            continue
        if (kind is int and isinstance(value, numbers.Integral)) or (kind is float and isinstance(value, numbers.Real)):
            return None
        if kind in (str, dict) and isinstance(value, kind) or kind is list and isinstance(value, (list, tuple)):
            return None
    return described(annotation)


def described(annotation: Any) -> str:
    """A field's type in words: `int | None` -> 'a whole number or null (None)'."""
    return " or ".join(TYPE_WORDS.get(kind, str(kind)) for kind in kinds(annotation))


def kinds(annotation: Any) -> list:
    """The plain types an annotation allows: `list[str] | None` -> [list, NoneType]."""
    options = typing.get_args(annotation) if isinstance(annotation, types.UnionType) else (annotation,)
    return [typing.get_origin(option) or option for option in options]


RESHARD_KEYS = ("reshard_after_forward", "fsdp_reshard_after_forward")


def reshard_after_forward(fsdp_config: dict | None) -> bool:
    """FSDP2's `reshard_after_forward` from the spec's `fsdp_config` (accelerate's `fsdp_` prefix accepted)."""
    config = dict(fsdp_config or {})
    values = [config.pop(key) for key in RESHARD_KEYS if key in config]
    if config:
        raise ValueError(f"AsyncGRPOConfig.fsdp_config keys {sorted(config)} are not supported: tandem shards with FSDP2 "
                         "and takes reshard_after_forward (true frees each layer's gathered weights after its forward; "
                         "false keeps them for the backward: more memory, no second all-gather).")
    if values and not isinstance(values[0], bool):
        raise ValueError(f"AsyncGRPOConfig.fsdp_config reshard_after_forward={values[0]!r}: expected true or false.")
    return values[0] if values else True


@dataclass
class Recipe:
    """A `tandem train` recipe: the config plus what the trainer is built from."""

    config: AsyncGRPOConfig
    model: str
    dataset: str | None
    """A built-in task or a local file; None only with an environment_factory that makes its own tasks."""
    reward_funcs: list[str] = field(default_factory=list)
    tools: list[str] = field(default_factory=list)
    """Import paths of tool functions."""
    environment_factory: str | dict[str, str] | None = None
    """The import path of an environment class (or factory), or a mapping of environment names to import paths."""
    lora: dict | None = None
    """peft.LoraConfig fields: train a LoRA adapter instead of the whole model."""
    resume_from_checkpoint: bool | str | None = None
    """true: the latest checkpoint in output_dir; a path: that checkpoint; passed to `train()`."""


RECIPE_KEYS = ("model", "dataset", "reward_funcs", "tools", "environment_factory", "lora", "resume_from_checkpoint")
RECIPE_TYPES = {"model": str, "dataset": str | None, "reward_funcs": str, "tools": str,
                "resume_from_checkpoint": bool | str | None}
"""The recipe keys beside the config's fields, by type (`environment_factory` and `lora` are checked by shape)."""
LISTS = ("reward_funcs", "tools")
"""Recipe keys that take one import path or a list of them."""


def _field_types() -> dict[str, Any]:
    return {f.name: f.type for f in dataclasses.fields(AsyncGRPOConfig)}


def parse_overrides(pairs: list[str]) -> dict[str, Any]:
    """`--field value` pairs from the command line; values are read as YAML (numbers, booleans, lists)."""
    result, i = {}, 0
    while i < len(pairs):
        key = pairs[i]
        if not key.startswith("--"):
            raise ValueError(f"expected --field value, got {key!r}")
        key = key[2:].replace("-", "_")
        if "=" in key:
            key, value = key.split("=", 1)
        else:
            if i + 1 >= len(pairs):
                raise ValueError(f"--{key} needs a value")
            i += 1
            value = pairs[i]
        result[key] = _coerce(key, yaml.safe_load(value))
        i += 1
    return result


def _coerce(key: str, value: Any) -> Any:
    """YAML reads `1e-3` as a string; a float field takes it as the number it means."""
    annotation = str(_field_types().get(key, ""))
    if isinstance(value, str) and "float" in annotation:
        try:
            return float(value)
        except ValueError:
            pass
    return value


def load_recipe(path: str | None, overrides: list[str] = ()) -> Recipe:
    """Read a YAML recipe and apply command-line overrides; unknown keys fail with the valid ones listed."""
    raw: dict[str, Any] = {}
    if path is not None:
        if not Path(path).is_file():
            raise FileNotFoundError(f"no such recipe file (looked for {Path(path).resolve()})")
        raw = yaml.safe_load(Path(path).read_text()) or {}
        if not isinstance(raw, dict):
            raise ValueError(f"{path}: a recipe is a YAML mapping of config fields, got {type(raw).__name__}")
    raw = {key: _coerce(key, value) for key, value in raw.items()}
    raw.update(parse_overrides(list(overrides)))
    known = set(_field_types()) | set(RECIPE_KEYS)
    unknown = sorted(set(raw) - known)
    if unknown:
        guesses = {key: difflib.get_close_matches(key, known, n=1) for key in unknown}
        named = "; ".join(f"{key!r}" + (f" (did you mean {guess[0]!r}?)" if guess else "") for key, guess in guesses.items())
        listing = "" if all(guesses.values()) else f". Valid keys: {', '.join(sorted(known))}"
        raise ValueError(f"unknown recipe key{'s' if len(unknown) > 1 else ''} {named}{listing}")
    for key in set(RECIPE_TYPES) & set(raw):
        values = raw[key] if key in LISTS and isinstance(raw[key], list) else [raw[key]]
        if any(type_problem(value, RECIPE_TYPES[key]) for value in values):
            many = " (or a list of them)" if key in LISTS else ""
            raise ValueError(f"{key}={raw[key]!r}: expected {described(RECIPE_TYPES[key])}{many}")
    if "model" not in raw:
        raise ValueError("the recipe has no 'model': give a model folder, a hub id, or 'tiny' for the built-in model")
    funcs, tools = raw.pop("reward_funcs", []), raw.pop("tools", [])
    environments = raw.pop("environment_factory", None)
    if environments is not None and not isinstance(environments, (str, dict)):
        raise ValueError(f"environment_factory: expected an import path (package.module:Class) or a mapping of names to "
                         f"import paths, got {environments!r}")
    lora = raw.pop("lora", None)
    if lora is not None and not isinstance(lora, dict):
        raise ValueError(f"lora: expected a mapping of peft.LoraConfig fields (r, lora_alpha, target_modules, ...), got {lora!r}")
    default_dataset = None if environments else "arithmetic"  # environments may make their own tasks
    return Recipe(model=raw.pop("model"), dataset=raw.pop("dataset", default_dataset), reward_funcs=_paths(funcs),
                  tools=_paths(tools), environment_factory=environments, lora=lora,
                  resume_from_checkpoint=raw.pop("resume_from_checkpoint", None), config=AsyncGRPOConfig(**raw))


def _paths(value) -> list[str]:
    """A recipe's list of import paths (a single path may be written without the list)."""
    return [value] if isinstance(value, str) else list(value)


def import_object(path: str):
    """`package.module:name` or `package.module.name` -> the object."""
    module_name, _, name = path.replace(":", ".").rpartition(".")
    if not module_name:
        raise ValueError(f"{path!r} is not an import path: write it as package.module:function")
    try:
        return getattr(importlib.import_module(module_name), name)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"cannot import {path!r}: {exc}") from exc

