"""`tandem proxy`: one vLLM-protocol endpoint in front of several generation servers.

Generation requests are routed by prompt prefix (router.py): token ids as sent, chat `messages` rendered to
token ids with `--tokenizer` (by their text otherwise), and a `/v1/completions` batch split into one request
per prompt, each routed on its own, the answers merged back in order. Control calls are broadcast: `/pause`,
`/resume`, `/reset_prefix_cache` (the router forgets what the replicas held), `/v1/unload_lora_adapter`,
`/collective_rpc` (a `reload_weights` from a shared path reaches every replica); the four weight-transfer routes
fan out with each replica's rank offset in one group (`weight_transfer`);
`/v1/load_lora_adapter` is all-or-nothing — a replica answering "No adapter found" (its mount has not seen
the directory yet) is retried until a deadline, any other failure unloads the adapter from the replicas
that took it. `/health` is 200 only when every replica is (the proxy serves on those that are up meanwhile); `/metrics` concatenates the replicas' metrics
with a `replica` label (the trainer's concurrency cap sums them) plus `tandem_proxy:*` totals; other reads
go to the first replica that answers.

A replica that refuses a connection (or fails 3 times in a row) is down: the router forgets its blocks (a restart
empties its cache), its generation requests go to the others (a request that failed on it is sent again), and it
is left out of broadcasts, adapter loads and weight transfers. Every `probe_interval_s` a down replica's `/health`
is asked; once it answers, it is brought to the current weights before it gets traffic again: the last
`reload_weights` and the adapters loaded now are replayed on it; with a weight-transfer group it waits instead for
the trainer to form the group again (the next `/start_weight_update` answers 409 while the replicas differ from the
group's, which makes the trainer join anew) and is routed to once a transfer has finished on it.
"""

import asyncio
import json
import math
from dataclasses import dataclass

import aiohttp
from aiohttp import web

from tandem.httpapp import api_key_auth, error_body, start_app
from tandem.proxy.broadcasts import Broadcasts
from tandem.proxy.messages import end_to_end, error, load_lines, merge_completions, prompt_of, replica_load, split_batch
from tandem.proxy.replicas import Replicas, State, Upstream
from tandem.proxy.router import PrefixRouter

ROUTED = ("/v1/completions", "/v1/chat/completions", "/inference/v1/generate")
BROADCAST = ("/pause", "/resume", "/reset_prefix_cache", "/v1/unload_lora_adapter", "/collective_rpc")
WEIGHT_TRANSFER = ("/init_weight_transfer_engine", "/start_weight_update", "/update_weights", "/finish_weight_update")


@dataclass
class ProxyArgs:
    upstreams: list[str]
    host: str = "127.0.0.1"
    port: int = 8000
    block_size: int = 16
    imbalance: int = 8
    lora_retry_s: float = 2.0
    lora_load_timeout_s: float = 300.0
    connect_timeout_s: float = 10.0
    api_key: str | None = None
    upstream_api_key: str | None = None
    tokenizer: str | None = None
    """Renders chat `messages` to the token ids the replicas will cache, so they share blocks with token prompts."""
    stats_interval_s: float = 60.0
    """Print `[proxy] stats {json}` (each replica's load, the router's counts) this often; <= 0: never."""
    probe_interval_s: float = 1.0
    """How often a down replica's /health is asked."""


class Proxy:
    def __init__(self, args: ProxyArgs):
        if not args.upstreams:
            raise ValueError("tandem proxy needs at least one --upstream URL")
        if not args.probe_interval_s > 0:
            raise ValueError(f"--probe-interval-s {args.probe_interval_s:g}: must be a positive number of seconds")
        self.args = args
        self.router = PrefixRouter(len(args.upstreams), args.block_size, args.imbalance)
        self.replicas = Replicas(args.upstreams, self.router, args.upstream_api_key, args.probe_interval_s)
        self.upstreams = self.replicas.upstreams
        self.broadcasts = Broadcasts(self.replicas, args.lora_retry_s, args.lora_load_timeout_s)
        self.stats_task: asyncio.Task | None = None
        self.probe_task: asyncio.Task | None = None
        self.tokenizer = None
        if args.tokenizer:
            from transformers import AutoTokenizer  # only with --tokenizer: the proxy starts fast without it

            self.tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)

    def app(self) -> web.Application:
        app = web.Application(client_max_size=1 << 30, middlewares=[api_key_auth(self.args.api_key)])
        app.on_startup.append(self._start)
        app.on_cleanup.append(self._stop)
        app.router.add_route("*", "/proxy/stats", self.stats)
        app.router.add_route("*", "/health", self.health)
        app.router.add_get("/metrics", self.metrics)
        app.router.add_post("/v1/load_lora_adapter", self.broadcasts.load_lora)
        for path in ROUTED:
            app.router.add_post(path, self.routed)
        for path in BROADCAST:
            app.router.add_route("*", path, self.broadcasts.broadcast)
        app.router.add_get("/get_world_size", self.broadcasts.world_size)
        for path in WEIGHT_TRANSFER:
            app.router.add_post(path, self.broadcasts.weight_transfer)
        app.router.add_route("*", "/{tail:.*}", self.forward)
        return app

    async def _start(self, _app) -> None:
        self.replicas.open(self.args.connect_timeout_s)
        if self.args.stats_interval_s > 0:
            self.stats_task = asyncio.create_task(self._print_stats())
        self.probe_task = asyncio.create_task(self.replicas.probe_down())

    async def _stop(self, _app) -> None:
        for task in (self.stats_task, self.probe_task):
            if task is not None:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
        await self.replicas.http.close()

    def _stats(self) -> dict:
        return {
            "upstreams": [
                {"url": u.url, "state": u.state, "inflight": u.inflight, "routed": u.routed} for u in self.upstreams
            ],
            "router": self.router.stats(),
        }

    async def _print_stats(self) -> None:
        """The `[proxy] stats` line, every `stats_interval_s`: per-replica load and the router's counts."""
        while True:
            await asyncio.sleep(self.args.stats_interval_s)
            print(f"[proxy] stats {json.dumps(self._stats())}", flush=True)

    async def routed(self, request: web.Request) -> web.StreamResponse:
        raw = await request.read()
        try:
            body = json.loads(raw)
        except json.JSONDecodeError as exc:
            return error(400, f"proxy: the request body is not valid JSON: {exc}")
        if not isinstance(body, dict):
            return error(400, "proxy: the request body must be a JSON object")
        if body.get("stream") is True:
            return await self._route_stream(request, body, raw)
        parts = split_batch(request.path, body)
        if parts is None:
            status, headers, data, replica = await self._route(request, body, raw)
            return web.Response(status=status, body=data, headers={**headers, "X-Proxy-Upstream": str(replica)})
        answers = await asyncio.gather(*(self._route(request, part, json.dumps(part).encode()) for part in parts))
        replicas = ",".join(str(replica) for *_, replica in answers)
        failed = next((a for a in answers if a[0] != 200), None)
        if failed:  # vLLM fails a batch as a whole: the first failing prompt's answer stands for it
            status, headers, data, _ = failed
            return web.Response(status=status, body=data, headers={**headers, "X-Proxy-Upstream": replicas})
        merged = merge_completions([json.loads(data) for _, _, data, _ in answers], int(body.get("n") or 1))
        return web.json_response(merged, headers={"X-Proxy-Upstream": replicas})

    def _choose(self, request: web.Request, body: dict) -> Upstream:
        """The replica the router picks for this request's prompt among those up (counted as routed)."""
        load = [u.inflight if u.state == State.UP else math.inf for u in self.upstreams]  # never chosen while one is up
        decision = self.router.choose(str(body.get("model") or ""), prompt_of(request.path, body, self.tokenizer), load)
        upstream = self.upstreams[decision.replica]
        upstream.routed += 1
        return upstream

    async def _route(self, request: web.Request, body: dict, raw: bytes) -> tuple[int, dict, bytes, int]:
        """Send one generation request to the replica the router picks for its prompt; one that goes down meanwhile
        has it sent to another (the request is seeded: it is generated alike)."""
        while True:
            upstream = self._choose(request, body)
            upstream.inflight += 1
            try:
                status, headers, data = await self.replicas.send(
                    upstream, "POST", request.path_qs, raw, request.headers
                )
            finally:
                upstream.inflight -= 1
            if not (
                status == 502 and upstream.state == State.DOWN and any(u.state == State.UP for u in self.upstreams)
            ):
                return status, headers, data, self.upstreams.index(upstream)

    async def _route_stream(self, request: web.Request, body: dict, raw: bytes) -> web.StreamResponse:
        """A streamed request, routed as any other (a batch whole, by its first prompt) and passed back chunk by chunk
        as the replica writes them. A replica that fails before answering is a 502; one that fails mid-stream ends the
        stream with an error event and `[DONE]`, as vLLM ends a failed stream. A client that leaves is noticed at the
        next chunk: the replica's connection is closed, which aborts its request."""
        upstream = self._choose(request, body)
        upstream.inflight += 1
        try:
            try:
                answer = await self.replicas.http.post(
                    upstream.url + request.path_qs, data=raw, headers=self.replicas.outgoing(request.headers)
                )
            except (TimeoutError, aiohttp.ClientError) as exc:
                return error(502, self.replicas.failed(upstream, exc))
            async with answer:
                upstream.failures = 0
                response = web.StreamResponse(
                    status=answer.status,
                    headers={**end_to_end(answer.headers), "X-Proxy-Upstream": str(self.upstreams.index(upstream))},
                )
                await response.prepare(request)
                try:
                    async for data in answer.content.iter_any():
                        await response.write(data)
                except ConnectionResetError:  # the client left (aiohttp's reset error is also a ClientError)
                    return response
                except (TimeoutError, aiohttp.ClientError) as exc:
                    failure = error_body(502, self.replicas.failed(upstream, exc), "BadGateway")
                    await response.write(b"data: " + json.dumps(failure).encode() + b"\n\ndata: [DONE]\n\n")
                await response.write_eof()
                return response
        finally:
            upstream.inflight -= 1

    async def health(self, request: web.Request) -> web.Response:
        """200 only when every replica is healthy, else 503 (or the first unhealthy one's 5xx) naming them.
        The proxy still serves on the replicas that are up: /proxy/stats says which (the trainer reads it)."""
        members = self.replicas.members()
        results = await self.replicas.send_all(request, b"", members)
        bad: list[tuple[str, int | str]] = [(u.url, r[0]) for u, r in zip(members, results) if r[0] != 200]
        bad += [(u.url, "down") for u in self.upstreams if u.state == State.DOWN]
        if not bad:
            return web.Response(status=200)
        serving = len(self.upstreams) - len(bad)
        status = next((code for _, code in bad if isinstance(code, int) and code >= 500), 503)
        return web.Response(
            status=status,
            text=f"proxy: {len(bad)}/{len(self.upstreams)} servers unhealthy, serving on "
            f"{serving}; first: {bad[0][0]} -> {bad[0][1]}",
        )

    async def metrics(self, request: web.Request) -> web.Response:
        results = await self.replicas.send_all(request, b"")
        lines, seen, loads = [], set(), {}
        for index, (status, _, data) in enumerate(results):
            if status != 200:
                continue
            text = data.decode()
            loads[index] = replica_load(text)
            for line in text.splitlines():
                if line.startswith("#"):
                    if line not in seen:
                        seen.add(line)
                        lines.append(line)
                elif "{" in line:
                    lines.append(line.replace("{", f'{{replica="{index}",', 1))
                elif line.strip():
                    name, value = line.split(None, 1)
                    lines.append(f'{name}{{replica="{index}"}} {value}')
        lines += load_lines(loads)
        return web.Response(text="\n".join(lines) + "\n", content_type="text/plain")

    async def stats(self, _: web.Request) -> web.Response:
        return web.json_response(self._stats())

    async def forward(self, request: web.Request) -> web.Response:
        """Reads any replica can answer for all (models, server_info, tokenize, ...): the first one that answers."""
        raw = await request.read()
        for upstream in self.upstreams:
            status, headers, data = await self.replicas.send(
                upstream, request.method, request.path_qs, raw or None, request.headers
            )
            if status != 502:
                return web.Response(status=status, body=data, headers=headers)
        return web.Response(status=502, body=data, headers=headers)


async def start_proxy(args: ProxyArgs) -> tuple[web.AppRunner, int]:
    """Start the proxy in the running event loop; returns the runner and the bound port (for --port 0)."""
    return await start_app(Proxy(args).app(), args.host, args.port)
