"""Datasets by name for `tandem train`: a built-in task, a local json / jsonl / parquet / csv file, a local folder (a
`save_to_disk` folder, or data files), or a Hugging Face Hub id, read from this machine's datasets cache when the
Hub cannot be reached."""

from pathlib import Path

from datasets import Dataset, load_dataset, load_from_disk

from tandem.errors import UsageError
from tandem.integrations import reasoning_gym, verifiers
from tandem.tasks import arithmetic

BUILT_IN = {
    "arithmetic": lambda: Dataset.from_list(arithmetic.make_rows(2000, split="train", seed=0)),
    # 128 problems seen many times: what the demo trains on, so a few minutes show a clear rise.
    "arithmetic-small": lambda: Dataset.from_list(arithmetic.make_rows(128, split="train", seed=1)),
    # held out of the tiny model's pretraining and of the training sets: an eval_dataset
    "arithmetic-test": lambda: Dataset.from_list(arithmetic.make_rows(64, split="test", seed=2)),
}
FORMATS = {".json": "json", ".jsonl": "json", ".parquet": "parquet", ".csv": "csv"}


def load(
    name: str, config: str | None = None, split: str = "train", streaming: bool = False, options: dict | None = None
):
    """The rows of `name`: a Dataset, or with `streaming` an IterableDataset (read as training goes, never whole).
    `config` and `split` choose within a Hub dataset or a folder; `options` are a reasoning-gym task's or a verifiers
    environment's."""
    path = Path(name)
    if name.startswith(reasoning_gym.PREFIX):
        dataset = reasoning_gym.load(name, options)
    elif name.startswith(verifiers.PREFIX):
        dataset = verifiers.load(name, options)
    elif name in BUILT_IN:
        dataset = BUILT_IN[name]()
    elif path.suffix in FORMATS and path.is_file():
        dataset = load_dataset(FORMATS[path.suffix], data_files=str(path), split="train", streaming=streaming)
    elif path.is_dir() and ((path / "state.json").is_file() or (path / "dataset_dict.json").is_file()):
        saved = load_from_disk(str(path))  # a save_to_disk folder
        if (path / "dataset_dict.json").is_file() and split not in saved:
            raise UsageError(f"dataset {name!r} has no split {split!r} (its splits: {', '.join(saved)})")
        dataset = saved[split] if (path / "dataset_dict.json").is_file() else saved
    elif path.suffix in FORMATS and not path.is_dir():
        raise UsageError(
            f"dataset {name!r}: no such file (looked for {path.resolve()}; a recipe's paths resolve from "
            "the folder tandem train runs in)"
        )
    elif path.is_dir() or "/" in name:  # a Hub id may hold a dot (org/name-1.5)
        dataset = _from_hub_or_folder(name, config, split, streaming)
    else:
        raise UsageError(
            f"dataset {name!r} is neither a built-in task ({', '.join(BUILT_IN)}), a reasoning-gym task "
            f"(reasoning-gym:<task>), a verifiers taskset (verifiers:<taskset id>), a local {'/'.join(FORMATS)} file or folder, nor a Hub id "
            "(namespace/name)"
        )
    return dataset.to_iterable_dataset() if streaming and isinstance(dataset, Dataset) else dataset


def _from_hub_or_folder(name: str, config: str | None, split: str, streaming: bool):
    """datasets' own loader: a folder of data files, or a Hub dataset (its cached copy when the Hub is out of reach)."""
    try:
        return load_dataset(name, config, split=split, streaming=streaming)
    except ValueError as exc:  # datasets' own refusal: no such config, no such split
        raise UsageError(f"dataset {name!r} (config {config!r}, split {split!r}): {exc}") from None
    except (ConnectionError, FileNotFoundError) as exc:
        raise UsageError(
            f"dataset {name!r} (config {config!r}, split {split!r}) could not be loaded: {exc}. With no "
            "network, a Hub dataset loads from this machine's datasets cache once it was loaded here with "
            "one (set HF_HUB_OFFLINE=1 to skip the Hub); or give a local file or folder."
        ) from None
