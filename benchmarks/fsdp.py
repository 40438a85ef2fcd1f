"""Trained tokens per second of the trainer's step at 1 and 2 processes (torchrun, FSDP2), on the same rows.

Each run builds the trainer on a random model of the tiny model's architecture (`--layers`, `--hidden`), then
times `--steps` optimizer steps (after one warm-up) of `--micro-batches` micro-batches, each holding one packed
row of `--row-tokens` tokens per rank — GRPO groups of 8 sharing their prompt, as the batcher packs them. On CPU
the ranks share the machine's cores (gloo): the table shows that sharding works and what it costs, not a
speed-up. On GPUs (NCCL, one per rank) the same command measures the scaling.

    python benchmarks/fsdp.py [--layers 4] [--hidden 384] [--row-tokens 1024] [--steps 4] [--markdown PATH]
"""

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tables import add_markdown_flag, emit, markdown_table


def worker(cli) -> None:
    """One rank of a timed run (under torchrun); rank 0 writes the result to cli.result."""
    import torch
    from datasets import Dataset
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from tandem import AsyncGRPOConfig, AsyncGRPOTrainer
    from tandem.contract.records import Sample
    from tandem.packing import pack
    from tandem.rewards import accuracy_reward
    from tandem.tasks import TINY_MODEL_PATH, arithmetic

    config = AutoConfig.from_pretrained(TINY_MODEL_PATH)
    config.num_hidden_layers, config.layer_types = cli.layers, ["full_attention"] * cli.layers
    config.hidden_size, config.intermediate_size = cli.hidden, 4 * cli.hidden
    config.num_attention_heads, config.num_key_value_heads = cli.hidden // 64, max(1, cli.hidden // 256)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    if torch.cuda.is_available():
        model.to("cuda")
    args = AsyncGRPOConfig(output_dir=tempfile.mkdtemp(), score_centering=False, learning_rate=1e-5)
    trainer = AsyncGRPOTrainer(
        model,
        accuracy_reward,
        args=args,
        train_dataset=Dataset.from_list(arithmetic.make_rows(4)),
        processing_class=AutoTokenizer.from_pretrained(TINY_MODEL_PATH),
    )
    trainer.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    trainer.model.train()
    world = trainer.ranks.world_size
    generator = torch.Generator().manual_seed(1)

    def row() -> object:
        """GRPO groups of 8 (a 64-token prompt, 64-token completions) up to `row_tokens` packed tokens."""
        samples, tokens, group = [], 0, 0
        while tokens + 64 + 8 * 64 <= cli.row_tokens:
            prompt = torch.randint(3, 500, (64,), generator=generator).tolist()
            for _ in range(8):
                completion = torch.randint(3, 500, (64,), generator=generator).tolist()
                samples.append(
                    Sample(
                        input_ids=prompt + completion,
                        trained=[False] * 64 + [True] * 64,
                        behavior_log_probs=[-6.0] * 128,
                        advantage=float(torch.randn(1, generator=generator)),
                        model_version=0,
                        group_id=group,
                        prompt_index=group,
                        group_samples=8,
                        rollout_id=f"{group}-{len(samples)}",
                        created_at=0.0,
                    )
                )
            tokens, group = tokens + 64 + 8 * 64, group + 1
        return pack(samples)

    steps = [[[row() for _ in range(world)] for _ in range(cli.micro_batches)] for _ in range(cli.steps + 1)]
    trained = sum(r.num_trained for step in steps[1:] for micro_batch in step for r in micro_batch)
    for index, micro_batches in enumerate(steps):
        if index == 1:
            trainer.ranks.barrier()
            start = time.perf_counter()
        trainer.training_step(micro_batches)
        trainer.optimizer_step()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    trainer.ranks.barrier()
    seconds = time.perf_counter() - start
    if trainer.ranks.main:
        Path(cli.result).write_text(
            json.dumps(
                {
                    "world": world,
                    "seconds": seconds,
                    "trained": trained,
                    "params": sum(p.numel() for p in model.parameters()),
                }
            )
        )


def timed(processes: int, cli, result: Path) -> dict:
    """One run of `processes` ranks under torchrun; its rank 0's result."""
    flags = [
        "--layers",
        cli.layers,
        "--hidden",
        cli.hidden,
        "--row-tokens",
        cli.row_tokens,
        "--steps",
        cli.steps,
        "--micro-batches",
        cli.micro_batches,
        "--worker",
        "--result",
        result,
    ]
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={processes}", __file__]
    subprocess.run([*command, *map(str, flags)], check=True)
    return json.loads(result.read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=384)
    parser.add_argument("--row-tokens", type=int, default=1024)
    parser.add_argument("--micro-batches", type=int, default=2)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    add_markdown_flag(parser)
    cli = parser.parse_args()
    if cli.worker:
        return worker(cli)
    with tempfile.TemporaryDirectory() as tmp:
        runs = [timed(n, cli, Path(tmp) / f"{n}.json") for n in (1, 2)]
    rates = [run["trained"] / run["seconds"] for run in runs]
    print(
        f"\nmodel: {cli.layers} layers, hidden {cli.hidden}, {runs[0]['params'] / 1e6:.1f}M parameters (fp32); "
        f"{cli.steps} steps of {cli.micro_batches} micro-batches, one {cli.row_tokens}-token row per rank each"
    )
    emit(
        markdown_table(
            ["processes", "trained tokens per step", "seconds per step", "trained tokens/s", "vs 1 process"],
            "rrrrr",
            [
                [
                    str(run["world"]),
                    str(run["trained"] // cli.steps),
                    f"{run['seconds'] / cli.steps:.2f}",
                    f"{rate:.0f}",
                    f"{rate / rates[0]:.2f}x",
                ]
                for run, rate in zip(runs, rates)
            ],
        ),
        cli.markdown,
    )


if __name__ == "__main__":
    main()
