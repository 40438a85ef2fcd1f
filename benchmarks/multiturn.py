"""Multi-turn tool conversations against `tandem serve`, with and without its prefix cache.

16 arithmetic conversations with a `calculator` tool in the chat template run concurrently, 4 turns each.
Every turn renders the whole conversation so far (`apply_chat_template(..., tools=..., add_generation_prompt=True)`),
generates up to 24 tokens through `/v1/completions` with the token ids, then appends the assistant's reply and
the calculator's answer as a tool message. The same seeded workload runs once on a server with the prefix
cache (the default) and once with `--no-enable-prefix-caching`. Printed per mode: prompt tokens sent, prompt
tokens the server prefilled (`vllm:prompt_tokens_total - vllm:prefix_cache_hits_total`), generated tokens/s,
and the packing ratio of the training rows: each conversation's turns reconciled into samples, packed into
prefix-trie rows of at most `--token-budget` tokens, tokens before packing / tokens packed. The goal is at
least 3x fewer prefilled tokens with the cache.

    python benchmarks/multiturn.py [--conversations 16] [--turns 4] [--max-tokens 24] [--token-budget 2048] [--markdown PATH]
"""

import argparse
import asyncio
import time

from tables import add_markdown_flag, emit, markdown_table
from transformers import AutoTokenizer

from tandem.contract.records import Sample, TurnRecord
from tandem.generation.client import ControlClient, GenerationClient, parse_prometheus
from tandem.generation.launcher import EmbeddedServer
from tandem.packing.batching import TokenBudgetBatcher
from tandem.rollout.reconcile import reconcile
from tandem.tasks import TINY_MODEL_PATH, arithmetic

CALCULATOR = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression such as 37 + 48.",
        "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]},
    },
}


async def conversation(
    client: GenerationClient, tokenizer, row: dict, index: int, turns: int, max_tokens: int
) -> list[TurnRecord]:
    """One conversation, turn by turn; each turn's record holds the whole prompt it sent."""
    messages, records = list(row["prompt"]), []
    for turn in range(turns):
        prompt = list(
            tokenizer.apply_chat_template(
                messages, tools=[CALCULATOR], add_generation_prompt=True, tokenize=True, return_dict=False
            )
        )
        [c] = await client.complete(prompt, max_tokens=max_tokens, seed=1000 * index + turn)
        records.append(
            TurnRecord(
                prompt_ids=prompt, output_ids=c.token_ids, output_log_probs=c.logprobs, finish_reason=c.finish_reason
            )
        )
        reply = c.token_ids[:-1] if c.finish_reason == "stop" else c.token_ids  # the stop token is the template's
        messages += [
            {"role": "assistant", "content": tokenizer.decode(reply)},
            {"role": "tool", "content": row["solution"]},
        ]
    return records


async def counters(url: str) -> dict[str, float]:
    async with ControlClient(url) as control:
        _, text = await control.request("GET", "/metrics")
    return {name: value for name, _, value in parse_prometheus(text)}


async def run_workload(
    url: str, tokenizer, rows: list[dict], args
) -> tuple[list[list[TurnRecord]], dict[str, float], float]:
    """All conversations at once; returns their turns, the server's counter deltas and the wall time."""
    async with GenerationClient(url) as client:
        await client.complete([1, 274, 205, 277], max_tokens=4, seed=0)  # warm-up
        before, start = await counters(url), time.perf_counter()
        records = await asyncio.gather(
            *[conversation(client, tokenizer, row, i, args.turns, args.max_tokens) for i, row in enumerate(rows)]
        )
        seconds = time.perf_counter() - start
    after = await counters(url)
    return records, {name: after[name] - before.get(name, 0.0) for name in after}, seconds


def samples_of(conversations: list[list[TurnRecord]]) -> list[Sample]:
    """Each conversation's turns reconciled into training samples (one group per conversation)."""
    samples = []
    for group, turns in enumerate(conversations):
        sequences, _ = reconcile(turns)
        samples += [
            Sample(
                input_ids=s.input_ids,
                trained=s.trained,
                behavior_log_probs=s.behavior_log_probs,
                advantage=1.0,
                model_version=0,
                group_id=group,
                prompt_index=group,
                group_samples=len(sequences),
                rollout_id=str(group),
                created_at=0.0,
            )
            for s in sequences
        ]
    return samples


def packing_ratio(samples: list[Sample], budget: int) -> float:
    """Tokens before packing / tokens in the prefix-trie rows of the token-budget batcher."""
    batcher, rows = TokenBudgetBatcher(budget), []
    for sample in samples:
        if not batcher.offer(sample):
            rows += batcher.close()
            batcher.offer(sample)
    rows += batcher.close()
    return sum(s.num_tokens for s in samples) / sum(r.num_tokens for r in rows)


def measure(cached: bool, tokenizer, rows: list[dict], args) -> dict[str, float]:
    flags = ["--logprobs-mode", "processed_logprobs"] + ([] if cached else ["--no-enable-prefix-caching"])
    with EmbeddedServer("tiny", extra_args=flags) as server:
        conversations, delta, seconds = asyncio.run(run_workload(server.url, tokenizer, rows, args))
    generated = sum(len(t.output_ids) for turns in conversations for t in turns)
    result = {
        "prompt": delta["vllm:prompt_tokens_total"],
        "prefilled": delta["vllm:prompt_tokens_total"] - delta["vllm:prefix_cache_hits_total"],
        "rate": generated / seconds,
        "packing": packing_ratio(samples_of(conversations), args.token_budget),
    }
    print(
        f"prefix cache {'on ' if cached else 'off'}: {result['prompt']:.0f} prompt tokens, {result['prefilled']:.0f} prefilled, "
        f"{generated} generated in {seconds:.1f} s ({result['rate']:.0f} tok/s), packing ratio {result['packing']:.2f}",
        flush=True,
    )
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--conversations", type=int, default=16)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=24, help="tokens generated per turn at most")
    parser.add_argument("--token-budget", type=int, default=2048, help="tokens per packed training row")
    add_markdown_flag(parser)
    args = parser.parse_args()
    tokenizer = AutoTokenizer.from_pretrained(TINY_MODEL_PATH)
    rows = arithmetic.make_rows(args.conversations, seed=0)
    on, off = (measure(cached, tokenizer, rows, args) for cached in (True, False))
    emit(
        markdown_table(
            [
                "prefix cache",
                "prompt tokens",
                "prefilled tokens",
                "generated (tok/s)",
                "packing ratio (tokens / unique)",
            ],
            "lrrrr",
            [
                [
                    "on (default)",
                    f"{on['prompt']:.0f}",
                    f"{on['prefilled']:.0f}",
                    f"{on['rate']:.0f}",
                    f"{on['packing']:.2f}",
                ],
                [
                    "off (`--no-enable-prefix-caching`)",
                    f"{off['prompt']:.0f}",
                    f"{off['prefilled']:.0f}",
                    f"{off['rate']:.0f}",
                    f"{off['packing']:.2f}",
                ],
                [
                    "gain with the cache",
                    "",
                    f"{off['prefilled'] / on['prefilled']:.2f}x fewer",
                    f"{on['rate'] / off['rate']:.2f}x",
                    "",
                ],
            ],
        ),
        args.markdown,
    )


if __name__ == "__main__":
    main()
