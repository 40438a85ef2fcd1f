"""Datasets by name for `tandem train`: a built-in task, or a local json / jsonl / parquet / csv file."""

from pathlib import Path

from datasets import Dataset, load_dataset

from tandem.tasks import arithmetic

BUILT_IN = {
    "arithmetic": lambda: Dataset.from_list(arithmetic.make_rows(2000, split="train", seed=0)),
    # 128 problems seen many times: what the demo trains on, so a few minutes show a clear rise.
    "arithmetic-small": lambda: Dataset.from_list(arithmetic.make_rows(128, split="train", seed=1)),
    # held out of the tiny model's pretraining and of the training sets: an eval_dataset
    "arithmetic-test": lambda: Dataset.from_list(arithmetic.make_rows(64, split="test", seed=2)),
}
FORMATS = {".json": "json", ".jsonl": "json", ".parquet": "parquet", ".csv": "csv"}


def load(name: str) -> Dataset:
    if name in BUILT_IN:
        return BUILT_IN[name]()
    path = Path(name)
    if path.suffix in FORMATS and path.is_file():
        return load_dataset(FORMATS[path.suffix], data_files=str(path), split="train")
    raise ValueError(f"dataset {name!r} is neither a built-in task ({', '.join(BUILT_IN)}) nor a local "
                     f"{'/'.join(FORMATS)} file")
