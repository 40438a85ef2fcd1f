"""transformers' TrainerCallback objects in a tandem run, as scripts written for transformers and TRL use them."""

import json

import pytest
from transformers import TrainerCallback

from tandem import AsyncGRPOTrainer
from tandem.rewards import accuracy_reward
from tests.trainer.test_trainer import config, logged, small_dataset

pytestmark = pytest.mark.slow


class Recorder(TrainerCallback):
    """Writes down every event; stops the run after `stop_at` steps and asks for a checkpoint at step 2."""

    def __init__(self, stop_at: int):
        self.stop_at, self.events, self.logs = stop_at, [], []

    def on_init_end(self, args, state, control, **kwargs):
        self.events.append("init_end")

    def on_train_begin(self, args, state, control, **kwargs):
        self.events.append("train_begin")

    def on_step_begin(self, args, state, control, **kwargs):
        self.events.append(f"step_begin {state.global_step}")

    def on_step_end(self, args, state, control, **kwargs):
        self.events.append(f"step_end {state.global_step}")
        control.should_save = state.global_step == 2
        control.should_training_stop = state.global_step >= self.stop_at

    def on_log(self, args, state, control, logs=None, **kwargs):
        self.logs.append(dict(logs))

    def on_save(self, args, state, control, **kwargs):
        self.events.append(f"save {state.global_step}")

    def on_train_end(self, args, state, control, **kwargs):
        self.events.append("train_end")


def test_a_callback_sees_every_event_log_and_save_and_stops_the_run(tmp_path):
    recorder = Recorder(stop_at=3)
    args = config(tmp_path, max_steps=10, logging_steps=2, save_strategy="no")
    trainer = AsyncGRPOTrainer("tiny", accuracy_reward, args=args, train_dataset=small_dataset(), callbacks=[recorder])
    output = trainer.train()

    assert output.global_step == trainer.state.global_step == 3, "should_training_stop ends the run at step 3"
    assert recorder.events == ["init_end", "train_begin", "step_begin 0", "step_end 1", "step_begin 1", "step_end 2",
                               "save 2", "step_begin 2", "step_end 3", "train_end"]
    written = logged(tmp_path)
    as_written = [json.dumps({k: v for k, v in entry.items() if k not in ("step", "time")}, sort_keys=True) for entry in written]
    assert as_written == [json.dumps(logs, sort_keys=True) for logs in recorder.logs], \
        "on_log sees every window written to metrics.jsonl (the sink adds step and time)"
    assert [entry["step"] for entry in trainer.state.log_history] == [entry["step"] for entry in written] == [2, 3]
    assert (tmp_path / "run" / "checkpoint-2").is_dir(), "should_save writes a checkpoint"
    saved = json.loads((tmp_path / "run" / "checkpoint-2" / "trainer_state.json").read_text())
    assert [entry["step"] for entry in saved["log_history"]] == [2], "the checkpoint keeps the log history"


def test_callbacks_are_added_popped_and_removed_by_instance_or_class(tmp_path):
    trainer = AsyncGRPOTrainer("tiny", accuracy_reward, args=config(tmp_path), train_dataset=small_dataset())
    first, second = Recorder(1), Recorder(2)
    trainer.add_callback(first)
    trainer.add_callback(second)
    assert trainer.pop_callback(Recorder) is first and trainer.pop_callback(first) is None
    trainer.remove_callback(second)
    assert trainer.callback_handler.callbacks == []
