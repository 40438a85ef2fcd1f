"""Start `tandem serve` on the built-in tiny model, ask it arithmetic questions, stop it.

    python examples/serve_and_ask.py [--questions 32]

The same client code talks to `vllm serve`: only the URL changes.
"""

import argparse
import asyncio
import time

from transformers import AutoTokenizer

from tandem.generation.client import ControlClient, GenerationClient
from tandem.generation.launcher import EmbeddedServer
from tandem.tasks import TINY_MODEL_PATH, arithmetic


async def ask(url: str, n: int) -> None:
    tokenizer = AutoTokenizer.from_pretrained(TINY_MODEL_PATH)
    rows = arithmetic.make_rows(n, split="test", seed=0)
    async with ControlClient(url) as control, GenerationClient(url) as client:
        await control.wait_healthy(deadline_s=60)
        prompts = [
            tokenizer.apply_chat_template(r["prompt"], add_generation_prompt=True, tokenize=True, return_dict=False)
            for r in rows
        ]
        start = time.perf_counter()
        results = await asyncio.gather(*[client.complete(list(p), max_tokens=8, seed=i) for i, p in enumerate(prompts)])
        elapsed = time.perf_counter() - start
        metrics = await control.metrics()
    correct = 0
    for row, [completion] in zip(rows, results):
        text = tokenizer.decode(completion.token_ids, skip_special_tokens=True)
        ok = arithmetic.is_correct(text, row["solution"])
        correct += ok
        logprob = sum(completion.logprobs)
        print(f"{row['prompt'][0]['content']:<22} -> {text:<6} {'ok ' if ok else 'bad'}  log p = {logprob:7.3f}")
    tokens = sum(len(c.token_ids) for [c] in results)
    print(
        f"\n{correct}/{n} correct at temperature 1.0; {tokens} tokens in {elapsed:.2f}s ({tokens / elapsed:.0f} tok/s, {n} concurrent requests)"
    )
    print(
        f"server: {metrics.kv_capacity_tokens} KV tokens, {metrics.running} running, {metrics.preemptions} preemptions"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--questions", type=int, default=32)
    args = parser.parse_args()
    with EmbeddedServer("tiny", extra_args=["--logprobs-mode", "processed_logprobs"]) as server:
        print(f"tandem serve is up at {server.url}\n")
        asyncio.run(ask(server.url, args.questions))


if __name__ == "__main__":
    main()
