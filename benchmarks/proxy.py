"""`tandem proxy` on a rollout workload: routing fractions, prefill saved, and the latency it adds.

Two replicas stand in for generation servers: each answers a completion after a short delay and keeps an
unbounded prefix cache of 16-token blocks, counting the prompt tokens it would have to prefill. The
workload is the rollout worker's: P prompts (a shared 32-token chat template + 96 own tokens), G=8
requests per prompt sent as separate requests, C in flight. The same requests go once through the proxy
and once round-robin straight to the replicas. Printed: affinity / spilled / unmatched fractions (unmatched
counts the new prompts, 1/G of the requests, and the later rollouts of prompts every replica already
holds, which still hit a cache), prefill tokens computed vs round-robin (what routing saves), and the latency the
proxy adds per request (p50, p99) against direct calls to an instant replica.

    python benchmarks/proxy.py [--prompts 64] [--concurrency 32] [--delay-ms 20] [--markdown PATH]
"""

import argparse
import asyncio
import random
import statistics
import time

import aiohttp
from aiohttp import web
from aiohttp.test_utils import TestServer
from tables import add_markdown_flag, emit, markdown_table

from tandem.proxy.app import ProxyArgs, start_proxy
from tandem.proxy.router import PrefixRouter

G = 8


class Replica:
    """Answers after `delay_s`; counts the prefill a prefix cache of whole 16-token blocks would leave to do."""

    def __init__(self, delay_s: float):
        self.delay_s = delay_s
        self.cached: set[bytes] = set()
        self.prefill_tokens = 0
        self.hasher = PrefixRouter(1)
        app = web.Application()
        app.router.add_post("/v1/completions", self.complete)
        self.server = TestServer(app)

    async def complete(self, request: web.Request) -> web.Response:
        prompt = (await request.json())["prompt"]
        hashes = self.hasher.block_hashes("", prompt)
        hit = next((i for i, h in enumerate(hashes) if h not in self.cached), len(hashes))
        self.prefill_tokens += len(prompt) - 16 * hit
        self.cached.update(hashes)
        if self.delay_s:
            await asyncio.sleep(self.delay_s * random.uniform(0.5, 1.5))
        return web.json_response({"choices": [{"token_ids": [1]}]})


def workload(prompts: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    template = [rng.randrange(50_000) for _ in range(32)]
    own = [[rng.randrange(50_000) for _ in range(96)] for _ in range(prompts)]
    requests = [template + own[p] for p in range(prompts) for _ in range(G)]
    # Requests of a prompt arrive close together but interleaved with other prompts', as a worker sends them.
    return [r for _, r in sorted(enumerate(requests), key=lambda x: x[0] // G + rng.random() * 3)]


async def run(urls, requests, concurrency: int) -> None:
    semaphore = asyncio.Semaphore(concurrency)
    async with aiohttp.ClientSession() as session:

        async def one(i, prompt):
            async with (
                semaphore,
                session.post(urls[i % len(urls)] + "/v1/completions", json={"model": "policy", "prompt": prompt}) as r,
            ):
                await r.read()

        await asyncio.gather(*(one(i, p) for i, p in enumerate(requests)))


async def latencies(url: str, n: int) -> list[float]:
    out = []
    async with aiohttp.ClientSession() as session:
        for i in range(n):
            start = time.perf_counter()
            async with session.post(url + "/v1/completions", json={"model": "m", "prompt": [i % 500] * 64}) as r:
                await r.read()
            out.append(time.perf_counter() - start)
    return out


async def main(args) -> None:
    requests = workload(args.prompts)
    prompt_tokens = sum(len(r) for r in requests)

    routed = [Replica(args.delay_ms / 1000) for _ in range(2)]
    for r in routed:
        await r.server.start_server()
    runner, port = await start_proxy(ProxyArgs(upstreams=[str(r.server.make_url("")) for r in routed], port=0))
    await run([f"http://127.0.0.1:{port}"], requests, args.concurrency)
    async with aiohttp.ClientSession() as s, s.get(f"http://127.0.0.1:{port}/proxy/stats") as response:
        stats = (await response.json())["router"]
    await runner.cleanup()

    round_robin = [Replica(args.delay_ms / 1000) for _ in range(2)]
    for r in round_robin:
        await r.server.start_server()
    await run([str(r.server.make_url("")) for r in round_robin], requests, args.concurrency)

    instant = Replica(0.0)
    await instant.server.start_server()
    runner, port = await start_proxy(ProxyArgs(upstreams=[str(instant.server.make_url(""))], port=0))
    direct = await latencies(str(instant.server.make_url("")), args.latency_requests)
    proxied = await latencies(f"http://127.0.0.1:{port}", args.latency_requests)
    await runner.cleanup()
    for r in routed + round_robin + [instant]:
        await r.server.close()

    n = stats["routed"]
    prefill = sum(r.prefill_tokens for r in routed)
    baseline = sum(r.prefill_tokens for r in round_robin)
    print(
        f"{args.prompts} prompts x G={G} = {n} requests, {args.concurrency} in flight, 2 replicas, {prompt_tokens} prompt tokens"
    )
    added = [1000 * (proxy - plain) for proxy, plain in zip(percentiles(proxied), percentiles(direct))]
    emit(
        markdown_table(
            [
                "affinity",
                "spilled",
                f"unmatched (new prompts: 1/G = {100 / G:.1f}%)",
                "prefill tokens, proxy",
                "prefill tokens, round-robin",
                "proxy / round-robin",
                "added latency p50",
                "added latency p99",
            ],
            "rrrrrrrr",
            [
                [
                    f"{100 * stats['affinity'] / n:.1f}%",
                    f"{100 * stats['spilled'] / n:.1f}%",
                    f"{100 * stats['unmatched'] / n:.1f}%",
                    str(prefill),
                    str(baseline),
                    f"{prefill / baseline:.2f}x",
                    f"{added[0]:.2f} ms",
                    f"{added[1]:.2f} ms",
                ]
            ],
        ),
        args.markdown,
    )


def percentiles(seconds: list[float]) -> tuple[float, float]:
    """The 50th and 99th percentiles."""
    q = statistics.quantiles(seconds, n=100)
    return q[49], q[98]


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--delay-ms", type=float, default=20.0, help="a replica's time per request")
    parser.add_argument("--latency-requests", type=int, default=500)
    add_markdown_flag(parser)
    asyncio.run(main(parser.parse_args()))
