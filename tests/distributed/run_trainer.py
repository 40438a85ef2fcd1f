"""A small training run through the embedded server, as one process or under torchrun; rank 0 writes the prompt
prompt indices it trained to OUT/finished-TAG.json (also when the run is stopped by --crash-after).

    [torchrun --standalone --nproc-per-node 2] tests/distributed/run_trainer.py OUT TAG [--crash-after N] [--resume]
        [--field value ...]   (AsyncGRPOConfig fields, read as YAML)
"""

import argparse
import json
from pathlib import Path

from datasets import Dataset

from tandem import AsyncGRPOConfig, AsyncGRPOTrainer
from tandem.recipe import parse_overrides
from tandem.rewards import accuracy_reward
from tandem.tasks import arithmetic


class CrashingTrainer(AsyncGRPOTrainer):
    """Stops every rank at the start of step `crash_after` + 1, as a killed job would, after saving what it trained."""

    crash_after: int | None = None
    record: Path | None = None

    def training_step(self, micro_batches):
        if self.state.step == self.crash_after:
            save_finished(self, self.record)
            raise KeyboardInterrupt(f"simulated crash after step {self.crash_after}")
        return super().training_step(micro_batches)


def save_finished(trainer: AsyncGRPOTrainer, path: Path) -> None:
    if trainer.ranks.main:
        path.write_text(json.dumps(sorted(trainer.runtime.source.ledger.finished)))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("tag")
    parser.add_argument("--crash-after", type=int, default=None)
    parser.add_argument("--resume", action="store_true")
    parser.add_argument("--prompts", type=int, default=24)
    ns, rest = parser.parse_known_args()
    out = Path(ns.out)
    values = dict(
        output_dir=str(out / "run"),
        num_generations=4,
        max_completion_length=6,
        token_budget=256,
        learning_rate=1e-4,
        gradient_checkpointing=False,
        save_strategy="no",
        logging_steps=1,
        max_steps=4,
        vllm_server_timeout=120,
        rollout_worker_timeout=60,
    )
    args = AsyncGRPOConfig(**(values | parse_overrides(rest)))
    data = Dataset.from_list(arithmetic.make_rows(ns.prompts, split="train", seed=3))
    CrashingTrainer.crash_after, CrashingTrainer.record = ns.crash_after, out / f"finished-{ns.tag}.json"
    trainer = CrashingTrainer("tiny", accuracy_reward, args=args, train_dataset=data)
    trainer.train(resume_from_checkpoint=True if ns.resume else None)
    save_finished(trainer, out / f"finished-{ns.tag}.json")


if __name__ == "__main__":
    main()
