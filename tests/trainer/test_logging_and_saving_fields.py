"""transformers' logging and saving fields that users bring from their scripts: include_num_input_tokens_seen,
logging_nan_inf_filter and save_on_each_node, each doing what transformers' Trainer does with it."""

import json
import math

import pytest

from tandem import AsyncGRPOConfig, AsyncGRPOTrainer
from tandem.packing import PADDED, pack
from tandem.rewards import accuracy_reward
from tandem.testing import scripted
from tandem.trainer.checkpoint import check_save_on_each_node
from tandem.trainer.step_metrics import input_tokens
from tests.packing.samples import sample
from tests.trainer.test_trainer import config, logged, small_dataset


def test_input_tokens_count_a_padded_rows_padding_only_when_all_are_counted():
    samples = [sample([5, 6, 7, 8, 9, 10], group=0), sample([5, 6, 7], group=1)]
    tree, padded = pack(samples), pack(samples, layout=PADDED)
    assert tree.num_tokens == 7, "the shared prefix once, no padding: 6 tokens and the short sample's last"
    assert padded.num_tokens == 12 and padded.raw_tokens == 9, "two rows of width 6, three of them padding"
    assert [input_tokens([tree, padded], counted) for counted in ("all", True, "non_padding", "no", False)] == [
        19,
        19,
        16,
        0,
        0,
    ]


def test_a_run_logs_num_input_tokens_seen_and_a_checkpoint_keeps_it_with_save_on_each_node(tmp_path):
    args = config(
        tmp_path,
        max_steps=2,
        include_num_input_tokens_seen="non_padding",
        save_on_each_node=True,
        save_strategy="steps",
        save_steps=2,
    )
    AsyncGRPOTrainer("tiny", accuracy_reward, args=args, train_dataset=small_dataset()).train()
    rows = [r for r in logged(tmp_path) if "num_tokens" in r]
    seen = [r["num_input_tokens_seen"] for r in rows]
    assert seen == [r["num_tokens"] for r in rows] and seen[0] < seen[-1], "tree rows: every forwarded token counts"
    state = json.loads((tmp_path / "run" / "checkpoint-2" / "trainer_state.json").read_text())
    assert state["num_input_tokens_seen"] == seen[-1], "save_on_each_node: this machine's rank 0 wrote the checkpoint"


def test_without_include_num_input_tokens_seen_nothing_is_counted(tmp_path):
    args = config(tmp_path, max_steps=1)
    AsyncGRPOTrainer("tiny", accuracy_reward, args=args, train_dataset=small_dataset()).train()
    assert all("num_input_tokens_seen" not in r for r in logged(tmp_path))


def test_save_on_each_node_stops_a_run_over_several_machines(monkeypatch):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    check_save_on_each_node(True, world_size=2)  # one machine of two processes
    check_save_on_each_node(False, world_size=4)
    with pytest.raises(NotImplementedError, match="save_on_each_node=True on 2 machines"):
        check_save_on_each_node(True, world_size=4)


@pytest.mark.parametrize("nan_filter", [True, False])
def test_logging_nan_inf_filter_false_logs_a_nan_loss_instead_of_leaving_it_out(tmp_path, nan_filter):
    fine, diverged = pack([sample([5, 6, 7], advantage=1.0)]), pack([sample([5, 6, 7], advantage=math.nan)])

    class Trainer(AsyncGRPOTrainer):
        runtime_cls = scripted([[[fine]], [[diverged]]])  # the second step's loss is NaN

    args = AsyncGRPOConfig(
        output_dir=str(tmp_path),
        logging_steps=2,
        save_strategy="no",
        score_centering=False,
        logging_nan_inf_filter=nan_filter,
    )
    trainer = Trainer("tiny", accuracy_reward, train_dataset=small_dataset(), args=args)
    output = trainer.train()
    [line] = [line for line in trainer.runtime.logged if "loss" in line]
    assert math.isfinite(line["loss"]) if nan_filter else math.isnan(line["loss"])
    assert output.global_step == 2
    assert math.isfinite(output.training_loss) if nan_filter else math.isnan(output.training_loss)
