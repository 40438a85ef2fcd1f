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
import enum
import json
import math
import time
from dataclasses import dataclass

import aiohttp
from aiohttp import web

from tandem.chat.prompts import render_chat
from tandem.generation.client import parse_metrics
from tandem.httpapp import api_key_auth, error_body, error_response, start_app
from tandem.proxy.router import PrefixRouter

ROUTED = ("/v1/completions", "/v1/chat/completions", "/inference/v1/generate")
BROADCAST = ("/pause", "/resume", "/reset_prefix_cache", "/v1/unload_lora_adapter", "/collective_rpc")
WEIGHT_TRANSFER = ("/init_weight_transfer_engine", "/start_weight_update", "/update_weights", "/finish_weight_update")
HOP_BY_HOP = {
    "host",
    "connection",
    "keep-alive",
    "proxy-authenticate",
    "proxy-authorization",
    "te",
    "trailers",
    "transfer-encoding",
    "upgrade",
    "content-length",
    "content-encoding",
    "authorization",
}


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


class State(enum.StrEnum):
    """Where a replica stands with the proxy."""

    UP = "up"
    """Routed to."""
    DOWN = "down"
    """Not answering: left out of everything until its /health answers."""
    BEHIND = "behind"
    """Back, but without the current weights: it joins weight transfers and gets no generation until one has finished
    on it."""


@dataclass
class Upstream:
    url: str
    inflight: int = 0
    """Generation requests in flight (control calls and probes are not load)."""
    routed: int = 0
    failures: int = 0
    state: State = State.UP


def failed_on(what: str, failed: list[tuple[Upstream, int, bytes]], total: int, note: str = "") -> str:
    """The one message for a call that failed on some replicas: how many, what, and the first failure's answer."""
    upstream, status, data = failed[0]
    return (
        f"proxy: {len(failed)}/{total} servers failed {what}{note}. First: {upstream.url} -> {status} "
        f"{data[:300].decode(errors='replace')}"
    )


def error(status: int, message: str) -> web.Response:
    kind = {
        400: "BadRequestError",
        401: "Unauthorized",
        501: "NotImplementedError",
        502: "BadGateway",
        503: "ServiceUnavailableError",
        504: "GatewayTimeout",
    }.get(status, "ProxyError")
    return error_response(status, message, kind)


def end_to_end(headers) -> dict:
    """The headers that pass through the proxy (hop-by-hop ones, and the length and encoding it sets anew, dropped)."""
    return {k: v for k, v in headers.items() if k.lower() not in HOP_BY_HOP}


def prompt_of(path: str, body: dict, tokenizer=None) -> list[int] | bytes:
    """What the router hashes: token ids when the request carries them (or when a tokenizer renders the chat
    messages), else the text's bytes."""
    prompt = body.get("token_ids") if path == "/inference/v1/generate" else body.get("prompt", body.get("messages"))
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], list):
        prompt = prompt[0]  # a batch the proxy could not split: its first prompt decides
    if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
        return prompt
    if isinstance(prompt, str):
        return prompt.encode()
    if (
        isinstance(prompt, list)
        and tokenizer is not None
        and (ids := rendered_chat(tokenizer, prompt, body)) is not None
    ):
        return ids
    if isinstance(prompt, list):  # chat messages: their text in order, so a conversation's turns share blocks
        return "".join(f"<{m.get('role')}>{m.get('content')}" for m in prompt if isinstance(m, dict)).encode()
    return b""


def rendered_chat(tokenizer, messages: list, body: dict) -> list[int] | None:
    """The token ids a replica renders a chat request to (its tools and template options included);
    None when the template refuses it, which is the replica's to reject, with its own error."""
    try:
        return render_chat(
            tokenizer,
            messages,
            tools=body.get("tools"),
            add_generation_prompt=body.get("add_generation_prompt", True),
            continue_final_message=body.get("continue_final_message", False),
            chat_template=body.get("chat_template"),
            chat_template_kwargs=body.get("chat_template_kwargs"),
        )
    except Exception:  # noqa: BLE001 - routing only: whatever the template refuses, the replica answers for
        return None


def split_batch(path: str, body: dict) -> list[dict] | None:
    """A `/v1/completions` body with several prompts, as one body per prompt; None for anything else."""
    prompt = body.get("prompt")
    if path != "/v1/completions" or body.get("stream") or not isinstance(prompt, list) or len(prompt) < 2:
        return None
    if all(isinstance(p, str) for p in prompt) or all(isinstance(p, list) for p in prompt):
        return [{**body, "prompt": p} for p in prompt]
    return None  # a single token-id prompt


def merge_completions(answers: list[dict], n: int) -> dict:
    """The per-prompt answers as the one answer vLLM gives a batch: choice i·n + j is prompt i's j-th, usage summed."""
    merged = dict(answers[0])
    merged["choices"] = [
        {**choice, "index": i * n + choice.get("index", 0)} for i, a in enumerate(answers) for choice in a["choices"]
    ]
    usage = [a.get("usage") or {} for a in answers]
    merged["usage"] = {
        **usage[0],
        **{k: sum(u.get(k) or 0 for u in usage) for k in ("prompt_tokens", "completion_tokens", "total_tokens")},
    }
    return merged


class Proxy:
    def __init__(self, args: ProxyArgs):
        if not args.upstreams:
            raise ValueError("tandem proxy needs at least one --upstream URL")
        if not args.probe_interval_s > 0:
            raise ValueError(f"--probe-interval-s {args.probe_interval_s:g}: must be a positive number of seconds")
        self.args = args
        self.upstreams = [Upstream(url.rstrip("/")) for url in args.upstreams]
        self.router = PrefixRouter(len(self.upstreams), args.block_size, args.imbalance)
        self.session: aiohttp.ClientSession | None = None
        self.stats_task: asyncio.Task | None = None
        self.transfer_failed = False
        """The open weight update failed on some replica: its finish tells every replica to discard it."""
        self.group: set[int] | None = None
        """The replicas in the weight-transfer group (None: no group formed)."""
        self.reload: bytes | None = None
        """The last `/collective_rpc` reload_weights body: what a replica that comes back replays."""
        self.adapters: dict[str, bytes] = {}
        """The adapters loaded now, by name, with their load body: what a replica that comes back loads."""
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
        app.router.add_post("/v1/load_lora_adapter", self.load_lora)
        for path in ROUTED:
            app.router.add_post(path, self.routed)
        for path in BROADCAST:
            app.router.add_route("*", path, self.broadcast)
        app.router.add_get("/get_world_size", self.world_size)
        for path in WEIGHT_TRANSFER:
            app.router.add_post(path, self.weight_transfer)
        app.router.add_route("*", "/{tail:.*}", self.forward)
        return app

    async def _start(self, _app) -> None:
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=self.args.connect_timeout_s)
        self.session = aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=1024))
        if self.args.stats_interval_s > 0:
            self.stats_task = asyncio.create_task(self._print_stats())
        self.probe_task = asyncio.create_task(self._probe_down())

    async def _stop(self, _app) -> None:
        for task in (self.stats_task, self.probe_task):
            if task is not None:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
        await self.session.close()

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

    def _outgoing(self, headers) -> dict:
        """A request's headers as sent on to a replica (hop-by-hop ones dropped, the replicas' key set)."""
        out = end_to_end(headers)
        if self.args.upstream_api_key:
            out["Authorization"] = f"Bearer {self.args.upstream_api_key}"
        return out

    def _failed(self, upstream: Upstream, exc: BaseException) -> str:
        """Count a transport failure and say what it was. A refused connection means the process is gone (restarting
        or dead), and one that keeps failing has likely restarted: either way it is down and its prefix cache gone."""
        upstream.failures += 1
        message = f"proxy: {upstream.url}: {type(exc).__name__}: {exc}"
        if (isinstance(exc, aiohttp.ClientConnectorError) or upstream.failures >= 3) and upstream.state != State.DOWN:
            upstream.state = State.DOWN
            self.router.forget(self.upstreams.index(upstream))
            print(
                f"[proxy] {upstream.url} is down ({type(exc).__name__}): its requests go to the other replicas; left "
                "out of weight syncs and adapter loads until it answers again",
                flush=True,
            )
        return message

    def _members(self) -> list[Upstream]:
        """The replicas control calls reach: all but the down ones."""
        return [u for u in self.upstreams if u.state != State.DOWN]

    async def _probe_down(self) -> None:
        """Ask each down replica's /health every probe_interval_s; bring one that answers to the current weights."""
        while True:
            await asyncio.sleep(self.args.probe_interval_s)
            for upstream in [u for u in self.upstreams if u.state == State.DOWN]:
                status, _, _ = await self._send(upstream, "GET", "/health", None, {})
                if status == 200:
                    await self._catch_up(upstream)

    async def _catch_up(self, upstream: Upstream) -> None:
        """Replay the last reload and the adapters loaded now on a replica that came back; with a transfer group it is
        "behind" until the trainer's next transfer reaches it, else up at once. A failed replay leaves it down."""
        calls = [("/collective_rpc", self.reload)] if self.reload else []
        calls += [("/v1/load_lora_adapter", body) for body in self.adapters.values()]
        for path, body in calls + [("/reset_prefix_cache", None)]:
            status, _, data = await self._send(upstream, "POST", path, body, {"Content-Type": "application/json"})
            if status != 200:
                print(
                    f"[proxy] {upstream.url} answers again but {path} failed ({status} {data[:200]!r}): still down",
                    flush=True,
                )
                return
        upstream.failures = 0
        upstream.state = State.BEHIND if self.group is not None else State.UP
        print(
            f"[proxy] {upstream.url} is back"
            + (
                ": it gets traffic once the trainer's next weight transfer reaches it"
                if upstream.state == State.BEHIND
                else ", with the current weights"
            ),
            flush=True,
        )

    async def _send(
        self, upstream: Upstream, method: str, path_qs: str, body: bytes | None, headers
    ) -> tuple[int, dict, bytes]:
        """One upstream call, fully buffered; a transport failure is a 502 naming the replica."""
        try:
            async with self.session.request(
                method, upstream.url + path_qs, data=body, headers=self._outgoing(headers), allow_redirects=False
            ) as r:
                data = await r.read()
                upstream.failures = 0
                return r.status, end_to_end(r.headers), data
        except (TimeoutError, aiohttp.ClientError, OSError) as exc:
            message = self._failed(upstream, exc)
            return (
                502,
                {"Content-Type": "application/json"},
                json.dumps(error_body(502, message, "BadGateway")).encode(),
            )

    async def routed(self, request: web.Request) -> web.Response:
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
                status, headers, data = await self._send(upstream, "POST", request.path_qs, raw, request.headers)
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
                answer = await self.session.post(
                    upstream.url + request.path_qs, data=raw, headers=self._outgoing(request.headers)
                )
            except (TimeoutError, aiohttp.ClientError) as exc:
                return error(502, self._failed(upstream, exc))
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
                    failure = error_body(502, self._failed(upstream, exc), "BadGateway")
                    await response.write(b"data: " + json.dumps(failure).encode() + b"\n\ndata: [DONE]\n\n")
                await response.write_eof()
                return response
        finally:
            upstream.inflight -= 1

    async def _all(
        self, request: web.Request, raw: bytes | None = None, upstreams=None
    ) -> list[tuple[int, dict, bytes]]:
        raw = await request.read() if raw is None else raw
        return await asyncio.gather(
            *(
                self._send(u, request.method, request.path_qs, raw or None, request.headers)
                for u in (self.upstreams if upstreams is None else upstreams)
            )
        )

    async def broadcast(self, request: web.Request) -> web.Response:
        members, raw = self._members(), await request.read()
        if not members:
            return error(502, f"proxy: every replica is down; {request.path} reached none")
        results = await self._all(request, raw, members)
        if request.path == "/reset_prefix_cache":
            for upstream, (status, _, _) in zip(members, results):
                if status == 200:
                    self.router.forget(self.upstreams.index(upstream))
        failed = [
            (u, status, data)
            for u, (status, _, data) in zip(members, results)
            if status != 200 and u.state != State.DOWN
        ]  # one found down: left out
        if request.path == "/v1/unload_lora_adapter":  # vLLM: unloading a name that is not loaded is fine
            failed = [(u, status, data) for u, status, data in failed if status not in (400, 404)]
        if failed:
            return error(failed[0][1], failed_on(request.path, failed, len(results)))
        self._remember(request.path, raw)
        status, headers, data = next((r for r in results if r[0] == 200), results[0])
        return web.Response(status=status, body=data, headers=headers)

    def _remember(self, path: str, raw: bytes) -> None:
        """What a replica that comes back must replay: the last reload, the adapters loaded now."""
        try:
            body = json.loads(raw or b"{}")
        except json.JSONDecodeError:
            return
        if path == "/collective_rpc" and isinstance(body, dict) and body.get("method") == "reload_weights":
            self.reload = raw
        elif path == "/v1/load_lora_adapter" and isinstance(body, dict):
            self.adapters[str(body.get("lora_name"))] = raw
        elif path == "/v1/unload_lora_adapter" and isinstance(body, dict):
            self.adapters.pop(str(body.get("lora_name")), None)

    async def world_size(self, request: web.Request) -> web.Response:
        """The replicas' workers together: the trainer sizes its transfer group from this."""
        sizes = await self._world_sizes(request)
        return (
            web.json_response({"world_size": sum(sizes)})
            if sizes
            else error(502, "proxy: a replica did not tell its world size")
        )

    async def _world_sizes(self, request: web.Request) -> list[int] | None:
        results = await asyncio.gather(
            *(self._send(u, "GET", "/get_world_size", None, request.headers) for u in self._members())
        )
        if any(status != 200 for status, _, _ in results):
            return None
        try:
            return [int(json.loads(data)["world_size"]) for _, _, data in results]
        except (ValueError, KeyError, TypeError):
            return None

    async def weight_transfer(self, request: web.Request) -> web.Response:
        """vLLM's four weight-transfer calls, sent to every replica at once; the answer comes when all have answered.
        One group holds the trainer and every replica's workers: `init_info.rank_offset` becomes each replica's offset
        (its workers follow the previous replicas'), and a per-worker `update_info` list is split among the replicas.
        An update that failed on any replica is finished with "discard" everywhere, so all replicas or none serve it."""
        try:
            body = json.loads(await request.read() or b"{}")
        except json.JSONDecodeError as exc:
            return error(400, f"proxy: the request body is not valid JSON: {exc}")
        if not isinstance(body, dict):
            return error(400, "proxy: the request body must be a JSON object")
        members = self._members()
        joined = {self.upstreams.index(u) for u in members}
        if request.path == "/start_weight_update":
            self.transfer_failed = False
            if self.group is not None and joined != self.group:
                return error(
                    409,
                    f"proxy: the replicas up ({sorted(joined)}) are not those of the weight-transfer group "
                    f"({sorted(self.group)}): one went down or came back. Initialise the transfer again "
                    "(/init_weight_transfer_engine) to form the group anew.",
                )
        bodies = await self._transfer_bodies(request, body, members)
        if isinstance(bodies, web.Response):
            return bodies
        if request.path == "/finish_weight_update" and self.transfer_failed:
            bodies = [b | {"discard": True} for b in bodies]
        results = await asyncio.gather(
            *(
                self._send(u, "POST", request.path_qs, json.dumps(b).encode(), {"Content-Type": "application/json"})
                for u, b in zip(members, bodies)
            )
        )
        failed = [(u, status, data) for u, (status, _, data) in zip(members, results) if status != 200]
        if failed and request.path == "/update_weights":
            self.transfer_failed = True
        if failed and request.path == "/start_weight_update":  # the replicas that started close their update unused
            discard = json.dumps({"discard": True}).encode()
            await asyncio.gather(
                *(
                    self._send(u, "POST", "/finish_weight_update", discard, {"Content-Type": "application/json"})
                    for u, r in zip(members, results)
                    if r[0] == 200
                )
            )
        if not failed and request.path == "/init_weight_transfer_engine":
            self.group = joined
        if not failed and request.path == "/finish_weight_update" and not self.transfer_failed:
            for upstream in members:  # it has the current weights now
                upstream.state = State.UP
        if failed:
            return error(failed[0][1], failed_on(request.path, failed, len(results)))
        status, headers, data = results[0]
        return web.Response(status=200, body=data, headers=headers)

    async def _transfer_bodies(
        self, request: web.Request, body: dict, members: list[Upstream]
    ) -> list[dict] | web.Response:
        """Each member's body of a weight-transfer call."""
        if not members:
            return error(502, f"proxy: every replica is down; {request.path} reached none")
        per_worker = request.path == "/update_weights" and isinstance(body.get("update_info"), list)
        if request.path != "/init_weight_transfer_engine" and not per_worker:  # the same body for every replica
            return [body] * len(members)
        sizes = await self._world_sizes(request)
        if sizes is None:
            return error(502, "proxy: a replica did not tell its world size (GET /get_world_size)")
        if request.path == "/init_weight_transfer_engine":
            info = body.get("init_info")
            if not isinstance(info, dict) or "rank_offset" not in info:
                return error(400, "proxy: /init_weight_transfer_engine needs init_info with rank_offset")
            offsets = [int(info["rank_offset"]) + sum(sizes[:i]) for i in range(len(sizes))]
            return [body | {"init_info": info | {"rank_offset": offset}} for offset in offsets]
        info = body["update_info"]
        if len(info) != sum(sizes):
            return error(400, f"proxy: update_info has {len(info)} entries; the replicas have {sum(sizes)} workers")
        starts = [sum(sizes[:i]) for i in range(len(sizes))]
        return [body | {"update_info": info[start : start + size]} for start, size in zip(starts, sizes)]

    async def load_lora(self, request: web.Request) -> web.Response:
        raw = await request.read()
        try:
            name = json.loads(raw).get("lora_name", "?")
        except (json.JSONDecodeError, AttributeError):
            return error(400, "proxy: the request body must be a JSON object with lora_name and lora_path")

        async def load_one(upstream: Upstream) -> tuple[int, bytes, int]:
            deadline, attempts = time.monotonic() + self.args.lora_load_timeout_s, 0
            while True:
                attempts += 1
                status, _, data = await self._send(upstream, "POST", request.path_qs, raw, request.headers)
                if status == 200 or b"No adapter found" not in data or time.monotonic() >= deadline:
                    return status, data, attempts
                await asyncio.sleep(self.args.lora_retry_s)

        members = self._members()
        if not members:
            return error(502, f"proxy: every replica is down; {name} was loaded on none")
        results = await asyncio.gather(*(load_one(u) for u in members))
        failed = [
            (u, status, data)
            for u, (status, data, _) in zip(members, results)
            if status != 200 and u.state != State.DOWN
        ]  # one found down: left out
        if not failed and any(status == 200 for status, _, _ in results):
            self._remember(request.path, raw)
            return web.Response(
                status=200,
                body=next(data for status, data, _ in results if status == 200),
                content_type="application/json",
            )
        if not failed:
            return error(502, f"proxy: every replica went down while loading {name}; it is loaded on none")
        unload = json.dumps({"lora_name": name}).encode()
        rollbacks = await asyncio.gather(
            *(
                self._send(u, "POST", "/v1/unload_lora_adapter", unload, {"Content-Type": "application/json"})
                for u, r in zip(members, results)
                if r[0] == 200
            )
        )
        _, status, data = failed[0]
        attempts = results[members.index(failed[0][0])][2]
        not_rolled_back = sum(1 for s, _, _ in rollbacks if s != 200)
        note = (
            f" after {attempts} attempt(s); rolled back on the others"
            f"{f' ({not_rolled_back} rollback unloads failed)' if not_rolled_back else ''}"
        )
        return error(
            504 if b"No adapter found" in data else status, failed_on(f"to load {name}", failed, len(results), note)
        )

    async def health(self, request: web.Request) -> web.Response:
        """200 only when every replica is healthy, else 503 (or the first unhealthy one's 5xx) naming them.
        The proxy still serves on the replicas that are up: /proxy/stats says which (the trainer reads it)."""
        members = self._members()
        results = await self._all(request, b"", members)
        bad = [(u.url, r[0]) for u, r in zip(members, results) if r[0] != 200]
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
        results = await self._all(request, b"")
        lines, seen, loads = [], set(), {}
        for index, (status, _, data) in enumerate(results):
            if status != 200:
                continue
            text = data.decode()
            loads[index] = _load(text)
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
        lines += _load_lines(loads)
        return web.Response(text="\n".join(lines) + "\n", content_type="text/plain")

    async def stats(self, _: web.Request) -> web.Response:
        return web.json_response(self._stats())

    async def forward(self, request: web.Request) -> web.Response:
        """Reads any replica can answer for all (models, server_info, tokenize, ...): the first one that answers."""
        raw = await request.read()
        for upstream in self.upstreams:
            status, headers, data = await self._send(
                upstream, request.method, request.path_qs, raw or None, request.headers
            )
            if status != 502:
                return web.Response(status=status, body=data, headers=headers)
        return web.Response(status=502, body=data, headers=headers)


def _load_lines(loads: dict[int, dict[str, float]]) -> list[str]:
    """Each replica's load, labelled with it, then the totals: load and capacity summed, the fullest replica's KV usage."""
    lines = [
        f'tandem_proxy:replica_{name}{{replica="{index}"}} {value:g}'
        for index, load in loads.items()
        for name, value in load.items()
    ]
    for name in next(iter(loads.values()), {}):
        column = [load[name] for load in loads.values()]
        lines.append(f"tandem_proxy:{name} {max(column) if name == 'kv_cache_usage_perc' else sum(column):g}")
    return lines


def _load(text: str) -> dict[str, float]:
    """One replica's load from its /metrics: its engines summed, KV usage as its fullest engine's."""
    m = parse_metrics(text)
    return {
        "num_requests_running": m.running,
        "num_requests_waiting": m.waiting,
        "num_preemptions": m.preemptions,
        "kv_cache_usage_perc": m.kv_cache_usage,
        "kv_cache_size_tokens": m.kv_capacity_tokens or 0,
    }


async def start_proxy(args: ProxyArgs) -> tuple[web.AppRunner, int]:
    """Start the proxy in the running event loop; returns the runner and the bound port (for --port 0)."""
    return await start_app(Proxy(args).app(), args.host, args.port)
