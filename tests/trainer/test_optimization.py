"""The optimizer step's conventions: `max_grad_norm=0` means no clipping (transformers' and TRL's), so gradient
accumulation over two rows takes the same step as one full batch."""

import torch
from datasets import Dataset
from transformers import AutoTokenizer

from tandem import AsyncGRPOConfig, AsyncGRPOTrainer
from tandem.packing import pack
from tandem.rewards import accuracy_reward
from tandem.runtime.sync_check import policy_log_probs
from tandem.tasks import TINY_MODEL_PATH, arithmetic
from tandem.trainer.optimization import clip_gradients
from tests.packing.samples import sample

DATA = Dataset.from_list(arithmetic.make_rows(4, seed=0))
TOKENIZER = AutoTokenizer.from_pretrained(TINY_MODEL_PATH)


def one_step(tmp_path, micro_batches, max_grad_norm):
    """Parameters after the trainer's own step over `micro_batches` (forward and backward, then its optimizer step) with SGD at
    learning rate 1, so the update is the (clipped) gradient itself."""
    model = AsyncGRPOTrainer(
        "tiny", accuracy_reward, args=AsyncGRPOConfig(output_dir=str(tmp_path)), train_dataset=DATA
    ).model
    sgd = torch.optim.SGD(model.parameters(), lr=1.0)
    args = AsyncGRPOConfig(output_dir=str(tmp_path), score_centering=False, max_grad_norm=max_grad_norm)
    trainer = AsyncGRPOTrainer(
        model,
        accuracy_reward,
        args=args,
        train_dataset=DATA,
        processing_class=TOKENIZER,
        optimizers=(sgd, torch.optim.lr_scheduler.LambdaLR(sgd, lambda step: 1.0)),
    )
    trainer.training_step(micro_batches)
    trainer.optimizer_step()
    return torch.cat([p.detach().flatten() for p in trainer.model.parameters()])


def on_policy_sample(model, prompt, completion, group, advantage):
    """A sample whose sampler log-probs are the model's own (ratio 1: nothing masked or clipped)."""
    logprobs = policy_log_probs(model, prompt, completion, "exact").tolist()
    return sample(
        prompt + completion,
        [0] * len(prompt) + [1] * len(completion),
        group=group,
        advantage=advantage,
        behavior_log_probs=[0.0] * len(prompt) + logprobs,
    )


def test_max_grad_norm_zero_means_no_clipping_and_accumulation_equals_the_full_batch(tmp_path):
    # Two samples with the same number of trained tokens: the mean of their per-row losses is the full-batch loss.
    model = AsyncGRPOTrainer(
        "tiny", accuracy_reward, args=AsyncGRPOConfig(output_dir=str(tmp_path)), train_dataset=DATA
    ).model
    before = torch.cat([p.detach().flatten() for p in model.parameters()])
    first = on_policy_sample(model, [5, 6], [7, 8, 9], group=0, advantage=1.0)
    second = on_policy_sample(model, [5, 6], [10, 11, 12], group=1, advantage=-0.5)

    accumulated = one_step(tmp_path, [[pack([first])], [pack([second])]], max_grad_norm=0)
    full_batch = one_step(tmp_path, [[pack([first, second])]], max_grad_norm=0)
    assert (accumulated - before).abs().max() > 1e-3, "max_grad_norm=0 must not zero the update"
    torch.testing.assert_close(
        accumulated, full_batch, atol=1e-5, rtol=1e-5
    )  # fp32: two rows sum in another order than one

    clipped = one_step(tmp_path, [[pack([first, second])]], max_grad_norm=1e-3)
    assert (clipped - before).norm() < 1.01e-3 < (full_batch - before).norm(), "a positive max_grad_norm clips"


def test_clip_gradients_returns_the_norm_before_clipping():
    layer = torch.nn.Linear(3, 1, bias=False)
    layer.weight.grad = torch.tensor([[3.0, 4.0, 0.0]])
    assert float(clip_gradients(layer, 0)) == 5.0 and layer.weight.grad.norm() == 5.0
    assert float(clip_gradients(layer, 1.0)) == 5.0 and abs(float(layer.weight.grad.norm()) - 1.0) < 1e-5
