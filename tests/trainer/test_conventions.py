"""A run set up the way users of transformers' Trainer and TRL set theirs up: evaluation during training, their
optimizer and schedule names, logging cadence and level, tensorboard, a streamed dataset, capped rows."""

import json
import re

import pytest
import torch
from datasets import Dataset, IterableDataset
from transformers import TrainerCallback
from transformers.utils import logging as hf_logging

from tandem import AsyncGRPOTrainer
from tandem.rewards import accuracy_reward
from tandem.tasks import arithmetic
from tests.metrics.test_sinks import tensorboard_scalars, tensorboard_text
from tests.trainer.test_trainer import config, logged

pytestmark = pytest.mark.slow


def arithmetic_stream(n: int):
    """A generator's rows: an IterableDataset has no length and is read in order."""
    yield from arithmetic.make_rows(n, split="train", seed=3)


class Watcher(TrainerCallback):
    """What the run looks like from a callback: transformers' log level during steps, and each evaluation."""

    def __init__(self):
        self.levels, self.evaluations, self.addresses, self.trainer = set(), [], set(), None

    def on_step_end(self, args, state, control, **kwargs):
        self.levels.add(hf_logging.get_verbosity())
        self.addresses.add(
            self.trainer.runtime.sync_strategy.address
        )  # where the server joined the weight-transfer group

    def on_evaluate(self, args, state, control, metrics=None, **kwargs):
        self.evaluations.append((state.global_step, metrics))


def test_a_run_evaluates_logs_and_optimizes_the_way_transformers_users_ask(tmp_path, capsys):
    held_out = Dataset.from_list(arithmetic.make_rows(4, split="test", seed=5))
    args = config(
        tmp_path,
        max_steps=4,
        max_staleness=0,
        learning_rate=1e-3,
        logging_steps=3,
        logging_first_step=True,
        eval_strategy="steps",
        eval_steps=2,
        eval_delay=3,
        eval_on_start=True,
        weight_sync_steps=2,
        report_to="tensorboard",
        log_level="error",
        optim="sgd",
        optim_args="momentum=0.9",
        lr_scheduler_type="cosine_with_min_lr",
        lr_scheduler_kwargs={"min_lr_rate": 0.5},
        per_device_train_batch_size=2,
        gradient_accumulation_steps=2,
        gradient_checkpointing=True,
        gradient_checkpointing_kwargs={"use_reentrant": False, "preserve_rng_state": False},
        save_strategy="steps",
        save_steps=1,
        save_total_limit=2,
        temperature=0.8,
        tree_attention_kernel="sdpa",
        embedded_server_host="localhost",
        weight_transfer_address="localhost",
        log_completions=True,
        num_completions_to_print=2,
    )
    watcher = Watcher()
    stream = IterableDataset.from_generator(arithmetic_stream, gen_kwargs={"n": 3})  # no length: read in order, again
    trainer = AsyncGRPOTrainer(
        "tiny", accuracy_reward, args=args, train_dataset=stream, eval_dataset=held_out, callbacks=[watcher]
    )
    watcher.trainer = trainer
    verbosity = hf_logging.get_verbosity()
    try:
        trainer.train()
    finally:
        hf_logging.set_verbosity(verbosity)
    rows = logged(tmp_path)

    evals = [r for r in rows if "eval/reward" in r]
    assert [r["step"] for r in evals] == [0, 4], "on start, then every eval_steps from eval_delay on"
    for row in evals:  # right after a sync, on the version the server serves (a sync every 2 steps)
        assert (
            row["eval/model_version"] == row["step"] // 2
            and row["eval/num_prompts"] == 4
            and row["eval/failed_count"] == 0
        )
        assert 0 <= row["eval/reward"] <= 1 and row["eval/completions/mean_length"] > 0
    assert [step for step, _ in watcher.evaluations] == [0, 4]
    assert all(isinstance(p, int) for p in trainer.runtime.source.ledger.finished), "eval prompts are never trained"
    assert max(trainer.runtime.source.ledger.finished) >= 3, "the stream was read again from its start: a second epoch"
    assert all("epoch" not in row for row in rows), "a stream has no length to count epochs by"

    train_rows = [r for r in rows if "loss" in r]
    assert [r["step"] for r in train_rows] == [1, 3, 4], "logging_first_step, every logging_steps, and the run's end"
    # Step 1 trains the weights the server samples from: temperature and the sdpa kernel match its sampling.
    assert abs(train_rows[0]["sampling/importance_sampling_ratio/mean"] - 1.0) < 1e-3
    assert train_rows[-1]["model_version"] == 2, "weight_sync_steps=2: two syncs in four steps"
    assert all(row["batch/microbatches_per_step"] == 2 for row in train_rows), "gradient_accumulation_steps"
    assert trainer.kernel == "sdpa" and watcher.addresses == {"127.0.0.1"}, (
        "weight_transfer_address 'localhost', resolved once: both ends of the group mean the same address"
    )
    assert "on http://localhost:" in (tmp_path / "run" / "server.log").read_text(), "embedded_server_host"
    assert sorted(p.name for p in (tmp_path / "run").glob("checkpoint-*")) == ["checkpoint-3", "checkpoint-4"]
    tables = re.split(r" completions *\n", capsys.readouterr().err)[1:]
    assert tables and all(table.count("What is") == 2 for table in tables), "log_completions, num_completions_to_print"
    completions = [json.loads(line) for line in open(tmp_path / "run" / "completions.jsonl")]
    assert {c["step"] for c in completions} == {1, 3, 4} and len(completions) > 2 * 3, "every completion to the sinks"
    assert "| step | prompt | completion | reward |" in tensorboard_text(tmp_path / "run" / "runs", "completions")
    assert train_rows[-1]["learning_rate"] == pytest.approx(0.5e-3), "cosine_with_min_lr ends at min_lr_rate"
    assert max(r["batch/samples_per_row"] for r in train_rows) <= 2, "per_device_train_batch_size caps a row"
    assert isinstance(trainer.optimizer, torch.optim.SGD) and trainer.optimizer.param_groups[0]["momentum"] == 0.9
    assert watcher.levels == {hf_logging.ERROR}, "log_level sets transformers' verbosity while training"
    layer = trainer.model.model.layers[0]
    assert layer._gradient_checkpointing_func.keywords["preserve_rng_state"] is False

    scalars = tensorboard_scalars(tmp_path / "run" / "runs")
    assert [step for step, _ in scalars["eval/reward"]] == [0, 4]
    assert [step for step, _ in scalars["loss"]] == [1, 3, 4]
    assert scalars["reward"][-1] == (4, pytest.approx(train_rows[-1]["reward"]))
    assert json.loads((tmp_path / "run" / "run_config.json").read_text())["optim"] == "sgd"


def test_an_iterable_dataset_needs_max_steps_and_is_shuffled_as_a_stream(tmp_path):
    stream = IterableDataset.from_generator(arithmetic_stream, gen_kwargs={"n": 6})
    with pytest.raises(ValueError, match="IterableDataset, which has no length: set max_steps"):
        AsyncGRPOTrainer("tiny", accuracy_reward, train_dataset=stream, args=config(tmp_path, max_steps=-1))
    with pytest.raises(ValueError, match="data_seed=3 orders a dataset by its indices.*shuffle the stream itself"):
        AsyncGRPOTrainer("tiny", accuracy_reward, train_dataset=stream, args=config(tmp_path, data_seed=3))
