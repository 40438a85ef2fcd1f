"""Generated tokens/s of `tandem serve` at 1, 8 and 64 concurrent requests vs transformers' `generate()`.

Both sides get the same prompts (built-in arithmetic chats) and the same output lengths (varied,
EOS ignored so the lengths are exact), sampling at temperature 1.0 on the same model and threads.
`generate()` runs static batches of the concurrency's size: each batch lasts as long as its longest
request, which is what continuous batching avoids. Only the requested tokens count on both sides.
The server runs in both decode modes: `exact` (log-probs bitwise equal to a full forward, the CPU
default) and `fast` (SDPA, one query row per step).

Each figure is the median of `--repeats` interleaved runs (this machine's speed varies by ±20% from run to run).

    python benchmarks/serve_throughput.py [--requests 64] [--min-tokens 16] [--max-tokens 128] [--repeats 3] [--markdown PATH]
"""

import argparse
import asyncio
import random
import statistics
import time

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from tandem.generation.client import ControlClient, GenerationClient
from tandem.generation.launcher import EmbeddedServer
from tandem.tasks import TINY_MODEL_PATH, arithmetic

from tables import add_markdown_flag, emit, markdown_table


def workload(tokenizer, n: int, min_tokens: int, max_tokens: int, seed: int = 0) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    rows = arithmetic.make_rows(n, seed=seed)
    prompts = [list(tokenizer.apply_chat_template(r["prompt"], add_generation_prompt=True, tokenize=True, return_dict=False)) for r in rows]
    return [(p, rng.randint(min_tokens, max_tokens)) for p in prompts]


async def wait_ready(url: str) -> None:
    async with ControlClient(url) as control:
        await control.wait_healthy(60)


async def serve_rate(url: str, jobs, concurrency: int) -> float:
    """Tokens/s with at most `concurrency` requests in flight (a new one starts as soon as one ends)."""
    semaphore = asyncio.Semaphore(concurrency)
    async with GenerationClient(url) as client:
        async def one(i, prompt, length):
            async with semaphore:
                [c] = await client.complete(prompt, max_tokens=length, seed=i, ignore_eos=True)
                return len(c.token_ids)

        await one(0, jobs[0][0], 4)  # warm-up
        start = time.perf_counter()
        tokens = await asyncio.gather(*[one(i, p, n) for i, (p, n) in enumerate(jobs)])
        return sum(tokens) / (time.perf_counter() - start)


@torch.inference_mode()
def generate_rate(model, tokenizer, jobs, batch_size: int) -> float:
    tokenizer.padding_side = "left"
    useful, start = 0, time.perf_counter()
    for i in range(0, len(jobs), batch_size):
        batch = jobs[i : i + batch_size]
        width = max(len(p) for p, _ in batch)
        ids = torch.tensor([[tokenizer.pad_token_id] * (width - len(p)) + p for p, _ in batch])
        mask = (torch.arange(width)[None, :] >= torch.tensor([width - len(p) for p, _ in batch])[:, None]).long()
        longest = max(n for _, n in batch)
        model.generate(input_ids=ids, attention_mask=mask, do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                       max_new_tokens=longest, min_new_tokens=longest, pad_token_id=tokenizer.pad_token_id)
        useful += sum(n for _, n in batch)
    return useful / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=64, help="requests per concurrency level (16 at concurrency 1)")
    parser.add_argument("--min-tokens", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3, help="runs of each measurement, interleaved; the median is reported")
    add_markdown_flag(parser)
    args = parser.parse_args()
    tokenizer = AutoTokenizer.from_pretrained(TINY_MODEL_PATH)
    model = AutoModelForCausalLM.from_pretrained(TINY_MODEL_PATH, dtype=torch.float32, attn_implementation="sdpa").eval()
    levels = (1, 8, 64)
    jobs = {c: workload(tokenizer, 16 if c == 1 else args.requests, args.min_tokens, args.max_tokens, seed=c) for c in levels}
    runs = {key: [] for key in [(side, c) for side in ("exact", "fast", "generate") for c in levels]}
    # Both servers stay up (idle, they cost nothing) so that the three sides' runs interleave and share the
    # machine's slow and fast moments alike; each runs as `tandem serve` alone (OpenMP's default waiting).
    servers = {mode: EmbeddedServer("tiny", extra_args=["--logprobs-mode", "processed_logprobs", "--decode-mode", mode],
                                    shares_cores=False) for mode in ("exact", "fast")}
    try:
        for server in servers.values():
            asyncio.run(wait_ready(server.url))
        for repeat in range(args.repeats):
            for c in levels:
                for mode, server in servers.items():
                    runs[mode, c].append(asyncio.run(serve_rate(server.url, jobs[c], c)))
                runs["generate", c].append(generate_rate(model, tokenizer, jobs[c], c))
                print(f"run {repeat + 1}, concurrency {c:3d}: " + ", ".join(
                    f"{side} {runs[side, c][-1]:.0f}" for side in ("exact", "fast", "generate")) + " tok/s", flush=True)
    finally:
        for server in servers.values():
            server.stop()
    rate = {key: statistics.median(values) for key, values in runs.items()}
    emit(markdown_table(
        ["concurrent requests", "`tandem serve` exact (tok/s)", "`tandem serve` fast (tok/s)",
         "`generate()`, static batches (tok/s)", "exact / generate", "fast / generate"], "rrrrrr",
        [[str(c), f"{rate['exact', c]:.0f}", f"{rate['fast', c]:.0f}", f"{rate['generate', c]:.0f}",
          f"{rate['exact', c] / rate['generate', c]:.2f}x", f"{rate['fast', c] / rate['generate', c]:.2f}x"]
         for c in levels]), args.markdown)


if __name__ == "__main__":
    main()
