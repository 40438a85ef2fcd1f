"""Synchronous vs asynchronous: the same recipe, with generation and training taking turns or overlapping.

The generation server is `tandem serve` with a fixed delay after every decode step, standing in for a
GPU server, tuned so generation and training take comparable time. The synchronous run pauses the
server while the trainer computes (generate, then train, then generate...); the asynchronous run is the
trainer as it is. Both train the same number of steps from the same weights; printed: both wall times,
the speed-up, and the ideal (G + T) / max(G, T) from the synchronous run's own G and T. The reward is
the task's own integer check (math-verify would cost the worker CPU time the trainer then misses).
Each configuration (a server step delay and a max_staleness) is one row of the printed table.

    python benchmarks/pipeline_overlap.py [--steps 60] [--config STEP_DELAY_S MAX_STALENESS ...] [--markdown PATH]
"""

import argparse
import json
import tempfile
from pathlib import Path

import torch
from datasets import Dataset

from tandem import AsyncGRPOConfig, AsyncGRPOTrainer
from tandem.generation.launcher import EmbeddedServer
from tandem.tasks import TINY_MODEL_PATH, arithmetic

from tables import add_markdown_flag, emit, markdown_table

CONFIGS = [(0.05, 2), (0.02, 1), (0.05, 4), (0.15, 2)]
"""(step delay in seconds, max_staleness) of each row of the README's table."""


class SynchronousTrainer(AsyncGRPOTrainer):
    """Generation and training take turns: the server is paused from the step's first forward until the step's
    weight sync has reloaded it (the sync pauses, reloads and resumes; a step without a sync resumes it here)."""

    def training_step(self, micro_batches):
        self.session.run(self.session.control.pause("keep"))
        return super().training_step(micro_batches)

    def optimizer_step(self):
        grad_norm = super().optimizer_step()
        if (self.state.step + 1) % self.args.weight_sync_steps:  # no sync follows this step
            self.session.run(self.session.control.resume())
        return grad_norm


def run(trainer_cls, steps: int, delay: float, args_staleness: int, folder: Path) -> dict:
    extra = ["--logprobs-mode", "processed_logprobs", "--served-model-name", TINY_MODEL_PATH, "--step-delay-s", str(delay)]
    # One CPU thread for the server: it stands in for a GPU, so its own compute should not take the trainer's cores.
    with EmbeddedServer("tiny", extra_args=extra, env={"OMP_NUM_THREADS": "1"}) as server:
        args = AsyncGRPOConfig(output_dir=str(folder), vllm_server_base_url=server.url, max_steps=steps, learning_rate=2e-4,
                               num_generations=8, max_completion_length=8, token_budget=160, gradient_accumulation_steps=2,
                               max_staleness=args_staleness, gradient_checkpointing=False, score_centering=False, save_strategy="no")
        data = Dataset.from_list(arithmetic.make_rows(128, split="train", seed=1))
        trainer_cls("tiny", arithmetic.correctness_reward, args=args, train_dataset=data).train()
    rows = [json.loads(line) for line in open(folder / "metrics.jsonl")]
    # Measured from the end of the first step: the one-time start of the worker process is left out of both runs.
    wall = rows[-1]["time"] - rows[0]["time"]
    train = sum(r["perf/step_s"] - r["perf/rollout_wait_s"] for r in rows[1:])
    return {"wall": wall, "train": train, "wait": sum(r["perf/rollout_wait_s"] for r in rows[1:])}


def compare(steps: int, delay: float, staleness: int, folder: Path) -> list[str]:
    """Both runs of one configuration; returns its row of the README table."""
    sync = run(SynchronousTrainer, steps, delay, staleness, folder / "sync")
    print(f"  synchronous : {sync['wall']:.1f}s wall ({sync['train']:.1f}s training)", flush=True)
    overlapped = run(AsyncGRPOTrainer, steps, delay, staleness, folder / "async")
    print(f"  asynchronous: {overlapped['wall']:.1f}s wall ({overlapped['wait']:.1f}s waiting for samples)", flush=True)
    train = sync["train"]
    generate = sync["wall"] - train
    ideal = (generate + train) / max(generate, train)
    speedup = sync["wall"] / overlapped["wall"]
    return [f"{delay:g} s, {staleness}", f"{generate:.1f}", f"{train:.1f}", f"{sync['wall']:.1f}", f"{overlapped['wall']:.1f}",
            f"{speedup:.2f}x", f"{ideal:.2f}x", f"{speedup / ideal:.2f}"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--config", nargs=2, action="append", metavar=("STEP_DELAY_S", "MAX_STALENESS"),
                        help="one row: the server's sleep after every decode step, and how far generation may run ahead "
                             "(with slow rollouts it must cover their latency); repeatable. Default: the README's rows, "
                             + ", ".join(f"{d} {s}" for d, s in CONFIGS))
    add_markdown_flag(parser)
    args = parser.parse_args()
    configs = [(float(d), int(s)) for d, s in args.config] if args.config else CONFIGS
    # On a CPU-only machine the server, the worker and the trainer share the cores. A trainer that spreads
    # one matmul over every core stalls whenever another process runs; one thread each keeps them apart.
    torch.set_num_threads(1)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for i, (delay, staleness) in enumerate(configs):
            print(f"step delay {delay} s, max_staleness {staleness}, {args.steps} steps", flush=True)
            rows.append(compare(args.steps, delay, staleness, Path(tmp) / str(i)))
    emit(markdown_table(["step delay, max_staleness", "G (s)", "T (s)", "synchronous (s)", "asynchronous (s)", "speed-up",
                         "ideal (G+T)/max(G,T)", "speed-up / ideal"], "rrrrrrrr", rows), args.markdown)


if __name__ == "__main__":
    main()
