"""The policy the trainer trains: loaded from a path, a hub id, "tiny" or an object (a vision-language checkpoint
trains its language model, text only), given its row layout (tree packing, or padded rows for models a tree row
would change), optionally wrapped with a trainable LoRA adapter."""

import inspect
import warnings
from typing import cast

import torch
from peft import get_peft_model
from peft.tuners.lora.layer import ParamWrapper
from transformers import PreTrainedModel
from transformers.debug_utils import DebugUnderflowOverflow

from tandem.chat.prompts import check_conversational
from tandem.config import AsyncGRPOConfig, mapping
from tandem.dataset_rows import columns_of, first_rows, is_iterable
from tandem.errors import UsageError
from tandem.kernels import onednn_linear
from tandem.model import architecture, distributed
from tandem.packing import PADDED, tree_attention
from tandem.packing.log_probs import check_head
from tandem.tasks import TINY_MODEL_PATH

IMAGE_PARTS = ("image", "image_url", "input_image")
"""Content-part types that carry an image (transformers' and OpenAI's chat formats)."""
TEXT_ONLY = (
    "tandem trains vision-language models on text only: images reach neither the server nor the forward "
    "(the vision tower stays frozen)."
)


def load_policy(model, args: AsyncGRPOConfig, peft_config, processing_class, ranks: distributed.Ranks):
    """The policy to train and its tokenizer: (the name the server knows it by, the model with its LoRA adapter when
    `peft_config` is given, sharded over the torchrun ranks, its row layout, the tokenizer)."""
    name, loaded, layout = load_model(model, args)
    policy = with_adapter(loaded, peft_config) if peft_config is not None else loaded
    if ranks.several:
        distributed.shard(policy, ranks, mapping(args.fsdp_config), use_bf16(args, next(policy.parameters()).device))
    tokenizer = processing_class_for(
        processing_class, name if isinstance(model, str) else model.name_or_path, args.trust_remote_code
    )
    return name, policy, layout, tokenizer


def load_model(model, args: AsyncGRPOConfig) -> tuple[str, PreTrainedModel, str]:
    """(the name the server knows it by, the model ready to train, its row layout)."""
    if isinstance(model, str):
        name = TINY_MODEL_PATH if model == "tiny" else model
        kwargs = {
            "dtype": args.dtype,
            "trust_remote_code": args.trust_remote_code,
            **(mapping(args.model_init_kwargs) or {}),
        }
        loaded = architecture.from_pretrained(name, **kwargs)
        if torch.cuda.is_available() and not args.use_cpu:
            cast(torch.nn.Module, loaded).to("cuda")  # transformers' decorated `to` reads as unbound to a type checker
    elif isinstance(model, PreTrainedModel):
        name, loaded = model.name_or_path or "tandem-policy", model
    else:
        raise TypeError(f"model must be a path, a hub id, 'tiny' or a PreTrainedModel, not {type(model).__name__}")
    architecture.without_hub_kernels(loaded)
    freeze_vision(loaded)
    if loaded.device.type == "cpu" and autocast_dtype(args, loaded.device) is None:  # before any adapter wraps a layer
        onednn_linear.install(loaded, exact=True, reorder=False)  # as exact decoding computes: log-probs bit for bit
    layout = tree_attention.prepare(loaded)
    if layout == PADDED:
        warnings.warn(
            f"{type(loaded).__name__} cannot be tree-packed ({'; '.join(tree_attention.padded_reasons(loaded))}): "
            "it trains on padded rows, one sequence per sample. A prompt shared by a group is computed once "
            "per rollout instead of once per row, and each row's samples are padded to its longest (the "
            "token budget counts the padding; batch/packing_ratio below 1 is what it costs).",
            stacklevel=4,
        )
    check_head(loaded)
    warn_dropout(loaded)
    return name, loaded, layout


UNUSED_DROPOUT = ("classifier_dropout", "summary_first_dropout")
"""Rates of heads a causal language model does not run (GPT-NeoX's and GPT-2's configs set them to 0.1)."""


def warn_dropout(model: PreTrainedModel) -> None:
    """A warning when the model drops units in training: its forward is then not the policy the server samples from
    (GPT-2's default 0.1 kept a random 2-layer model's importance ratio at 1.02-1.17 at staleness 0, not 1)."""
    rates = {
        name: value
        for name, value in model.config.get_text_config().to_dict().items()
        if ("dropout" in name or name.endswith("pdrop"))
        and name not in UNUSED_DROPOUT
        and isinstance(value, (int, float))
        and not isinstance(value, bool)
        and value > 0
    }
    if rates:
        settings = ", ".join(f"{name}={value:g}" for name, value in sorted(rates.items()))
        warnings.warn(
            f"the model's config drops units in training ({settings}), which the server's sampling does not: "
            "the trainer's log-probs are then not the sampler's policy, and the importance ratio drifts from 1 "
            f"even at staleness 0. Load it with them at 0 (model_init_kwargs: {{{', '.join(f'{n}: 0.0' for n in sorted(rates))}}}).",
            stacklevel=5,
        )


def freeze_vision(model: PreTrainedModel) -> None:
    """A vision-language model trains its language model and head only: the rest (vision tower, projector) is frozen,
    so it gets no gradients or optimizer state and no weight sync sends it (the server keeps the checkpoint's)."""
    if not architecture.is_vision_language(model.config):
        return
    trained = {id(p) for part in (model.get_decoder(), model.get_output_embeddings()) for p in part.parameters()}
    for param in model.parameters():
        if id(param) not in trained:
            param.requires_grad_(False)


def with_adapter(model: PreTrainedModel, peft_config):
    """The model with a trainable LoRA adapter; the head stays untouched (the chunked log-prob head and the
    server's adapters both leave lm_head to the base weights)."""
    targets = peft_config.target_modules or []
    targets = [targets] if isinstance(targets, str) else list(targets)
    if any(t == "lm_head" or t.endswith(".lm_head") for t in targets) or "lm_head" in (
        peft_config.modules_to_save or []
    ):
        raise UsageError(
            "peft_config targets lm_head: tandem trains adapters on the transformer layers only (the "
            "chunked log-prob head reads the base head). Remove lm_head from target_modules / modules_to_save."
        )
    try:
        wrapped = get_peft_model(model, peft_config)
    except ValueError as exc:  # peft's refusal: target modules the model does not have
        raise UsageError(f"peft_config: {exc}") from None
    fused = sorted(
        {
            ".".join(name.split(".")[-2:])
            for name, module in wrapped.named_modules()
            if isinstance(module, ParamWrapper) and not name.endswith(".base_layer")
        }
    )
    if fused:
        raise NotImplementedError(
            f"peft_config (target_modules={targets!r}, target_parameters={getattr(peft_config, 'target_parameters', None)!r}) "
            f"puts LoRA on an MoE's parameter-wrapped weights, its experts or router ({', '.join(fused)}), and tandem does "
            "not sync such an adapter to a generation server yet. Target the attention projections "
            "(target_modules=['q_proj', 'k_proj', 'v_proj', 'o_proj']), or train full weights."
        )
    return wrapped


def instrument(model, args: AsyncGRPOConfig, several_ranks: bool) -> None:
    """torch_compile, and debug="underflow_overflow" (hooks on every module: an inf or NaN stops the step, with
    transformers' report of the frames before it)."""
    if args.torch_compile:
        compile_decoder(model, args, several_ranks)
    if "underflow_overflow" in args.debug_options:
        DebugUnderflowOverflow(model)


def compile_decoder(model, args: AsyncGRPOConfig, several_ranks: bool) -> None:
    """torch_compile: the decoder compiled in place with dynamic shapes, so rows of any length share one graph. The
    chunked log-prob head stays eager (it is chunked to bound its memory, which a fused graph could undo)."""
    if several_ranks:
        raise UsageError(
            "torch_compile=True under torchrun: compiling FSDP2-sharded layers has not been run here; train "
            "uncompiled (the default) or on one process"
        )
    model.get_decoder().compile(
        backend=args.torch_compile_backend or "inductor", mode=args.torch_compile_mode, dynamic=True
    )
    if (args.tree_attention_kernel or "exact") == "exact" and model.device.type == "cpu":
        warnings.warn(
            "torch_compile: the compiled decoder's fused kernels round differently from the exact kernel, so "
            "the trainer no longer matches `tandem serve --decode-mode exact` bit for bit (the importance "
            "ratio at staleness 0 is 1 to about 1e-5)",
            stacklevel=4,
        )


def enable_checkpointing(model, kwargs: dict) -> None:
    """Activation (gradient) checkpointing with `kwargs` for torch.utils.checkpoint; transformers renamed the method in
    5.x and deprecated the old name."""
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def served_dtype(model) -> str:
    """The `--dtype` the embedded server needs to sample from exactly these weights."""
    return {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}[
        next(model.parameters()).dtype
    ]


def processing_class_for(given, model_name: str, trust_remote_code: bool):
    """The processing class `given`, or the model's own tokenizer, under TRL's rules (`prepare_processing_class`)."""
    from transformers import AutoTokenizer

    tokenizer = given or AutoTokenizer.from_pretrained(model_name, trust_remote_code=trust_remote_code)
    return prepare_processing_class(tokenizer, given=given is not None)


def prepare_processing_class(tokenizer, given: bool):
    """TRL's rules for the processing class: left padding (said when a `given` one pads on the right), and
    `pad_token` falling back to `eos_token`. tandem pads nothing with it; reward functions and callbacks that batch
    with it get what TRL promises them."""
    text = getattr(tokenizer, "tokenizer", tokenizer)  # a processor's tokenizer
    if given and getattr(text, "padding_side", "left") != "left":
        warnings.warn(
            f"processing_class.padding_side={text.padding_side!r}: set to 'left', as the trainer requires", stacklevel=5
        )
    text.padding_side = "left"
    if text.pad_token is None:
        if text.eos_token is None:
            raise UsageError(
                "processing_class has neither a pad_token nor an eos_token to stand in for it: set "
                "tokenizer.pad_token before passing it"
            )
        text.pad_token = text.eos_token
    return tokenizer


def eos_ids(tokenizer, model) -> list[int]:
    """Every token that ends a completion: the tokenizer's EOS and the model's generation_config ones."""
    ids = {tokenizer.eos_token_id}
    generation_eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    ids |= set(generation_eos if isinstance(generation_eos, list) else [generation_eos])
    return sorted(i for i in ids if i is not None)


def use_bf16(args: AsyncGRPOConfig, device: torch.device) -> bool:
    return not args.fp16 and (args.bf16 if args.bf16 is not None else device.type == "cuda")


def autocast_dtype(args: AsyncGRPOConfig, device: torch.device) -> torch.dtype | None:
    """The dtype the trainer's forward autocasts to: float16 (fp16), bfloat16 (bf16), or None (the weights' own)."""
    if args.fp16:
        return torch.float16
    return torch.bfloat16 if use_bf16(args, device) else None


def check_precision(args: AsyncGRPOConfig, device: torch.device, several_ranks: bool, weights: torch.dtype):
    """Apply tf32 and return fp16's gradient scaler (None without fp16), refusing what the device cannot do."""
    if args.tf32 is not None:
        if device.type != "cuda" and args.tf32:
            raise UsageError(
                "AsyncGRPOConfig.tf32=True needs an Ampere or newer NVIDIA GPU: TensorFloat-32 is a mode of "
                "its matmul units, and this run trains on the CPU. Leave tf32 unset."
            )
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = args.tf32
    if not args.fp16:
        return None
    if device.type != "cuda":
        raise UsageError(
            "AsyncGRPOConfig.fp16=True needs a GPU: on the CPU float16 autocast is slower than float32 and "
            "loses precision for nothing. Train in float32 (the CPU default), or bf16=True."
        )
    if several_ranks:
        raise UsageError(
            "AsyncGRPOConfig.fp16=True is not supported under torchrun (FSDP2 would need a sharded gradient "
            "scaler): use bf16=True."
        )
    if weights == torch.float16:
        raise UsageError(
            "AsyncGRPOConfig.fp16=True keeps float32 master weights and scales float16 gradients: load the "
            "model with dtype='float32', not 'float16'."
        )
    return torch.amp.GradScaler("cuda")


def check_dataset(dataset, *, environments: bool = False, max_steps: int = -1):
    """The dataset, if every row can be trained on: a conversational 'prompt' column, at least one row. With
    environments the prompt may come from reset() instead, and with no dataset at all (environments that sample
    their own tasks) max_steps sets the run's length, as it does for an IterableDataset (no length, no epochs to
    count); its first rows are checked."""
    if dataset is None:
        if not environments:
            raise UsageError(
                "train_dataset is required (only an environment_factory whose reset() makes the prompt "
                "can train without one)"
            )
        if max_steps <= 0:
            raise UsageError(
                "without a train_dataset the environment makes every task, so nothing ends the run: set "
                "max_steps (e.g. AsyncGRPOConfig(max_steps=1000))"
            )
        return None
    if is_iterable(dataset) and max_steps <= 0:
        raise UsageError(
            "train_dataset is an IterableDataset, which has no length: set max_steps (each pass over it is "
            "an epoch; it is read again from its start when it ends)"
        )
    rows = first_rows(dataset, 8)
    if not rows:
        raise UsageError("train_dataset is empty")
    columns = columns_of(dataset)
    if "prompt" not in columns:
        if environments:
            return dataset
        raise UsageError(
            f"train_dataset has no 'prompt' column (columns: {columns}). Each row needs a conversational "
            "prompt: [{'role': 'user', 'content': '...'}]"
        )
    for index, row in enumerate(rows):  # the first rows now; every row before the first step (check_prompt_lengths)
        check_conversational(row["prompt"], f"train_dataset row {index}")
    check_no_images(
        columns, (row["prompt"] for row in (rows if is_iterable(dataset) else dataset))
    )  # a stream: its start
    return dataset


def drop_unused_columns(dataset, reward_funcs: list, environments: bool):
    """remove_unused_columns=True: the dataset with only 'prompt' and the columns a reward function names as a
    parameter (a reward's **kwargs gets only those); no dataset (the environments make the prompts): None."""
    if dataset is None:
        return None
    if environments:
        raise UsageError(
            "AsyncGRPOConfig.remove_unused_columns=True cannot be used with environments (environment_factory, "
            "an OpenEnv harness, a verifiers environment): their rollouts read every column of their row. "
            "Leave it False."
        )
    named = {
        name
        for func in reward_funcs
        for name, parameter in inspect.signature(func).parameters.items()
        if parameter.kind in (parameter.POSITIONAL_OR_KEYWORD, parameter.KEYWORD_ONLY)
    }
    unused = [column for column in columns_of(dataset) if column != "prompt" and column not in named]
    if is_iterable(dataset) and not hasattr(dataset, "remove_columns"):
        raise UsageError(
            f"AsyncGRPOConfig.remove_unused_columns=True: this stream ({type(dataset).__name__}) cannot drop "
            "columns as it goes; use a datasets.IterableDataset, or leave it False."
        )
    if hasattr(dataset, "remove_columns"):
        return dataset.remove_columns(unused)
    return [{key: value for key, value in row.items() if key not in unused} for row in dataset]


def check_no_images(columns: list[str], prompts) -> None:
    """Refuse image inputs, an image column or image content parts in a prompt, naming the fix."""
    for column in ("images", "image"):
        if column in columns:
            raise UsageError(
                f"train_dataset has an {column!r} column: {TEXT_ONLY} Drop it "
                f"(dataset.remove_columns({column!r})) and keep text-only prompts."
            )
    for index, prompt in enumerate(prompts):
        for message in prompt if isinstance(prompt, list) else []:
            content = message.get("content") if isinstance(message, dict) else None
            kinds = (
                [part.get("type") for part in content if isinstance(part, dict)] if isinstance(content, list) else []
            )
            if any(kind in IMAGE_PARTS for kind in kinds):
                raise UsageError(
                    f"train_dataset row {index}: a {message.get('role')!r} message has an image content "
                    f"part: {TEXT_ONLY} Keep its text parts only, e.g. "
                    "{'role': 'user', 'content': 'the question'}."
                )
