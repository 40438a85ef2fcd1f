"""Three optimizer steps of the trainer on fixed rows, as one process or under torchrun; rank 0 saves the losses and
the final weights to OUT (a torch file).

    python tests/distributed/fixed_rows.py OUT [ALGORITHM]
    torchrun --standalone --nproc-per-node 2 tests/distributed/fixed_rows.py OUT [ALGORITHM]

Each step's micro-batches hold two rows (one per rank under torchrun; one process trains both), and the last step
has a single row, so the second rank forwards a weight-0 filler.
"""

import sys

import torch
from datasets import Dataset
from transformers import AutoModelForCausalLM

from tandem import AsyncGRPOConfig, AsyncGRPOTrainer
from tandem.contract.records import Sample
from tandem.model.distributed import full_tensor
from tandem.packing import pack
from tandem.rewards import accuracy_reward
from tandem.runtime.sync_check import policy_log_probs
from tandem.tasks import TINY_MODEL_PATH, arithmetic


def sample(reference, prompt: list[int], completion: list[int], group: int, rollout: str, reward: float) -> Sample:
    """A sample whose sampler log-probs are the initial model's own."""
    logprobs = policy_log_probs(reference, prompt, completion, "exact").tolist()
    return Sample(
        input_ids=prompt + completion,
        trained=[False] * len(prompt) + [True] * len(completion),
        behavior_log_probs=[0.0] * len(prompt) + logprobs,
        advantage=reward - 0.5,
        model_version=0,
        group_id=group,
        prompt_index=group,
        group_samples=2,
        rollout_id=rollout,
        created_at=0.0,
        reward=reward,
    )


def steps(reference) -> list[list[list]]:
    """Three steps: two micro-batches of two rows, one of two rows (rows of unequal size), one of a single row."""
    a = [
        sample(reference, [5, 6, 7], [20 + i, 30 + i, 40], group=0, rollout=f"a{i}", reward=float(i)) for i in range(2)
    ]
    b = [
        sample(reference, [8, 9], [50 + i, 60, 70 + i, 71], group=1, rollout=f"b{i}", reward=float(1 - i))
        for i in range(2)
    ]
    c = [sample(reference, [10, 11, 12, 13], [80 + i], group=2, rollout=f"c{i}", reward=float(i)) for i in range(2)]
    d = [sample(reference, [14], [90, 91 + i], group=3, rollout=f"d{i}", reward=float(i)) for i in range(2)]
    return [[[pack(a), pack(b)], [pack(c), pack(d)]], [[pack(a + c), pack(d[:1])]], [[pack(b + d)]]]


def main(out: str, algorithm: str = "grpo") -> None:
    reference = AutoModelForCausalLM.from_pretrained(TINY_MODEL_PATH, dtype=torch.float32)
    flash = algorithm == "flash_reinforce"
    args = AsyncGRPOConfig(
        output_dir="/tmp/unused",
        algorithm=algorithm,
        num_generations=1 if flash else 2,
        learning_rate=1e-3,
        **({"flash_delta": float("inf")} if flash else {"score_centering": False}),  # each algorithm's own fields
    )
    trainer = AsyncGRPOTrainer(
        "tiny", accuracy_reward, args=args, train_dataset=Dataset.from_list(arithmetic.make_rows(4, seed=0))
    )
    trainer.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    trainer.model.train()
    losses = []
    for micro_batches in steps(reference):
        losses.append(trainer.training_step(micro_batches).loss)
        trainer.optimizer_step()
    weights = {name: full_tensor(p.detach()).clone() for name, p in trainer.model.named_parameters()}
    if trainer.ranks.main:
        torch.save({"losses": losses, "weights": weights}, out)


if __name__ == "__main__":
    main(*sys.argv[1:])
