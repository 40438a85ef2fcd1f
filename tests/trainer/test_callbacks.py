"""transformers' TrainerCallback objects in a tandem run, as scripts written for transformers and TRL use them."""

import json

import pytest
from transformers import TrainerCallback

from tandem import AsyncGRPOTrainer
from tandem.rewards import accuracy_reward
from tests.trainer.test_trainer import config, logged, small_dataset

pytestmark = pytest.mark.slow


class Recorder(TrainerCallback):
    """Writes down every event; asks for a log and a checkpoint off the schedule, at step 3."""

    def __init__(self):
        self.events, self.logs = [], []

    def on_init_end(self, args, state, control, **kwargs):
        self.events.append("init_end")

    def on_train_begin(self, args, state, control, **kwargs):
        self.events.append("train_begin")

    def on_step_begin(self, args, state, control, **kwargs):
        self.events.append(f"step_begin {state.global_step}")

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        self.events.append("pre_optimizer")

    def on_optimizer_step(self, args, state, control, **kwargs):
        self.events.append("optimizer")

    def on_step_end(self, args, state, control, **kwargs):
        self.events.append(f"step_end {state.global_step}")
        control.should_log = control.should_save = state.global_step == 3

    def on_log(self, args, state, control, logs=None, **kwargs):
        self.logs.append(dict(logs))

    def on_save(self, args, state, control, **kwargs):
        self.events.append(f"save {state.global_step}")

    def on_train_end(self, args, state, control, **kwargs):
        self.events.append("train_end")


class StopAfterLog(TrainerCallback):
    """Stops the run from `on_log` once step 4 is logged (a threshold stop, as users write them)."""

    def on_log(self, args, state, control, logs=None, **kwargs):
        control.should_training_stop = state.global_step >= 4


def test_callbacks_see_every_event_ask_for_logs_and_saves_and_stop_the_run(tmp_path):
    recorder = Recorder()
    args = config(tmp_path, max_steps=10, logging_steps=2, save_strategy="steps", save_steps=4)
    trainer = AsyncGRPOTrainer(
        "tiny", accuracy_reward, args=args, train_dataset=small_dataset(), callbacks=[recorder, StopAfterLog]
    )
    output = trainer.train()

    assert output.global_step == trainer.state.global_step == 4, "a stop asked in on_log ends the run at that step"
    step = ["pre_optimizer", "optimizer"]  # as transformers: the optimizer's events come before the step is counted
    assert recorder.events == [
        "init_end",
        "train_begin",
        "step_begin 0",
        *step,
        "step_end 1",
        "step_begin 1",
        *step,
        "step_end 2",
        "step_begin 2",
        *step,
        "step_end 3",
        "save 3",
        "step_begin 3",
        *step,
        "step_end 4",
        "save 4",
        "train_end",
    ], "step 3 saved on request, step 4 on schedule and not again at the end"
    written = logged(tmp_path)
    as_written = [
        json.dumps({k: v for k, v in entry.items() if k not in ("step", "time")}, sort_keys=True) for entry in written
    ]
    assert as_written == [json.dumps(logs, sort_keys=True) for logs in recorder.logs], (
        "on_log sees every window written to metrics.jsonl (the sink adds step and time)"
    )
    assert [entry["step"] for entry in trainer.state.log_history] == [entry["step"] for entry in written] == [2, 3, 4]
    saved = json.loads((tmp_path / "run" / "checkpoint-3" / "trainer_state.json").read_text())
    assert [entry["step"] for entry in saved["log_history"]] == [2, 3], "the checkpoint keeps the log history"


def test_callbacks_are_added_popped_and_removed_by_instance_or_class(tmp_path):
    trainer = AsyncGRPOTrainer("tiny", accuracy_reward, args=config(tmp_path), train_dataset=small_dataset())
    first, second = Recorder(), Recorder()
    trainer.add_callback(first)
    trainer.add_callback(second)
    assert trainer.pop_callback(Recorder) is first and trainer.pop_callback(first) is None
    trainer.remove_callback(second)
    assert trainer.callback_handler.callbacks == []
