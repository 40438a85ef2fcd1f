"""auto_find_batch_size: a step that runs out of device memory runs again in rows of half the tokens. The device
here is a CPU, which raises no out-of-memory error: a hook on the model raises one for rows past a size, as a GPU
of that memory would."""

import pytest
import torch

from tandem import AsyncGRPOConfig, AsyncGRPOTrainer, UsageError
from tandem.packing import pack
from tandem.rewards import accuracy_reward
from tandem.testing import scripted
from tests.packing.samples import sample
from tests.trainer.test_trainer import small_dataset

TWO_SAMPLES = pack([sample(range(5, 17), group=0), sample(range(17, 29), group=1)])  # a row of 24 tokens


def trainer(tmp_path, rows, **fields) -> AsyncGRPOTrainer:
    class Trainer(AsyncGRPOTrainer):
        runtime_cls = scripted([[[rows]], [[rows]]])  # two steps of the same row

    args = AsyncGRPOConfig(output_dir=str(tmp_path), save_strategy="no", score_centering=False, **fields)
    run = Trainer("tiny", accuracy_reward, train_dataset=small_dataset(), args=args)
    forwarded = []

    def device_of_16_tokens(module, args, kwargs):  # the trainer pads a CPU row to at least 16 tokens
        length = max(t.shape[-1] for t in [*args, *kwargs.values()] if isinstance(t, torch.Tensor) and t.dim() >= 2)
        if length > 16:
            raise torch.OutOfMemoryError(f"CUDA out of memory: a row of {length} tokens")
        forwarded.append(length)

    run.model.get_decoder().register_forward_pre_hook(device_of_16_tokens, with_kwargs=True)
    run.forwarded = forwarded
    return run


def test_a_step_out_of_memory_runs_again_in_rows_of_half_the_tokens_and_the_budget_stays_halved(tmp_path):
    run = trainer(tmp_path, TWO_SAMPLES, auto_find_batch_size=True)
    output = run.train()
    assert output.global_step == 2
    assert run.runtime.token_budgets == [12, 12], "24-token rows out of memory: the steps after pack 12"
    assert run.forwarded == [16] * 4, "each sample in a row of its own (12 tokens, padded to 16), two steps"
    assert run.runtime.said[0] == "out of device memory: token_budget halved to 12"
    assert all(line["loss"] == line["loss"] for line in run.runtime.logged if "loss" in line)


def test_without_auto_find_batch_size_the_out_of_memory_error_stops_the_run(tmp_path):
    with pytest.raises(torch.OutOfMemoryError, match="a row of 24 tokens"):
        trainer(tmp_path, TWO_SAMPLES).train()


def test_a_sample_longer_than_half_the_row_cannot_be_split(tmp_path):
    one_long = pack([sample(range(5, 29))])  # 24 tokens in one sample
    with pytest.raises(UsageError, match=r"longest sample \(24 tokens\) does not fit in half of that"):
        trainer(tmp_path, one_long, auto_find_batch_size=True).train()
