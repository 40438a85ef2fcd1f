"""What a model's architecture asks of the code that runs it, read the same way by the trainer and `tandem serve`.

Three facts decide how a model is packed, decoded and loaded:
  * layers that read across tokens outside attention (gated DeltaNet, Mamba, convolutions): a packed row would let
    them read other samples, and their state is no key/value a slot cache or a prefix cache can hold;
  * attention beyond softmax(QK^T)V (sinks, soft-capped scores), which tandem's exact and tree kernels do not compute;
  * a vision-language checkpoint, which loads through its own auto class and trains and serves text only.
"""

from collections.abc import Callable
from typing import TypeVar, cast

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText, PreTrainedModel

ATTENTION_LAYERS = ("full_attention", "sliding_attention")
SCANNING_MODULES = ("mamba", "rwkv", "shortconv", "deltanet", "recurrent", "xlstm", "linearattention")
"""Module class names that give away layers reading across tokens outside attention."""
Mask = TypeVar("Mask")
HUB_KWARGS = ("revision", "trust_remote_code", "token", "cache_dir", "local_files_only", "subfolder")
"""The from_pretrained arguments that also decide which config is read."""


def transformers_model(model: torch.nn.Module) -> PreTrainedModel:
    """`model` as the transformers model it is (a PEFT wrapper passes its base model's attributes through): torch types
    any other attribute of a module as a tensor or a module, this gives the config and methods transformers adds."""
    return cast(PreTrainedModel, model)


def without_hub_kernels(model: torch.nn.Module) -> torch.nn.Module:
    """`model` on transformers' own PyTorch layers. transformers 5.25 turns hub kernels on in from_pretrained, and every
    train() or eval() then swaps layers' forwards again, which dropped tandem's tree path of Gated DeltaNet layers (a
    crash at the first step); a kernel on one side only would also make the trainer and the server round apart."""
    if getattr(model, "use_kernels", False):
        transformers_model(model).use_kernels = False
    return model


def scanning_layers(model: torch.nn.Module) -> list[str]:
    """The layer types and module classes of `model` that read across tokens outside attention (none: pure attention)."""
    layer_types = getattr(transformers_model(model).config.get_text_config(), "layer_types", None) or []
    found = [t for t in layer_types if t not in ATTENTION_LAYERS]
    found += [type(m).__name__ for m in model.modules() if any(w in type(m).__name__.lower() for w in SCANNING_MODULES)]
    return list(dict.fromkeys(found))


def attention_extras(model: torch.nn.Module) -> list[str]:
    """What `model`'s attention computes beyond softmax(QK^T)V: sinks, soft-capped scores (none: plain attention)."""
    extras = ["attention sinks"] if any(name.endswith("sinks") for name, _ in model.named_parameters()) else []
    if getattr(transformers_model(model).config.get_text_config(), "attn_logit_softcapping", None):
        extras.append("soft-capped attention scores (attn_logit_softcapping)")
    return extras


def layer_masks(config, build: Callable[[str, int | None], Mask]) -> Mask | dict[str, Mask]:
    """The attention mask in the form the model's forward takes, `build(layer_type, sliding_window)` making each one.

    transformers hands a ready 4D mask to every layer as it is, and only models whose config lists `layer_types` read
    a dict keyed by layer type. So one mask goes in wherever the layers attend alike: a config without `layer_types`
    windows every layer by its `sliding_window` when it sets one (Mistral, Mixtral, Phi-3, Qwen3-MoE), and a dict only
    where layer types differ (Gemma 2's alternating sliding and full layers, a hybrid's linear-attention layers)."""
    text = config.get_text_config()
    window = getattr(text, "sliding_window", None) or None  # Qwen2-MoE writes 0 for no window
    layer_types = getattr(text, "layer_types", None)
    if not layer_types:
        return build("full_attention" if window is None else "sliding_attention", window)
    windows = {t: window if t == "sliding_attention" else None for t in dict.fromkeys(layer_types)}
    kinds = {(t if t not in ATTENTION_LAYERS else "attention", w) for t, w in windows.items()}
    if len(kinds) == 1:
        layer_type, window = next(iter(windows.items()))
        return build(layer_type, window)
    return {t: build(t, w) for t, w in windows.items()}


def is_vision_language(config) -> bool:
    """Whether a checkpoint's config describes a vision-language model (a vision tower beside its language model)."""
    return getattr(config, "vision_config", None) is not None


def auto_class(name: str, **kwargs) -> type[AutoModelForCausalLM] | type[AutoModelForImageTextToText]:
    """The auto class checkpoint `name` loads through: a vision-language model's own, else the causal LM's."""
    config = AutoConfig.from_pretrained(name, **{k: v for k, v in kwargs.items() if k in HUB_KWARGS})
    return AutoModelForImageTextToText if is_vision_language(config) else AutoModelForCausalLM


def from_pretrained(name: str, **kwargs) -> PreTrainedModel:
    """Checkpoint `name` loaded through its auto class (`auto_class`), with `from_pretrained`'s keyword arguments."""
    return transformers_model(auto_class(name, **kwargs).from_pretrained(name, **kwargs))
