"""LoRA training of the tiny model with two `tandem serve` replicas behind `tandem proxy`, on one machine.

    python examples/lora_two_replicas.py              (about 4 minutes on 2 CPU cores)

Starts two replicas with adapters enabled, `tandem proxy` in front of them, and trains a LoRA adapter on
arithmetic-small through the proxy. Each sync publishes only the adapter (a few hundred KB) as
`tandem-policy-v{N}`, which the proxy loads on both replicas or on neither; each group's rollouts go to the
replica that already holds its prompt's KV blocks. With real engines the replicas are `vllm serve` processes
started with the flags of `replica_flags` (each with --data-parallel-size 1: the proxy is the data-parallel layer).
"""

import argparse
import json
import urllib.request
from contextlib import ExitStack
from pathlib import Path

from peft import LoraConfig

from tandem import AsyncGRPOConfig, AsyncGRPOTrainer
from tandem.contract.staleness import StalenessPolicy
from tandem.generation.launcher import EmbeddedProxy, EmbeddedServer
from tandem.rewards import accuracy_reward
from tandem.runtime.weight_sync import lora_server_flags
from tandem.tasks import TINY_MODEL_PATH, datasets


def replica_flags(max_staleness: int, rank: int) -> list[str]:
    """What the trainer needs from each replica: its model name, processed log-probs, and room for the
    max_staleness + 1 adapter versions in use plus the one being loaded."""
    return [
        "--served-model-name",
        TINY_MODEL_PATH,
        "--logprobs-mode",
        "processed_logprobs",
        "--max-logprobs",
        "20",
        *lora_server_flags(StalenessPolicy(max_staleness), rank),
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--output-dir", default="runs/lora_two_replicas")
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--max-staleness", type=int, default=2)
    cli = parser.parse_args()

    output = Path(cli.output_dir)
    output.mkdir(parents=True, exist_ok=True)
    lora = LoraConfig(
        r=8,
        lora_alpha=16,
        lora_dropout=0.0,
        target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
    )
    args = AsyncGRPOConfig(
        output_dir=str(output),
        max_steps=cli.steps,
        learning_rate=2e-3,
        gradient_accumulation_steps=2,
        num_generations=8,
        max_completion_length=8,
        max_staleness=cli.max_staleness,
        token_budget=160,
        gradient_checkpointing=False,
        save_steps=50,
        logging_steps=1,
        weight_sync_check_atol=1e-5,  # every sync: both replicas serve exactly the adapter
    )
    dataset = datasets.load("arithmetic-small")  # the demo's 128 problems

    with ExitStack() as stack:
        print(f"starting {cli.replicas} tandem serve replicas and tandem proxy (logs in {output})", flush=True)
        replicas = [
            stack.enter_context(
                EmbeddedServer(
                    TINY_MODEL_PATH,
                    log_path=output / f"replica{i}.log",
                    extra_args=replica_flags(cli.max_staleness, lora.r),
                )
            )
            for i in range(cli.replicas)
        ]
        proxy = stack.enter_context(
            EmbeddedProxy(
                [r.url for r in replicas], log_path=output / "proxy.log", extra_args=["--tokenizer", TINY_MODEL_PATH]
            )
        )
        args.vllm_server_base_url = proxy.url
        result = AsyncGRPOTrainer(
            TINY_MODEL_PATH, accuracy_reward, args=args, train_dataset=dataset, peft_config=lora
        ).train()
        with urllib.request.urlopen(proxy.url + "/proxy/stats") as response:
            stats = json.load(response)
    (output / "proxy_stats.json").write_text(json.dumps(stats, indent=1))

    rewards = [json.loads(line).get("reward") for line in open(output / "metrics.jsonl")]
    rewards = [r for r in rewards if r is not None]
    head, tail = rewards[:20], rewards[-20:]
    router = stats["router"]
    print(f"\ntrained {result.global_step} steps; adapter checkpoints in {output}")
    print(
        f"mean reward, first {len(head)} steps: {sum(head) / len(head):.3f}   last {len(tail)} steps: {sum(tail) / len(tail):.3f}"
    )
    print(
        f"proxy: {router['routed']} requests: affinity {router['affinity']}, spilled {router['spilled']}, unmatched "
        f"{router['unmatched']}; per replica {[u['routed'] for u in stats['upstreams']]}"
    )


if __name__ == "__main__":
    main()
