"""Where prompts come from: a built-in task, a local file or folder, a Hub id read from this machine's cache when
offline, or an IterableDataset read in order, epoch after epoch."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from datasets import Dataset, IterableDataset

from tandem.recipe import load_recipe
from tandem.rollout.prompt_stream import PromptStream, epoch_order
from tandem.tasks import datasets

ROWS = [{"prompt": [{"role": "user", "content": f"What is {i} + 1?"}], "solution": str(i + 1)} for i in range(5)]


def rows_of(n: int):
    yield from ({"prompt": [{"role": "user", "content": f"q{i}"}], "solution": str(i)} for i in range(n))


def test_an_iterable_is_read_in_order_again_each_epoch_and_keeps_only_unfinished_rows():
    stream = PromptStream(IterableDataset.from_generator(rows_of, gen_kwargs={"n": 3}))
    got = [stream.at(p) for p in range(7)]
    assert [(p.epoch, p.row_index, p.row["solution"], p.epoch_start) for p in got] == [
        (0, 0, "0", True),
        (0, 1, "1", False),
        (0, 2, "2", False),
        (1, 0, "0", True),
        (1, 1, "1", False),
        (1, 2, "2", False),
        (2, 0, "0", True),
    ]
    assert stream.at(1).row["solution"] == "1", "a prompt generated again reads its row once more"
    stream.forget_below(5)
    assert sorted(stream.kept) == [5, 6]
    with pytest.raises(RuntimeError, match="prompt 1 of the IterableDataset was read and forgotten"):
        stream.at(1)
    with pytest.raises(ValueError, match="yields no rows"):
        PromptStream(IterableDataset.from_generator(rows_of, gen_kwargs={"n": 0})).at(0)


def test_a_resumed_stream_reads_past_what_its_checkpoint_consumed_without_keeping_it():
    stream = PromptStream(IterableDataset.from_generator(rows_of, gen_kwargs={"n": 4}), start=6)
    assert (stream.at(6).epoch, stream.at(6).row["solution"]) == (1, "2") and sorted(stream.kept) == [6]


def test_a_dataset_with_a_length_is_indexed_in_order_or_shuffled_per_epoch():
    data = Dataset.from_generator(rows_of, gen_kwargs={"n": 4})
    assert [PromptStream(data).at(p).row_index for p in range(6)] == [0, 1, 2, 3, 0, 1]
    shuffled = PromptStream(data, order_seed=3)
    assert [shuffled.at(p).row_index for p in range(8)] == epoch_order(3, 0, 4) + epoch_order(3, 1, 4)


def test_a_prompt_read_again_reads_the_dataset_once_and_hands_out_its_own_copy_of_the_row():
    class Counted(list):
        reads = 0

        def __getitem__(self, index):
            Counted.reads += 1
            return super().__getitem__(index)

    stream = PromptStream(Counted(ROWS))
    first = stream.at(7)
    first.row["solution"] = "changed by the rollout loop"
    assert [stream.at(7).row for _ in range(3)] == [ROWS[2]] * 3 and Counted.reads == 1


def test_local_files_and_folders_load_and_streaming_gives_an_iterable(tmp_path):
    (tmp_path / "rows.jsonl").write_text("\n".join(json.dumps(r) for r in ROWS))
    assert len(datasets.load(str(tmp_path / "rows.jsonl"))) == 5
    Dataset.from_list(ROWS).save_to_disk(str(tmp_path / "saved"))
    assert datasets.load(str(tmp_path / "saved"))[0] == ROWS[0]
    (tmp_path / "files").mkdir()
    (tmp_path / "files" / "train.jsonl").write_text("\n".join(json.dumps(r) for r in ROWS[:3]))
    (tmp_path / "files" / "test.jsonl").write_text("\n".join(json.dumps(r) for r in ROWS[3:]))
    assert len(datasets.load(str(tmp_path / "files"), split="test")) == 2
    streamed = datasets.load("arithmetic-small", streaming=True)
    assert isinstance(streamed, IterableDataset) and "prompt" in next(iter(streamed))
    with pytest.raises(ValueError, match="neither a built-in task"):
        datasets.load("no-such-task.txt")
    with pytest.raises(ValueError, match=r"dataset 'data/trian.jsonl': no such file \(looked for /.*/data/trian.jsonl"):
        datasets.load("data/trian.jsonl")


def hub_cache(folder: Path) -> Path:
    """A datasets cache holding the Hub dataset `tandem-test/arith` (configs easy and hard, splits train and test), as
    loading it once with a network leaves it; built here from local files, since nothing may be downloaded."""
    from datasets.packaged_modules.json.json import Json

    cache = folder / "cache"
    for config, rows in (("easy", ROWS), ("hard", ROWS[:2])):
        data = folder / f"{config}.jsonl"
        data.write_text("\n".join(json.dumps(r) for r in rows))
        builder = Json(
            cache_dir=str(folder / "build"), config_name=config, data_files={"train": str(data), "test": str(data)}
        )
        builder.download_and_prepare()
        target = cache / "tandem-test___arith" / config / "0.0.0" / "0123456789abcdef"
        target.mkdir(parents=True)
        for file in Path(builder.cache_dir).iterdir():  # the cache names a Hub dataset's files after the dataset
            shutil.copy(file, target / file.name.replace("json-", "arith-"))
    return cache


def test_a_hub_dataset_named_in_a_recipe_loads_offline_from_the_cache(tmp_path):
    env = {**os.environ, "HF_DATASETS_CACHE": str(hub_cache(tmp_path)), "HF_HUB_OFFLINE": "1"}
    recipe = tmp_path / "hub.yaml"
    recipe.write_text(
        "model: tiny\ndataset_name: tandem-test/arith\ndataset_config: hard\ndataset_split: test\n"
        "reward_funcs: tandem.rewards.accuracy_reward\n"
    )
    code = (
        "from tandem.recipe import load_recipe; from tandem.tasks import datasets; "
        f"r = load_recipe({str(recipe)!r}); d = datasets.load(r.dataset, r.dataset_config, r.dataset_split); "
        "print(len(d), d[1]['solution']); "
        "s = datasets.load(r.dataset, 'easy', 'train', streaming=True); print(type(s).__name__, sum(1 for _ in s))"
    )
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["2", "2", "IterableDataset", "5"]

    missing = subprocess.run(
        [sys.executable, "-c", "from tandem.tasks import datasets; datasets.load('tandem-test/absent')"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert "could not be loaded" in missing.stderr and "HF_HUB_OFFLINE" in missing.stderr


def test_a_recipe_names_its_dataset_once(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text(
        "model: tiny\ndataset: arithmetic\ndataset_name: arithmetic\nreward_funcs: tandem.rewards.accuracy_reward\n"
    )
    with pytest.raises(ValueError, match=r"both 'dataset_name' \(TRL's name\) and 'dataset'"):
        load_recipe(str(recipe))


def test_a_resumed_worker_generates_a_stream_from_the_examples_its_checkpoint_had_not_consumed():
    from tests.rollout.test_failures import by_reply, prompt_indices, run_loop

    stream = IterableDataset.from_generator(
        lambda: ({"prompt": [{"role": "user", "content": f"prompt {i}"}]} for i in range(4))
    )
    messages, _ = run_loop(
        by_reply,
        settings={"dataset": stream, "num_prompts": 10, "dataset_start_index": 5, "received": frozenset({6})},
    )
    generated = prompt_indices(messages, "samples")
    assert sorted(set(generated)) == [5, 7, 8, 9], "from the watermark on, leaving out what the trainer holds"


def test_a_hub_id_with_a_dot_is_a_hub_id_not_a_file(monkeypatch):
    asked = []
    monkeypatch.setattr(datasets, "_from_hub_or_folder", lambda *args: asked.append(args) or Dataset.from_list(ROWS))
    datasets.load("AI-MO/NuminaMath-1.5", "default", "train")
    assert asked == [("AI-MO/NuminaMath-1.5", "default", "train", False)]
