"""The metric catalogue (tandem.metrics.catalogue) stays true: every name a run writes to metrics.jsonl has an entry,
every entry is a name the code logs, and a logged name finds exactly one entry."""

import re
from pathlib import Path

import pytest
from datasets import Dataset

import tandem
from tandem import AsyncGRPOTrainer
from tandem.metrics.catalogue import METRICS, find
from tandem.rewards import accuracy_reward
from tandem.tasks import arithmetic
from tests.trainer.test_trainer import config, logged, small_dataset

SOURCE = Path(tandem.__file__).parent
LINE_FIELDS = {"step", "time"}
"""What every line of metrics.jsonl carries beside the metrics: the step it was written at and the wall-clock time."""
PLACEHOLDER = re.compile(r"\{[^{}/]+\}")


def test_a_logged_name_finds_its_entry_exactly_or_by_a_pattern():
    assert find("perf/step_s").name == "perf/step_s"
    assert find("rewards/accuracy_reward/mean").name == "rewards/{source}/mean"
    assert find("tools/search/call_count").name == "tools/{tool}/call_count"
    assert find("tools/latency_s").name == "tools/latency_s", "a fixed name is not taken for a tool's"
    assert find("eval/rewards/accuracy_reward/mean").name == "eval/rewards/{source}/mean"
    assert find("rewards/accuracy_reward/extra/mean") is None, "a placeholder stands for one segment"
    assert find("completions/examples") is None, "kept for the console's printout, never logged"


@pytest.mark.slow
def test_every_name_a_short_run_logs_is_in_the_catalogue(tmp_path):
    """Four steps of the tiny model with an evaluation every two steps and the memory metrics on."""
    args = config(tmp_path, max_steps=4, eval_strategy="steps", eval_steps=2, skip_memory_metrics=False)
    held_out = Dataset.from_list(arithmetic.make_rows(2, split="test", seed=5))
    AsyncGRPOTrainer("tiny", accuracy_reward, args=args, train_dataset=small_dataset(), eval_dataset=held_out).train()
    names = {name for line in logged(tmp_path) for name in line} - LINE_FIELDS
    assert {"reward", "loss", "perf/step_s", "eval/reward", "memory/host_rss_max_gib"} <= names, sorted(names)
    missing = sorted(name for name in names if find(name) is None)
    assert not missing, (
        f"metrics.jsonl has names the catalogue lacks (add them to tandem/metrics/catalogue.py): {missing}"
    )


def written(name: str, text: str) -> bool:
    """Whether `text` holds `name` as a string literal, each placeholder as an f-string field (`f"tools/{result.name}/..."`
    for `tools/{tool}/...`)."""
    if not PLACEHOLDER.search(name):
        return f'"{name}"' in text or f"'{name}'" in text
    body = r"\{[^{}\n]+\}".join(re.escape(part) for part in PLACEHOLDER.split(name))
    return re.search(rf"""["']{body}["']""", text) is not None


def test_every_entry_is_a_name_the_code_logs():
    """Its name (a pattern with its placeholders as f-string fields) is a string in tandem's source. An evaluation
    records each group metric (rollout/group_metrics.py) under eval/: those entries are found there without the prefix.
    Names logged only on other paths (torchrun, LoRA, tools, FlashREINFORCE, a GPU) count as logged all the same."""
    source = "\n".join(path.read_text() for path in sorted(SOURCE.rglob("*.py")) if path.name != "catalogue.py")
    group_metrics = (SOURCE / "rollout" / "group_metrics.py").read_text()
    assert re.search(r"""f["']eval/\{\w+\}["']""", source), "evaluations record group metrics under eval/"
    unlogged = [
        metric.name
        for metric in METRICS
        if not (
            written(metric.name, source)
            or metric.name.startswith("eval/")
            and written(metric.name.removeprefix("eval/"), group_metrics)
        )
    ]
    assert not unlogged, f"catalogue entries no code in src/tandem logs (renamed or removed?): {unlogged}"


def may_match_alike(a: str, b: str) -> bool:
    """Whether one logged name could match both catalogue names: as many segments, each equal or a placeholder."""
    first, second = a.split("/"), b.split("/")
    return len(first) == len(second) and all(
        x == y or PLACEHOLDER.fullmatch(x) or PLACEHOLDER.fullmatch(y) for x, y in zip(first, second)
    )


def test_no_two_entries_match_one_name_and_each_says_what_it_measures():
    overlapping = [
        (a.name, b.name) for i, a in enumerate(METRICS) for b in METRICS[i + 1 :] if may_match_alike(a.name, b.name)
    ]
    assert not overlapping, f"entries that match the same names: {overlapping}"
    partial = [
        m.name for m in METRICS if any("{" in part and not PLACEHOLDER.fullmatch(part) for part in m.name.split("/"))
    ]
    assert not partial, f"a placeholder must be a whole segment: {partial}"
    unexplained = [m.name for m in METRICS if not m.meaning.strip()]
    assert not unexplained, f"entries without a meaning: {unexplained}"
