"""The policy the trainer trains: loaded from a path, a hub id, "tiny" or an object (a vision-language checkpoint
trains its language model, text only), given its row layout (tree packing, or padded rows for models a tree row
would change), optionally wrapped with a trainable LoRA adapter."""

import warnings

import torch
from peft import get_peft_model
from transformers import PreTrainedModel

from tandem import architecture
from tandem.config import AsyncGRPOConfig
from tandem.packing import PADDED
from tandem.packing import attention as tree_attention
from tandem.packing.logprobs import check_head
from tandem.tasks import TINY_MODEL_PATH

IMAGE_PARTS = ("image", "image_url", "input_image")
"""Content-part types that carry an image (transformers' and OpenAI's chat formats)."""
TEXT_ONLY = ("tandem trains vision-language models on text only: images reach neither the server nor the forward "
             "(the vision tower stays frozen).")


def load_model(model, args: AsyncGRPOConfig) -> tuple[str, PreTrainedModel, str]:
    """(the name the server knows it by, the model ready to train, its row layout)."""
    if isinstance(model, str):
        name = TINY_MODEL_PATH if model == "tiny" else model
        kwargs = {"dtype": args.dtype, **(args.model_init_kwargs or {})}
        loaded = architecture.auto_class(name, **kwargs).from_pretrained(name, **kwargs)
        if torch.cuda.is_available():
            loaded.to("cuda")
    elif isinstance(model, PreTrainedModel):
        name, loaded = model.name_or_path or "tandem-policy", model
    else:
        raise TypeError(f"model must be a path, a hub id, 'tiny' or a PreTrainedModel, not {type(model).__name__}")
    freeze_vision(loaded)
    layout = tree_attention.prepare(loaded)
    if layout == PADDED:
        warnings.warn(f"{type(loaded).__name__} cannot be tree-packed ({'; '.join(tree_attention.padded_reasons(loaded))}): "
                      "it trains on padded rows, one sequence per sample. A prompt shared by a group is computed once "
                      "per rollout instead of once per row, and each row's samples are padded to its longest (the "
                      "token budget counts the padding; batch/packing_ratio below 1 is what it costs).", stacklevel=3)
    check_head(loaded)
    return name, loaded, layout


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
    if any(t == "lm_head" or t.endswith(".lm_head") for t in targets) or "lm_head" in (peft_config.modules_to_save or []):
        raise ValueError("peft_config targets lm_head: tandem trains adapters on the transformer layers only (the "
                         "chunked log-prob head reads the base head). Remove lm_head from target_modules / modules_to_save.")
    return get_peft_model(model, peft_config)


def served_dtype(model) -> str:
    """The `--dtype` the embedded server needs to sample from exactly these weights."""
    return {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}[next(model.parameters()).dtype]


def eos_ids(tokenizer, model) -> list[int]:
    """Every token that ends a completion: the tokenizer's EOS and the model's generation_config ones."""
    ids = {tokenizer.eos_token_id}
    generation_eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    ids |= set(generation_eos if isinstance(generation_eos, list) else [generation_eos])
    return sorted(i for i in ids if i is not None)


def use_bf16(args: AsyncGRPOConfig, device: torch.device) -> bool:
    return args.bf16 if args.bf16 is not None else device.type == "cuda"


def check_dataset(dataset, *, environments: bool = False, max_steps: int = -1):
    """The dataset, if every row can be trained on: a conversational 'prompt' column, at least one row. With
    environments the prompt may come from reset() instead, and with no dataset at all (environments that sample
    their own tasks) max_steps sets the run's length."""
    if dataset is None:
        if not environments:
            raise ValueError("train_dataset is required (only an environment_factory whose reset() makes the prompt "
                             "can train without one)")
        if max_steps <= 0:
            raise ValueError("without a train_dataset the environment makes every task, so nothing ends the run: set "
                             "max_steps (e.g. AsyncGRPOConfig(max_steps=1000))")
        return None
    columns = getattr(dataset, "column_names", None) or (list(dataset[0]) if len(dataset) else [])
    if len(dataset) == 0:
        raise ValueError("train_dataset is empty")
    if "prompt" not in columns:
        if environments:
            return dataset
        raise ValueError(f"train_dataset has no 'prompt' column (columns: {columns}). Each row needs a conversational "
                         "prompt: [{'role': 'user', 'content': '...'}]")
    for index in range(min(len(dataset), 8)):
        prompt = dataset[index]["prompt"]
        if not (isinstance(prompt, list) and prompt and all(isinstance(m, dict) and "role" in m and "content" in m for m in prompt)):
            raise ValueError(f"train_dataset row {index}: 'prompt' must be conversational, a list of "
                             f"{{'role': ..., 'content': ...}} messages; got {type(prompt).__name__} {str(prompt)[:80]!r}. "
                             "Wrap plain text as [{'role': 'user', 'content': text}].")
    check_no_images(columns, (row["prompt"] for row in dataset))
    return dataset


def check_no_images(columns: list[str], prompts) -> None:
    """Refuse image inputs, an image column or image content parts in a prompt, naming the fix."""
    for column in ("images", "image"):
        if column in columns:
            raise ValueError(f"train_dataset has an {column!r} column: {TEXT_ONLY} Drop it "
                             f"(dataset.remove_columns({column!r})) and keep text-only prompts.")
    for index, prompt in enumerate(prompts):
        for message in prompt if isinstance(prompt, list) else []:
            content = message.get("content") if isinstance(message, dict) else None
            kinds = [part.get("type") for part in content if isinstance(part, dict)] if isinstance(content, list) else []
            if any(kind in IMAGE_PARTS for kind in kinds):
                raise ValueError(f"train_dataset row {index}: a {message.get('role')!r} message has an image content "
                                 f"part: {TEXT_ONLY} Keep its text parts only, e.g. "
                                 "{'role': 'user', 'content': 'the question'}.")
