"""`tandem train`'s YAML recipes: config fields plus `model`, `dataset`, `reward_funcs`, `tools` and
`environment_factory` (import paths) and `lora`. `load_recipe` reads a file or a built-in recipe by name, TRL's keys
as tandem's (`trl_names`), and fails on an unknown key with the nearest names; `import_object` resolves an import
path from the current directory too.
"""

import dataclasses
import difflib
import importlib
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from tandem import trl_names
from tandem.config import AsyncGRPOConfig
from tandem.config_checks import described, type_problem
from tandem.errors import UsageError

RECIPES = Path(__file__).with_name("recipes")
"""The built-in recipes, by name: `tandem train demo` is recipes/demo.yaml."""
FIELD_REFERENCE = "docs/references/config.md (every field), docs/migrating-from-trl.md (TRL's names)"
"""Where a user finds every key a recipe takes."""


@dataclass
class Recipe:
    """A `tandem train` recipe: the config plus what the trainer is built from."""

    config: AsyncGRPOConfig
    model: str
    dataset: str | None
    """A built-in task, a local file or folder, a Hub id, `reasoning-gym:<task>` or `verifiers:<taskset id>`; None
    only with an environment_factory that makes its own tasks."""
    reward_funcs: list[str] = field(default_factory=list)
    dataset_config: str | None = None
    """The Hub dataset's configuration (subset)."""
    dataset_split: str = "train"
    dataset_streaming: bool = False
    """Read the dataset as training goes (an IterableDataset: never downloaded whole; max_steps sets the length)."""
    dataset_options: dict | None = None
    """A reasoning-gym task's arguments (size, seed, its config; a composite's datasets), for `reasoning-gym:<task>`."""
    eval_dataset_options: dict | None = None
    """The same for a reasoning-gym eval_dataset (give it another seed than the training rows')."""
    eval_dataset: str | None = None
    """Prompts evaluated during training (eval_strategy): any of what `dataset` takes, with `dataset_config`."""
    eval_split: str = "test"
    """The split of a Hub or folder eval_dataset."""
    tools: list[str] = field(default_factory=list)
    """Import paths of tool functions."""
    environment_factory: str | dict[str, str] | None = None
    """The import path of an environment class (or factory), or a mapping of environment names to import paths."""
    lora: dict | None = None
    """peft.LoraConfig fields: train a LoRA adapter instead of the whole model."""
    notes: list[str] = field(default_factory=list)
    """How the recipe's TRL keys were read (one line each), for the command line to print."""


RECIPE_KEYS = (
    "model",
    "dataset",
    "dataset_config",
    "dataset_split",
    "dataset_streaming",
    "dataset_options",
    "eval_dataset",
    "eval_dataset_options",
    "eval_split",
    "reward_funcs",
    "tools",
    "environment_factory",
    "lora",
)
RECIPE_TYPES = {
    "model": str,
    "dataset": str | None,
    "dataset_config": str | None,
    "dataset_split": str,
    "dataset_streaming": bool,
    "dataset_options": dict | None,
    "eval_dataset": str | None,
    "eval_dataset_options": dict | None,
    "eval_split": str,
    "reward_funcs": str,
    "tools": str,
}
"""The recipe keys beside the config's fields, by type (`environment_factory` and `lora` are checked by shape)."""
LISTS = ("reward_funcs", "tools")
"""Recipe keys that take one import path or a list of them."""


def _field_types() -> dict[str, Any]:
    return {f.name: f.type for f in dataclasses.fields(AsyncGRPOConfig)}


def parse_overrides(pairs: list[str]) -> dict[str, Any]:
    """`--field value` pairs from the command line: a field that takes one string takes the text, the others read it
    as YAML (numbers, booleans, lists)."""
    result, i = {}, 0
    while i < len(pairs):
        key = pairs[i]
        if not key.startswith("--"):
            raise UsageError(f"expected --field value, got {key!r}")
        key = key[2:].replace("-", "_")
        if "=" in key:
            key, value = key.split("=", 1)
        else:
            if i + 1 >= len(pairs) or pairs[i + 1].startswith("--"):
                raise UsageError(
                    f"--{key} needs a value"
                    + (f" (it is followed by the flag {pairs[i + 1]})" if i + 1 < len(pairs) else "")
                )
            i += 1
            value = pairs[i]
        if _takes_words(key):  # the text itself, as transformers' argument parser takes it (null: None, if allowed)
            result[key] = None if value in ("null", "~") and "None" in _annotation(key) else value
        else:
            result[key] = _coerce(key, yaml.safe_load(value))
        i += 1
    return result


def _annotation(key: str) -> str:
    """The type a key's value has: a field's, a recipe key's, or that of the tandem key or value a TRL key stands for."""
    key = trl_names.RENAMED.get(key, key)
    if key in trl_names.NO_USE:
        return type(trl_names.NO_USE[key][0][0]).__name__
    return str(_field_types().get(key, RECIPE_TYPES.get(key, "")))


def _takes_words(key: str) -> bool:
    """A field whose value is one string (`save_strategy`, `run_name`, `model`): the command line's text is the value."""
    annotation = _annotation(key)
    return (
        key not in LISTS
        and "str" in annotation
        and not any(t in annotation for t in ("bool", "list", "dict", "int", "float"))
    )


def _coerce(key: str, value: Any) -> Any:
    """YAML reads `1e-3` as a string and `no` as false; a float field takes the number meant, a string field the word
    (`save_strategy: no`, with a warning: YAML 1.1 read it as a boolean)."""
    annotation = _annotation(key)
    if isinstance(value, bool) and "str" in annotation and "bool" not in annotation:
        word = "yes" if value else "no"
        warnings.warn(
            f'recipe: {key}: YAML reads the bare word as {value}; taken as {word!r} (write {key}: "{word}" to say so)',
            stacklevel=3,
        )
        return word
    if isinstance(value, str) and "float" in annotation:
        try:
            return float(value)
        except ValueError:
            pass
    return value


def load_recipe(path: str | None, overrides: Sequence[str] = ()) -> Recipe:
    """Read a YAML recipe (a file, or a built-in recipe's name) and apply command-line overrides; TRL's keys are read
    as tandem's (`trl_names`), and an unknown key fails with the nearest names."""
    raw, notes = trl_names.from_trl(_overridden(_read(path), overrides))
    _check_types(raw)
    if "model" not in raw:
        raise UsageError("the recipe has no 'model': give a model folder, a hub id, or 'tiny' for the built-in model")
    funcs, tools = raw.pop("reward_funcs", []), raw.pop("tools", [])
    environments, lora = _environments(raw.pop("environment_factory", None)), _lora(raw.pop("lora", None))
    default_dataset = None if environments else "arithmetic"  # environments may make their own tasks
    dataset = raw.pop("dataset", default_dataset)
    return Recipe(
        notes=notes,
        model=raw.pop("model"),
        dataset=dataset,
        reward_funcs=_paths(funcs),
        dataset_config=raw.pop("dataset_config", None),
        dataset_split=raw.pop("dataset_split", "train"),
        dataset_streaming=raw.pop("dataset_streaming", False),
        dataset_options=raw.pop("dataset_options", None),
        eval_dataset=raw.pop("eval_dataset", None),
        eval_dataset_options=raw.pop("eval_dataset_options", None),
        eval_split=raw.pop("eval_split", "test"),
        tools=_paths(tools),
        environment_factory=environments,
        lora=lora,
        config=AsyncGRPOConfig(**raw),
    )


def _read(path: str | None) -> dict[str, Any]:
    """The recipe's keys and values as YAML gives them, coerced to their fields' types (none without a path)."""
    raw: dict[str, Any] = {}
    if path is not None:
        raw = yaml.safe_load(recipe_file(path).read_text()) or {}
        if not isinstance(raw, dict):
            raise UsageError(f"{path}: a recipe is a YAML mapping of config fields, got {type(raw).__name__}")
    return {key: _coerce(key, value) for key, value in raw.items()}


def _overridden(raw: dict[str, Any], overrides: Sequence[str]) -> dict[str, Any]:
    """`raw` with the command line's flags applied; an unknown key, the recipe's or a flag's, fails."""
    flags = parse_overrides(list(overrides))
    for flag in flags:  # a flag replaces the recipe's value, whichever of TRL's or tandem's names either uses
        for key in trl_names.overridden(flag):
            raw.pop(key, None)
    raw.update(flags)
    unknown = sorted(set(raw) - known_keys())
    if unknown:
        raise UsageError(unknown_keys(unknown))
    return raw


def _check_types(raw: dict[str, Any]) -> None:
    """The recipe's own keys (not config fields) hold values of their types, or lists of them where allowed."""
    for key in set(RECIPE_TYPES) & set(raw):
        values = raw[key] if key in LISTS and isinstance(raw[key], list) else [raw[key]]
        if any(type_problem(value, RECIPE_TYPES[key]) for value in values):
            many = " (or a list of them)" if key in LISTS else ""
            raise UsageError(f"{key}={raw[key]!r}: expected {described(RECIPE_TYPES[key])}{many}")


def _environments(environments: Any) -> str | dict | None:
    """The recipe's `environment_factory`: an import path, or a mapping of names to import paths."""
    if environments is not None and not isinstance(environments, (str, dict)):
        raise UsageError(
            f"environment_factory: expected an import path (package.module:Class) or a mapping of names to "
            f"import paths, got {environments!r}"
        )
    return environments


def _lora(lora: Any) -> dict | None:
    """The recipe's `lora`: a mapping of peft.LoraConfig fields."""
    if lora is not None and not isinstance(lora, dict):
        raise UsageError(
            f"lora: expected a mapping of peft.LoraConfig fields (r, lora_alpha, target_modules, ...), got {lora!r}"
        )
    return lora


def recipe_file(path: str) -> Path:
    """The recipe at `path`, else the built-in recipe of that name (`tandem train demo`)."""
    if Path(path).is_file():
        return Path(path)
    if (RECIPES / f"{path}.yaml").is_file():
        return RECIPES / f"{path}.yaml"
    missing = f"no such recipe file (looked for {Path(path).resolve()})"
    if Path(path).suffix or "/" in path:
        raise FileNotFoundError(missing)
    names = sorted(p.stem for p in RECIPES.glob("*.yaml"))
    near = difflib.get_close_matches(path, names, n=1)
    raise FileNotFoundError(
        f"{missing}, and no built-in recipe of that name ("
        + (f"did you mean {near[0]!r}? " if near else "")
        + f"the built-in ones: {', '.join(names)})"
    )


def known_keys() -> set[str]:
    """Every key a recipe may hold: the config's fields, the recipe's own keys, and TRL's names that are read."""
    return set(_field_types()) | set(RECIPE_KEYS) | trl_names.KNOWN


def unknown_keys(keys: list[str]) -> str:
    """Keys neither tandem nor TRL has, each with the nearest names there are, and where every field is described."""
    named, known = [], known_keys()
    for key in keys:
        near = difflib.get_close_matches(key, known, n=3, cutoff=0.6)
        named.append(f"{key!r}" + (f" (did you mean {' or '.join(map(repr, near))}?)" if near else ""))
    return (
        f"unknown recipe key{'s' if len(keys) > 1 else ''} {'; '.join(named)}. Every key is described in "
        f"{FIELD_REFERENCE}."
    )


def _paths(value) -> list[str]:
    """A recipe's list of import paths (a single path may be written without the list)."""
    return [value] if isinstance(value, str) else list(value)


def import_object(path: str):
    """`package.module:name` or `package.module.name` -> the object."""
    module_name, _, name = path.replace(":", ".").rpartition(".")
    if not module_name:
        raise UsageError(f"{path!r} is not an import path: write it as package.module:function")
    try:
        return getattr(importlib.import_module(module_name), name)
    except (ImportError, AttributeError) as exc:
        raise UsageError(f"cannot import {path!r}: {exc}") from exc
