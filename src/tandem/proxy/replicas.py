"""The replicas behind the proxy: where each stands (up, down, behind the current weights), the one connection pool
to them, each call sent with its failure counted, and the replicas that went down probed until they answer, then
brought to the current weights (the last reload and the adapters loaded now, replayed) before they get traffic."""

import asyncio
import enum
import json
from dataclasses import dataclass

import aiohttp
from aiohttp import web

from tandem.httpapp import error_body
from tandem.proxy.messages import end_to_end
from tandem.proxy.router import PrefixRouter


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


class Replicas:
    def __init__(self, urls: list[str], router: PrefixRouter, upstream_api_key: str | None, probe_interval_s: float):
        self.upstreams = [Upstream(url.rstrip("/")) for url in urls]
        self.router, self.upstream_api_key, self.probe_interval_s = router, upstream_api_key, probe_interval_s
        self.session: aiohttp.ClientSession | None = None
        self.group: set[int] | None = None
        """The replicas in the weight-transfer group (None: no group formed)."""
        self.reload: bytes | None = None
        """The last `/collective_rpc` reload_weights body: what a replica that comes back replays."""
        self.adapters: dict[str, bytes] = {}
        """The adapters loaded now, by name, with their load body: what a replica that comes back loads."""

    @property
    def http(self) -> aiohttp.ClientSession:
        """The connection pool to the replicas, opened as the proxy starts (`open`)."""
        assert self.session is not None, "open() first"
        return self.session

    def open(self, connect_timeout_s: float) -> None:
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=connect_timeout_s)
        self.session = aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=1024))

    def outgoing(self, headers) -> dict:
        """A request's headers as sent on to a replica (hop-by-hop ones dropped, the replicas' key set)."""
        out = end_to_end(headers)
        if self.upstream_api_key:
            out["Authorization"] = f"Bearer {self.upstream_api_key}"
        return out

    def failed(self, upstream: Upstream, exc: BaseException) -> str:
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

    def members(self) -> list[Upstream]:
        """The replicas control calls reach: all but the down ones."""
        return [u for u in self.upstreams if u.state != State.DOWN]

    async def probe_down(self) -> None:
        """Ask each down replica's /health every probe_interval_s; bring one that answers to the current weights."""
        while True:
            await asyncio.sleep(self.probe_interval_s)
            for upstream in [u for u in self.upstreams if u.state == State.DOWN]:
                status, _, _ = await self.send(upstream, "GET", "/health", None, {})
                if status == 200:
                    await self.catch_up(upstream)

    async def catch_up(self, upstream: Upstream) -> None:
        """Replay the last reload and the adapters loaded now on a replica that came back; with a transfer group it is
        "behind" until the trainer's next transfer reaches it, else up at once. A failed replay leaves it down."""
        calls = [("/collective_rpc", self.reload)] if self.reload else []
        calls += [("/v1/load_lora_adapter", body) for body in self.adapters.values()]
        for path, body in calls + [("/reset_prefix_cache", None)]:
            status, _, data = await self.post_json(upstream, path, body)
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

    async def send(
        self, upstream: Upstream, method: str, path_qs: str, body: bytes | None, headers
    ) -> tuple[int, dict, bytes]:
        """One upstream call, fully buffered; a transport failure is a 502 naming the replica."""
        try:
            async with self.http.request(
                method, upstream.url + path_qs, data=body, headers=self.outgoing(headers), allow_redirects=False
            ) as r:
                data = await r.read()
                upstream.failures = 0
                return r.status, end_to_end(r.headers), data
        except (TimeoutError, aiohttp.ClientError, OSError) as exc:
            message = self.failed(upstream, exc)
            return (
                502,
                {"Content-Type": "application/json"},
                json.dumps(error_body(502, message, "BadGateway")).encode(),
            )

    async def send_all(
        self, request: web.Request, raw: bytes | None = None, upstreams=None
    ) -> list[tuple[int, dict, bytes]]:
        raw = await request.read() if raw is None else raw
        return await asyncio.gather(
            *(
                self.send(u, request.method, request.path_qs, raw or None, request.headers)
                for u in (self.upstreams if upstreams is None else upstreams)
            )
        )

    def remember(self, path: str, raw: bytes) -> None:
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

    async def world_sizes(self, request: web.Request) -> list[int] | None:
        results = await asyncio.gather(
            *(self.send(u, "GET", "/get_world_size", None, request.headers) for u in self.members())
        )
        if any(status != 200 for status, _, _ in results):
            return None
        try:
            return [int(json.loads(data)["world_size"]) for _, _, data in results]
        except (ValueError, KeyError, TypeError):
            return None

    async def post_json(self, upstream: Upstream, path: str, body: bytes | None) -> tuple[int, dict, bytes]:
        """A POST of the proxy's own (a replay, a rollback, a transfer's part) with a JSON body."""
        return await self.send(upstream, "POST", path, body, {"Content-Type": "application/json"})
