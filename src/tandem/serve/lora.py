"""LoRA adapters served by name, as vLLM does: several live at once, mixed in one batch.

Names are registered by `/v1/load_lora_adapter`; their weights are loaded into one PEFT model
on demand and evicted least-recently-used beyond `max_cpu_loras` (reloaded from their path on the
next use). At most `max_loras` distinct adapters run in one batch; the engine defers the rest.

A load either succeeds whole or leaves the model as it was: the adapter's config and tensor headers
are checked against the served model before PEFT touches it (vLLM's refusals, with its messages),
and a load that still fails half-way (a truncated file, say) is undone, so the next batch, with or
without adapters, runs on the layers it ran on before.
"""

import collections
import json
from pathlib import Path

import torch
from peft import PeftModel
from peft.tuners.tuners_utils import BaseTunerLayer
from peft.utils import AuxiliaryTrainingWrapper
from safetensors import safe_open
from transformers.pytorch_utils import Conv1D

BASE = "__base__"
"""PEFT's name for "no adapter" in a mixed batch."""
UNSUPPORTED_FEATURES = {
    "use_dora": "vLLM does not yet support DoRA.",
    "lora_bias": "vLLM does not support LoRA bias (lora_bias).",
    "alora_invocation_tokens": "vLLM does not support Activated LoRA (aLoRA).",
    "layer_replication": "vLLM does not support layer_replication.",
    "use_bdlora": "vLLM does not support block-diagonal LoRA (BD-LoRA).",
    "use_qalora": "vLLM does not support QALoRA.",
}
"""Adapter-config features that change what the adapter computes and that vLLM (so tandem serve) refuses."""
PLAIN_INITS = ("gaussian", "eva", "orthogonal", "mica", "lora_ga")
"""`init_lora_weights` strings that only set the starting weights: the saved adapter is a plain LoRA."""
TENSOR_FILES = ("adapter_model.safetensors", "adapter_model.bin", "adapter_model.pt")


class AdapterNotFound(LookupError):
    """No adapter_config.json at the path: vLLM's 404."""


class AdapterLoaded(ValueError):
    """A name already registered, loaded again without `load_inplace`: vLLM's 400."""


def served_parameters(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The served model's parameters under their checkpoint names (a LoRA wrapper's `.base_layer` removed)."""
    base = model.get_base_model() if isinstance(model, PeftModel) else model
    return {name.replace(".base_layer", ""): p for name, p in base.named_parameters()}


def check_adapter(path: str, model: torch.nn.Module, max_lora_rank: int) -> None:
    """Check an adapter folder against the served model without loading it, in vLLM's order and with its messages:
    AdapterNotFound without adapter_config.json, ValueError for anything the load would fail on or serve wrongly."""
    config_file = Path(path) / "adapter_config.json"
    if not config_file.is_file():
        raise AdapterNotFound(f"No adapter found for {path}")
    try:
        config = json.loads(config_file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"adapter_config.json of {path} is not readable JSON: {exc}") from None
    if not isinstance(config, dict):
        raise ValueError(f"adapter_config.json of {path} is not a JSON object")
    check_config(config, max_lora_rank)
    tensor_file = next((Path(path) / f for f in TENSOR_FILES if (Path(path) / f).is_file()), None)
    if tensor_file is None:
        raise ValueError(f"{path} doesn't contain tensors")
    check_shapes(path, tensor_shapes(tensor_file), model, max_lora_rank)


def check_config(config: dict, max_lora_rank: int) -> None:
    """vLLM's checks of an adapter_config.json (its PEFTHelper): the required keys, a positive rank within
    `max_lora_rank`, no bias, no feature it does not implement."""
    missing = {"r", "lora_alpha", "target_modules"} - set(config)
    if missing:
        raise ValueError(f"Missing required configuration fields: {missing}")
    rank, patterns = config["r"], config.get("rank_pattern") or {}
    if not isinstance(rank, int) or isinstance(rank, bool) or rank <= 0:
        raise ValueError(f"LoRA rank `r` must be a positive integer, got {rank}.")
    for key, value in patterns.items():
        if not isinstance(value, int) or value <= 0:
            raise ValueError(f"LoRA rank for `{key}` in `rank_pattern` must be a positive integer, got {value}.")
    problems = []
    saved = [m for m in config.get("modules_to_save") or [] if m not in ("classifier", "score")]
    if saved:
        problems.append(
            'vLLM only supports modules_to_save being either None or ["classifier", "score"] for '
            f"classification models. Unsupported modules_to_save: {saved}"
        )
    problems += [message for key, message in UNSUPPORTED_FEATURES.items() if config.get(key)]
    init = config.get("init_lora_weights", True)
    if isinstance(init, str) and init.lower() not in PLAIN_INITS:
        problems.append(
            f"vLLM does not support init_lora_weights={init!r}. Inits such as PiSSA, OLoRA, CorDA and "
            "LoftQ modify the base model weights when PEFT loads the adapter."
        )
    largest = max([rank, *patterns.values()])
    if largest > max_lora_rank:
        problems.append(f"LoRA rank {largest} is greater than max_lora_rank {max_lora_rank}.")
    if config.get("bias", "none") != "none":
        problems.append("Adapter bias is not supported.")
    if problems:
        raise ValueError(" ".join(problems))


def tensor_shapes(tensor_file: Path) -> dict[str, tuple[int, ...]]:
    """Each tensor's name and shape: from the safetensors header alone, or a .bin/.pt file loaded whole."""
    try:
        if tensor_file.suffix == ".safetensors":
            with safe_open(str(tensor_file), framework="pt") as f:
                return {key: tuple(f.get_slice(key).get_shape()) for key in f.keys()}
        tensors = torch.load(tensor_file, map_location="cpu", weights_only=True)
        return {key: tuple(value.shape) for key, value in tensors.items()}
    except Exception as exc:  # noqa: BLE001 - whatever the reader says, the file is not one we can load
        raise ValueError(f"{tensor_file.name} of the adapter is not readable: {exc}") from None


def layer_features(module: torch.nn.Module) -> tuple[int, int] | None:
    """(in, out) of a layer LoRA adapts: a linear layer, transformers' Conv1D (GPT-2's, its weight stored [in, out])
    or an embedding (vocabulary, width); None for another kind, whose shapes PEFT itself checks."""
    if isinstance(module, BaseTunerLayer):
        module = module.get_base_layer()
    if isinstance(module, torch.nn.Linear):
        return module.in_features, module.out_features
    if isinstance(module, Conv1D):
        return tuple(module.weight.shape)
    if isinstance(module, torch.nn.Embedding):
        return module.num_embeddings, module.embedding_dim
    return None


def check_shapes(path: str, shapes: dict[str, tuple[int, ...]], model: torch.nn.Module, max_rank: int) -> None:
    """Every tensor is the A or B matrix of a layer the served model has, shaped for it: A is [rank, in], B is
    [out, rank] (an embedding's A is [rank, vocabulary], B [width, rank])."""
    base = model.get_base_model() if isinstance(model, PeftModel) else model
    unexpected = []
    for key, shape in shapes.items():
        module, _, kind = key.removeprefix("base_model.model.").rpartition(".lora_")
        try:
            layer = base.get_submodule(module) if module else None
        except AttributeError:
            layer = None
        if layer is None or len(shape) != 2:
            unexpected.append(key)
            continue
        if (features := layer_features(layer)) is None:
            continue
        inner, out = features
        first = kind.startswith(("A", "embedding_A"))
        rank = shape[0] if first else shape[1]
        expected = (rank, inner) if first else (out, rank)
        if tuple(shape) != expected or rank > max_rank:
            raise ValueError(
                f"LoRA tensor {key!r} of {path} has shape {tuple(shape)}, but the served model's "
                f"{module} needs {expected} with a rank of at most {max_rank}"
            )
    if unexpected:
        raise ValueError(
            f"While loading {path}, expected target modules in the served model's layers but "
            f"received {sorted(unexpected)}. Please verify that the loaded LoRA module is correct"
        )


def strip_adapter_layers(model: torch.nn.Module) -> None:
    """Undo a PEFT injection that failed before a PeftModel existed to undo it: every wrapped layer back to its own,
    and the config PEFT attached to the model gone."""
    for name, module in list(model.named_modules()):
        if isinstance(module, BaseTunerLayer):
            base = module.get_base_layer()
        elif isinstance(module, AuxiliaryTrainingWrapper):
            base = module.original_module
        else:
            continue
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent), child, base)
    if hasattr(model, "peft_config"):
        del model.peft_config


def drop_adapter(model: PeftModel, peft_name: str) -> None:
    """Remove an adapter wherever PEFT got to with it: its config and the layers it was injected into."""
    if peft_name in model.peft_config:
        model.delete_adapter(peft_name)
    for module in model.modules():
        if isinstance(module, BaseTunerLayer) and any(
            peft_name in getattr(module, layer, {}) for layer in module.adapter_layer_names
        ):
            module.delete_adapter(peft_name)


def load_into(model: torch.nn.Module, path: str, peft_name: str) -> torch.nn.Module:
    """Load one adapter into `model` (wrapping it in PEFT the first time); on any failure `model` is left as it was."""
    if isinstance(model, PeftModel):
        try:
            model.load_adapter(path, adapter_name=peft_name, is_trainable=False)
        except BaseException:
            drop_adapter(model, peft_name)
            raise
        return model.eval()
    try:
        return PeftModel.from_pretrained(model, path, adapter_name=peft_name, is_trainable=False).eval()
    except BaseException:
        strip_adapter_layers(model)
        raise


class AdapterSet:
    def __init__(self, max_loras: int = 1, max_lora_rank: int = 16, max_cpu_loras: int | None = None):
        self.max_loras = max_loras
        self.max_lora_rank = max_lora_rank
        self.max_cpu_loras = max(max_cpu_loras or max_loras, max_loras)
        self.paths: dict[str, str] = {}
        self.int_ids: dict[str, int] = {}
        self.loaded: collections.OrderedDict[str, str] = collections.OrderedDict()  # name -> PEFT name, LRU order
        self._next_id = 1
        self._stale: list[str] = []

    def add(
        self, model: torch.nn.Module, name: str, path: str, in_use: set[str], replace: bool = False
    ) -> torch.nn.Module:
        """Check, load and register an adapter under `name` (replacing the weights the name had, when `replace`);
        returns the model. Raises AdapterLoaded, AdapterNotFound or ValueError, or PEFT's error, with nothing changed."""
        if name in self.paths and not replace:
            raise AdapterLoaded(
                f"The lora adapter '{name}' has already been loaded. If you want to load the adapter "
                "in place, set 'load_inplace' to True."
            )
        check_adapter(path, model, self.max_lora_rank)
        int_id = self._next_id
        model = load_into(model, path, f"lora{int_id}")
        self._next_id += 1
        if name in self.loaded:  # re-registered under a new path: its old weights must not be served
            self._stale.append(self.loaded.pop(name))
        self.paths[name], self.int_ids[name] = path, int_id
        self.loaded[name] = f"lora{int_id}"
        return self._evict(model, in_use | {name})

    def unregister(self, name: str) -> None:
        """Forget the name (its weights stay cached until evicted, as in vLLM)."""
        del self.paths[name]

    def can_join(self, active: set[str], name: str) -> bool:
        return len(active | {name}) <= self.max_loras

    @property
    def active(self) -> bool:
        return bool(self.loaded)

    def ensure_loaded(self, model: torch.nn.Module, names: set[str], in_use: set[str]) -> torch.nn.Module:
        """Load every adapter in `names` into `model` again from its path (evicted ones); returns the model."""
        try:
            for name in sorted(names - set(self.loaded)):
                if name not in self.paths:
                    raise AdapterNotFound(f"the adapter {name!r} was unloaded before this request ran")
                check_adapter(self.paths[name], model, self.max_lora_rank)
                model = load_into(model, self.paths[name], f"lora{self.int_ids[name]}")
                self.loaded[name] = f"lora{self.int_ids[name]}"
        finally:  # the ones loaded stay, within max_cpu_loras, should a later one fail
            for name in names & set(self.loaded):
                self.loaded.move_to_end(name)
            model = self._evict(model, in_use | names)
        return model

    def _evict(self, model: torch.nn.Module, keep: set[str]) -> torch.nn.Module:
        """Drop the least recently used adapters beyond `max_cpu_loras` (never one in `keep`), and the weights a
        re-registration replaced once another adapter is loaded (PEFT needs one left to be active)."""
        while len(self.loaded) > self.max_cpu_loras:
            victim = next((n for n in self.loaded if n not in keep), None)
            if victim is None:
                break
            assert isinstance(model, PeftModel), "a model with adapters loaded is a PEFT model"
            model.delete_adapter(self.loaded.pop(victim))
        while self._stale and isinstance(model, PeftModel) and len(model.peft_config) > 1:
            model.delete_adapter(self._stale.pop())
        return model

    def names_for(self, adapters: list[str | None]) -> list[str]:
        """PEFT adapter names for a batch, one per row."""
        return [self.loaded[a] if a else BASE for a in adapters]
