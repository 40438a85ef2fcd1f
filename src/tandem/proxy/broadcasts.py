"""The calls every replica up gets, each answered once all have answered: control calls (`/pause`, `/resume`,
`/reset_prefix_cache`, `/v1/unload_lora_adapter`, `/collective_rpc`), adapter loads (all or nothing: a failure unloads
the adapter from the replicas that took it) and the weight transfer's four calls (one group holding every replica's
workers, each replica at its rank offset; an update that failed anywhere is discarded everywhere)."""

import asyncio
import json
import time

from aiohttp import web

from tandem.httpapp import BadQuery, Pause
from tandem.proxy.messages import error, failed_on
from tandem.proxy.replicas import Replicas, State, Upstream


def empties_prefix_caches(request: web.Request) -> bool:
    """Whether a broadcast empties each replica's prefix cache, so that the router forgets what each one held: a
    reset, or a pause that drains (vLLM drops the cache then unless `clear_cache=false`)."""
    if request.path == "/reset_prefix_cache":
        return True
    try:
        return request.path == "/pause" and Pause.from_query(request.query).drops_prefix_cache
    except BadQuery:  # every replica refuses it
        return False


class Broadcasts:
    def __init__(self, replicas: Replicas, lora_retry_s: float, lora_load_timeout_s: float):
        self.replicas, self.lora_retry_s, self.lora_load_timeout_s = replicas, lora_retry_s, lora_load_timeout_s
        self.transfer_failed = False
        """The open weight update failed on some replica: its finish tells every replica to discard it."""

    async def broadcast(self, request: web.Request) -> web.Response:
        members, raw = self.replicas.members(), await request.read()
        if not members:
            return error(502, f"proxy: every replica is down; {request.path} reached none")
        results = await self.replicas.send_all(request, raw, members)
        if empties_prefix_caches(request):
            for upstream, (status, _, _) in zip(members, results):
                if status == 200:
                    self.replicas.router.forget(self.replicas.upstreams.index(upstream))
        failed = [
            (u, status, data)
            for u, (status, _, data) in zip(members, results)
            if status != 200 and u.state != State.DOWN
        ]  # one found down: left out
        if request.path == "/v1/unload_lora_adapter":  # vLLM: unloading a name that is not loaded is fine
            failed = [(u, status, data) for u, status, data in failed if status not in (400, 404)]
        if failed:
            return error(failed[0][1], failed_on(request.path, failed, len(results)))
        self.replicas.remember(request.path, raw)
        status, headers, data = next((r for r in results if r[0] == 200), results[0])
        return web.Response(status=status, body=data, headers=headers)

    async def world_size(self, request: web.Request) -> web.Response:
        """The replicas' workers together: the trainer sizes its transfer group from this."""
        sizes = await self.replicas.world_sizes(request)
        return (
            web.json_response({"world_size": sum(sizes)})
            if sizes
            else error(502, "proxy: a replica did not tell its world size")
        )

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
        members = self.replicas.members()
        joined = {self.replicas.upstreams.index(u) for u in members}
        if request.path == "/start_weight_update":
            self.transfer_failed = False
            if self.replicas.group is not None and joined != self.replicas.group:
                return error(
                    409,
                    f"proxy: the replicas up ({sorted(joined)}) are not those of the weight-transfer group "
                    f"({sorted(self.replicas.group)}): one went down or came back. Initialise the transfer again "
                    "(/init_weight_transfer_engine) to form the group anew.",
                )
        bodies = await self.transfer_bodies(request, body, members)
        if isinstance(bodies, web.Response):
            return bodies
        if request.path == "/finish_weight_update" and self.transfer_failed:
            bodies = [b | {"discard": True} for b in bodies]
        results = await asyncio.gather(
            *(self.replicas.post_json(u, request.path_qs, json.dumps(b).encode()) for u, b in zip(members, bodies))
        )
        failed = [(u, status, data) for u, (status, _, data) in zip(members, results) if status != 200]
        await self._after_transfer_call(request.path, members, [status == 200 for status, _, _ in results], joined)
        if failed:
            return error(failed[0][1], failed_on(request.path, failed, len(results)))
        status, headers, data = results[0]
        return web.Response(status=200, body=data, headers=headers)

    async def _after_transfer_call(self, path: str, members: list[Upstream], ok: list[bool], joined: set[int]) -> None:
        """What a transfer call's answers change: an update that failed somewhere is discarded at its finish, a start
        that failed somewhere is closed unused where it started, a group initialised everywhere is remembered, and an
        update finished everywhere brings its replicas up (they have the current weights)."""
        if not all(ok) and path == "/update_weights":
            self.transfer_failed = True
        if not all(ok) and path == "/start_weight_update":
            discard = json.dumps({"discard": True}).encode()
            started = [u for u, answered in zip(members, ok) if answered]
            await asyncio.gather(*(self.replicas.post_json(u, "/finish_weight_update", discard) for u in started))
        if all(ok) and path == "/init_weight_transfer_engine":
            self.replicas.group = joined
        if all(ok) and path == "/finish_weight_update" and not self.transfer_failed:
            for upstream in members:
                upstream.state = State.UP

    async def transfer_bodies(
        self, request: web.Request, body: dict, members: list[Upstream]
    ) -> list[dict] | web.Response:
        """Each member's body of a weight-transfer call."""
        if not members:
            return error(502, f"proxy: every replica is down; {request.path} reached none")
        per_worker = request.path == "/update_weights" and isinstance(body.get("update_info"), list)
        if request.path != "/init_weight_transfer_engine" and not per_worker:  # the same body for every replica
            return [body] * len(members)
        sizes = await self.replicas.world_sizes(request)
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
        members = self.replicas.members()
        if not members:
            return error(502, f"proxy: every replica is down; {name} was loaded on none")
        results = await asyncio.gather(*(self._load_until_found(u, request, raw) for u in members))
        failed = [
            (u, status, data)
            for u, (status, data, _) in zip(members, results)
            if status != 200 and u.state != State.DOWN
        ]  # one found down: left out
        if not failed and any(status == 200 for status, _, _ in results):
            self.replicas.remember(request.path, raw)
            return web.Response(
                status=200,
                body=next(data for status, data, _ in results if status == 200),
                content_type="application/json",
            )
        if not failed:
            return error(502, f"proxy: every replica went down while loading {name}; it is loaded on none")
        return await self._roll_back(name, members, results, failed)

    async def _load_until_found(self, upstream: Upstream, request: web.Request, raw: bytes) -> tuple[int, bytes, int]:
        """One replica's adapter load, tried again while it answers "No adapter found" (its mount has not seen the
        directory yet), until lora_load_timeout_s; returns its last answer and the attempts made."""
        deadline, attempts = time.monotonic() + self.lora_load_timeout_s, 0
        while True:
            attempts += 1
            status, _, data = await self.replicas.send(upstream, "POST", request.path_qs, raw, request.headers)
            if status == 200 or b"No adapter found" not in data or time.monotonic() >= deadline:
                return status, data, attempts
            await asyncio.sleep(self.lora_retry_s)

    async def _roll_back(
        self, name: str, members: list[Upstream], results: list[tuple[int, bytes, int]], failed: list
    ) -> web.Response:
        """A load that failed on some replica: unloaded from those that took it; the answer names the first failure."""
        unload = json.dumps({"lora_name": name}).encode()
        loaded = [u for u, (status, _, _) in zip(members, results) if status == 200]
        rollbacks = await asyncio.gather(
            *(self.replicas.post_json(u, "/v1/unload_lora_adapter", unload) for u in loaded)
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
