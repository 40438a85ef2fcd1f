"""HTTP plumbing shared by `tandem serve` and `tandem proxy`: vLLM's error body, its `--api-key` rule, its `/pause`
query, start and run.

It imports only aiohttp, so the proxy, which uses it, stays free of torch and transformers.
"""

import asyncio
from collections.abc import Mapping
from dataclasses import dataclass

from aiohttp import web

AUTH_PREFIXES = ("/v1", "/v2", "/inference", "/cohere")
"""The paths vLLM's `--api-key` guards; its dev routes, `/health` and `/metrics` stay open."""
CONTROL_PATHS = (
    "/pause",
    "/resume",
    "/reset_prefix_cache",
    "/collective_rpc",
    "/init_weight_transfer_engine",
    "/start_weight_update",
    "/update_weights",
    "/finish_weight_update",
)
"""Routes that change what a server serves: tandem guards them with `--api-key` too (vLLM leaves them open), so a
server bound beyond loopback cannot be paused or given weights by anyone who reaches it. Reads stay open."""


QUERY_BOOLS = {"true": True, "1": True, "yes": True, "on": True, "false": False, "0": False, "no": False, "off": False}
"""The spellings of a boolean query parameter vLLM's server (FastAPI) accepts, case aside."""


class BadQuery(ValueError):
    """A query parameter with a value the route does not accept: its message names the parameter and the fix."""

    def __init__(self, message: str, param: str, value: str):
        super().__init__(message)
        self.param, self.value = param, value


@dataclass(frozen=True)
class Pause:
    """vLLM's `/pause?mode=abort|wait|keep&clear_cache=true|false`. Abort ends the running requests and wait lets them
    finish, then the prefix cache is dropped unless `clear_cache` is false; keep freezes the running requests with
    their cache, so `clear_cache` changes nothing there (as in vLLM)."""

    mode: str = "abort"
    clear_cache: bool = True

    @classmethod
    def from_query(cls, query: Mapping[str, str]) -> "Pause":
        mode = query.get("mode", cls.mode)
        if mode not in ("abort", "wait", "keep"):
            raise BadQuery(f"Invalid pause mode {mode!r}: use abort, wait or keep.", "mode", mode)
        raw = query.get("clear_cache")
        if raw is not None and raw.lower() not in QUERY_BOOLS:
            raise BadQuery(f"clear_cache must be true or false, not {raw!r}.", "clear_cache", raw)
        return cls(mode, cls.clear_cache if raw is None else QUERY_BOOLS[raw.lower()])

    @property
    def drains(self) -> bool:
        """The running requests end (abort) or finish (wait) before the server says it is paused."""
        return self.mode != "keep"

    @property
    def drops_prefix_cache(self) -> bool:
        return self.drains and self.clear_cache


def error_body(status: int, message: str, type: str, param: str | None = None) -> dict:
    """vLLM's error shape; the HTTP status equals `code`."""
    return {"error": {"message": message, "type": type, "param": param, "code": status}}


def error_response(status: int, message: str, type: str, param: str | None = None) -> web.Response:
    return web.json_response(error_body(status, message, type, param), status=status)


def api_key_auth(api_key: str | None):
    """A middleware answering 401 as vLLM does when a guarded path (vLLM's, and the control routes) lacks
    `Authorization: Bearer <api_key>`."""

    @web.middleware
    async def auth(request: web.Request, handler):
        if api_key and (request.path.startswith(AUTH_PREFIXES) or request.path in CONTROL_PATHS):
            if request.headers.get("Authorization") != f"Bearer {api_key}":
                return web.json_response({"error": "Unauthorized"}, status=401)
        return await handler(request)

    return auth


async def start_app(app: web.Application, host: str, port: int, **runner_options) -> tuple[web.AppRunner, int]:
    """Serve `app` in the running event loop; returns the runner and the bound port (port 0 picks a free one)."""
    runner = web.AppRunner(app, access_log=None, **runner_options)
    await runner.setup()
    await web.TCPSite(runner, host, port).start()
    return runner, runner.addresses[0][1]


def run_until_interrupted(start, banner) -> None:
    """Await `start` (a runner and its port), print `banner(port)`, serve until Ctrl-C, then clean up."""

    async def main():
        runner, port = await start
        print(banner(port), flush=True)
        try:
            await asyncio.Event().wait()
        finally:
            await runner.cleanup()

    try:
        asyncio.run(main())
    except KeyboardInterrupt:
        pass
