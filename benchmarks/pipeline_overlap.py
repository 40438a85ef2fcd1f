"""Synchronous vs asynchronous: the same recipe, with generation and training taking turns or overlapping.

The generation server is `tandem serve` with a fixed delay after every decode step, standing in for a
GPU server, tuned so generation and training take comparable time. The synchronous run pauses the
server while the trainer computes (generate, then train, then generate...); the asynchronous run is the
trainer as it is. Both train the same number of steps from the same weights; printed: both wall times,
the speed-up, and the ideal (G + T) / max(G, T) from the synchronous run's own G and T. The reward is
the task's own integer check (math-verify would cost the worker CPU time the trainer then misses).

    python benchmarks/pipeline_overlap.py [--steps 60] [--step-delay-s 0.05] [--max-staleness 2]
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


class SynchronousTrainer(AsyncGRPOTrainer):
    """Generation and training take turns: the server is paused while the trainer computes."""

    def _train_step(self, rows, step_start):
        self.runner.run(self.control.pause("keep"))
        try:
            super()._train_step(rows, step_start)
        finally:
            self.runner.run(self.control.resume())


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--step-delay-s", type=float, default=0.05, help="sleep after every decode step of the server")
    parser.add_argument("--max-staleness", type=int, default=2,
                        help="how far generation may run ahead: with slow rollouts it must cover their latency")
    args = parser.parse_args()
    # On a CPU-only machine the server, the worker and the trainer share the cores. A trainer that spreads
    # one matmul over every core stalls whenever another process runs; one thread each keeps them apart.
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        sync = run(SynchronousTrainer, args.steps, args.step_delay_s, args.max_staleness, Path(tmp) / "sync")
        print(f"synchronous : {sync['wall']:.1f}s wall ({sync['train']:.1f}s training)", flush=True)
        overlapped = run(AsyncGRPOTrainer, args.steps, args.step_delay_s, args.max_staleness, Path(tmp) / "async")
        print(f"asynchronous: {overlapped['wall']:.1f}s wall ({overlapped['wait']:.1f}s waiting for samples)", flush=True)
    train = sync["train"]
    generate = sync["wall"] - train
    ideal = (generate + train) / max(generate, train)
    speedup = sync["wall"] / overlapped["wall"]
    print("\n| steps | G (s) | T (s) | synchronous (s) | asynchronous (s) | speed-up | ideal (G+T)/max(G,T) | speed-up / ideal |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    print(f"| {args.steps} | {generate:.1f} | {train:.1f} | {sync['wall']:.1f} | {overlapped['wall']:.1f} | {speedup:.2f}x | "
          f"{ideal:.2f}x | {speedup / ideal:.2f} |")


if __name__ == "__main__":
    main()
