"""`tandem proxy` in front of small fake replicas that record what they are asked and fail on purpose."""

import asyncio
import json
import time

import aiohttp
import pytest
import torch
from aiohttp import web
from aiohttp.test_utils import TestServer
from transformers import AutoModelForCausalLM

from tandem.generation.client import ControlClient, parse_metrics
from tandem.proxy.app import ProxyArgs, start_proxy
from tandem.tasks import TINY_MODEL_PATH

TEMPLATE = list(range(1000, 1016))


class FakeReplica:
    def __init__(
        self, index: int, lag: int = 0, fail_load: bool = False, port: int | None = None, api_key: str | None = None
    ):
        self.index, self.lag, self.fail_load, self.api_key = index, lag, fail_load, api_key
        self.calls: dict[str, int] = {}
        self.loaded: set[str] = set()
        self.healthy = True
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self.handle)
        self.server = TestServer(app, port=port)

    async def handle(self, request: web.Request) -> web.Response:
        path = request.path
        if self.api_key and request.headers.get("Authorization") != f"Bearer {self.api_key}":  # vllm serve --api-key
            return web.json_response({"error": "Unauthorized"}, status=401)
        self.calls[path] = self.calls.get(path, 0) + 1
        body = await request.json() if request.can_read_body else {}
        if path == "/v1/completions" and body.get("stream"):  # one event, then the replica dies mid-stream
            response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await response.prepare(request)
            await response.write(b'data: {"choices": [{"index": 0, "text": "partial"}]}\n\n')
            request.transport.close()
            return response
        if path == "/v1/completions":
            await asyncio.sleep(0.01)
            n = body.get("n", 1)
            return web.json_response(
                {
                    "id": f"cmpl-{self.index}",
                    "choices": [{"index": j, "text": f"r{self.index}"} for j in range(n)],
                    "usage": {"prompt_tokens": 10, "completion_tokens": 2 * n, "total_tokens": 10 + 2 * n},
                }
            )
        if path == "/v1/load_lora_adapter":
            if self.calls[path] <= self.lag:
                return web.json_response({"error": {"message": "No adapter found for <path>"}}, status=404)
            if self.fail_load:
                return web.json_response(
                    {"error": {"message": "LoRA rank 64 is greater than max_lora_rank 32"}}, status=400
                )
            self.loaded.add(body["lora_name"])
            return web.Response(text="Success: LoRA adapter loaded")
        if path == "/v1/unload_lora_adapter":
            self.loaded.discard(body["lora_name"])
            return web.Response(text="ok")
        if path == "/health":
            return web.Response(status=200 if self.healthy else 503)
        if path == "/get_world_size":
            return web.json_response({"world_size": 1})
        if path == "/metrics":
            return web.Response(
                text=f'vllm:num_requests_running{{engine="0"}} {3 + self.index}\n'
                f'vllm:kv_cache_usage_perc{{engine="0"}} {0.5 - 0.25 * self.index}\n'
                f'vllm:cache_config_info{{engine="0",kv_cache_size_tokens="1000"}} 1.0\n'
            )
        return web.json_response({"path": path, "from": self.index})


async def started(replicas, **kwargs):
    for replica in replicas:
        await replica.server.start_server()
    args = ProxyArgs(
        upstreams=[str(r.server.make_url("")) for r in replicas],
        port=0,
        lora_retry_s=0.05,
        lora_load_timeout_s=5,
        connect_timeout_s=2,
        **kwargs,
    )
    runner, port = await start_proxy(args)
    return runner, f"http://127.0.0.1:{port}"


async def post(session, url, body):
    async with session.post(url, data=json.dumps(body) if not isinstance(body, bytes) else body) as r:
        return r.status, r.headers.get("X-Proxy-Upstream"), await r.text()


async def test_routing_sticks_spreads_and_forgets_on_a_cache_reset():
    replicas = [FakeReplica(0), FakeReplica(1)]
    runner, url = await started(replicas)
    async with aiohttp.ClientSession() as s:
        prompt = TEMPLATE + list(range(64))
        homes = {(await post(s, url + "/v1/completions", {"model": "p", "prompt": prompt}))[1] for _ in range(6)}
        assert len(homes) == 1
        spread = [
            (await post(s, url + "/v1/completions", {"model": "p", "prompt": TEMPLATE + [i] * 64}))[1] for i in range(8)
        ]
        assert sorted(spread) == ["0"] * 4 + ["1"] * 4
        async with s.get(url + "/proxy/stats") as r:
            stats = await r.json()
        # 5 repeats, plus the first new prompt: until a second prompt fans out of the template, the template
        # block looks specific to the first one (the router's rule; the second new prompt makes it common).
        assert stats["router"]["affinity"] == 6 and stats["router"]["routed"] == 14
        async with s.post(url + "/reset_prefix_cache") as r:
            assert r.status == 200
        await post(s, url + "/v1/completions", {"model": "p", "prompt": prompt})
        async with s.get(url + "/proxy/stats") as r:
            assert (await r.json())["router"]["affinity"] == 6, "after a reset nobody holds the prompt"
        for query, kept in [("mode=keep", True), ("mode=wait&clear_cache=false", True), ("mode=wait", False)]:
            async with s.get(url + "/proxy/stats") as r:
                before = (await r.json())["router"]["affinity"]
            async with s.post(url + f"/pause?{query}") as r:
                assert r.status == 200
            await post(s, url + "/v1/completions", {"model": "p", "prompt": prompt})
            async with s.get(url + "/proxy/stats") as r:
                affinity = (await r.json())["router"]["affinity"]
            assert affinity == before + kept, (
                f"/pause?{query}: the router should {'keep' if kept else 'forget'} the cache"
            )
        assert (await post(s, url + "/v1/completions", b"{not json"))[0] == 400
    await runner.cleanup()
    for r in replicas:
        await r.server.close()


async def test_chat_messages_route_by_their_rendered_token_ids_with_a_tokenizer(tokenizer):
    replicas = [FakeReplica(0), FakeReplica(1)]
    runner, url = await started(replicas, tokenizer=TINY_MODEL_PATH)
    async with aiohttp.ClientSession() as s:
        conversations = [
            [{"role": "user", "content": f"Question {i}: " + "what is seven times six? " * 4}] for i in range(2)
        ]
        homes = [(await post(s, url + "/v1/chat/completions", {"model": "m", "messages": c}))[1] for c in conversations]
        assert sorted(homes) == ["0", "1"], "distinct conversations spread"
        for home, conversation in zip(homes, conversations):  # the same prompt sent as token ids finds its blocks
            ids = tokenizer.apply_chat_template(
                conversation, add_generation_prompt=True, tokenize=True, return_dict=False
            )
            assert (await post(s, url + "/v1/completions", {"model": "m", "prompt": ids}))[1] == home
        async with s.get(url + "/proxy/stats") as r:
            assert (await r.json())["router"]["affinity"] == 2
    await runner.cleanup()
    for r in replicas:
        await r.server.close()


async def test_a_batch_of_prompts_is_split_routed_per_prompt_and_merged_in_order():
    replicas = [FakeReplica(0), FakeReplica(1)]
    runner, url = await started(replicas)
    async with aiohttp.ClientSession() as s:
        prompts = [TEMPLATE + [i] * 48 for i in range(4)]
        homes = [(await post(s, url + "/v1/completions", {"model": "m", "prompt": p}))[1] for p in prompts]
        status, upstreams, text = await post(s, url + "/v1/completions", {"model": "m", "prompt": prompts, "n": 2})
        assert status == 200 and upstreams == ",".join(homes), "each prompt goes where its blocks are"
        answer = json.loads(text)
        assert [c["index"] for c in answer["choices"]] == list(range(8))
        assert [c["text"] for c in answer["choices"]] == [f"r{h}" for h in homes for _ in range(2)]
        assert answer["usage"] == {"prompt_tokens": 40, "completion_tokens": 16, "total_tokens": 56}
    await runner.cleanup()
    for r in replicas:
        await r.server.close()


async def test_adapter_loads_retry_a_lagging_replica_and_roll_back_a_failing_one():
    lagging, steady = FakeReplica(0, lag=3), FakeReplica(1)
    runner, url = await started([lagging, steady])
    async with aiohttp.ClientSession() as s:
        status, _, _ = await post(
            s, url + "/v1/load_lora_adapter", {"lora_name": "tandem-policy-v1", "lora_path": "/x"}
        )
        assert status == 200 and lagging.loaded == steady.loaded == {"tandem-policy-v1"}
        assert lagging.calls["/v1/load_lora_adapter"] == 4 and steady.calls["/v1/load_lora_adapter"] == 1
    await runner.cleanup()

    good, bad = FakeReplica(0), FakeReplica(1, fail_load=True)
    runner, url = await started([good, bad])
    async with aiohttp.ClientSession() as s:
        status, _, text = await post(
            s, url + "/v1/load_lora_adapter", {"lora_name": "tandem-policy-v2", "lora_path": "/x"}
        )
        assert status == 400 and "rolled back" in text and "max_lora_rank" in text
        assert good.loaded == set() and good.calls["/v1/unload_lora_adapter"] == 1
        status, _, _ = await post(s, url + "/v1/unload_lora_adapter", {"lora_name": "never-loaded"})
        assert status == 200
        # Whole-model syncs from files reach every replica (transfers: tests/runtime/test_weight_transfer.py).
        status, _, _ = await post(
            s, url + "/collective_rpc", {"method": "reload_weights", "kwargs": {"weights_path": "/w"}}
        )
        assert status == 200 and good.calls["/collective_rpc"] == bad.calls["/collective_rpc"] == 1
    await runner.cleanup()
    for r in (lagging, steady, good, bad):
        await r.server.close()


async def test_health_metrics_and_a_dead_replica():
    alive, dying = FakeReplica(0), FakeReplica(1)
    runner, url = await started([alive, dying])
    async with aiohttp.ClientSession() as s:
        async with s.get(url + "/metrics") as r:
            text = await r.text()
        metrics = parse_metrics(text)  # what the trainer's concurrency cap reads: sums, and the fullest replica
        assert metrics.running == 3 + 4 and metrics.kv_capacity_tokens == 2000 and metrics.kv_cache_usage == 0.5
        for line in (
            'tandem_proxy:replica_kv_cache_usage_perc{replica="1"} 0.25',
            "tandem_proxy:num_requests_running 7",
            "tandem_proxy:kv_cache_size_tokens 2000",
            "tandem_proxy:kv_cache_usage_perc 0.5",
        ):
            assert line in text.splitlines(), f"{line!r} missing from the proxy's /metrics"
        async with s.get(url + "/health") as r:
            assert r.status == 200
        dying.healthy = False
        async with s.get(url + "/health") as r:
            assert r.status == 503 and "1/2 servers unhealthy" in await r.text()
        await dying.server.close()
        start = time.monotonic()
        async with s.get(url + "/health") as r:
            assert r.status == 502, "a replica that stopped answering is found at once, never a hang"
        answers = [await post(s, url + "/v1/completions", {"prompt": [i] * 40}) for i in range(4)]
        assert {(status, upstream) for status, upstream, _ in answers} == {(200, "0")}, "the others serve its requests"
        assert time.monotonic() - start < 5
        async with s.get(url + "/health") as r:
            assert r.status == 503 and "1/2 servers unhealthy, serving on 1" in await r.text(), "200 only when all are"
        async with ControlClient(url) as control:
            await control.wait_healthy(5)  # the trainer reads the proxy's own view: it serves on the replica up
        async with s.get(url + "/v1/models") as r:
            assert r.status == 200 and (await r.json())["from"] == 0
    await runner.cleanup()
    await alive.server.close()


async def test_a_replica_that_refuses_connections_loses_its_blocks_at_once():
    replicas = [FakeReplica(0), FakeReplica(1)]
    runner, url = await started(replicas)
    async with aiohttp.ClientSession() as s:
        kept, lost = [7] * 80, [9] * 80  # five blocks each
        assert [(await post(s, url + "/v1/completions", {"prompt": p}))[1] for p in (kept, lost)] == ["0", "1"]
        await replicas[1].server.close()  # a restarting replica: its cache is gone
        status, upstream, _ = await post(s, url + "/v1/completions", {"prompt": lost})
        assert (status, upstream) == (200, "0"), "the request that found it down was sent to the other replica"
        async with s.get(url + "/proxy/stats") as r:
            stats = await r.json()
        assert [u["state"] for u in stats["upstreams"]] == ["up", "down"]
        assert stats["router"]["tracked_blocks"] == 10, (
            "replica 1's blocks are forgotten; replica 0 holds both prompts now"
        )
    await runner.cleanup()
    await replicas[0].server.close()


async def test_two_real_tandem_serve_replicas_behind_the_proxy(tmp_path):
    from tandem.generation.client import ControlClient, GenerationClient
    from tests.conftest import ServerThread

    replicas = [ServerThread(logprobs_mode="processed_logprobs", max_num_seqs=8) for _ in range(2)]
    runner, port = await start_proxy(ProxyArgs(upstreams=[r.url for r in replicas], port=0))
    url = f"http://127.0.0.1:{port}"
    try:
        async with GenerationClient(url) as client, ControlClient(url) as control:
            await control.wait_healthy(30)
            prompt = list(range(3, 43))  # 40 tokens of the tiny vocabulary
            answers = [await client.complete(prompt, max_tokens=4, seed=i, logprobs=0) for i in range(3)]
            assert all(len(c.token_ids) == 4 and len(c.logprobs) == 4 for [c] in answers)
            metrics = await control.metrics()  # the trainer's concurrency cap reads the sum over replicas
            assert metrics.kv_capacity_tokens == 2 * replicas[0].server.engine.stats().kv_capacity_tokens
            await control.pause("keep")
            assert all(r.server.engine.paused for r in replicas)
            await control.resume()
            assert (await control.max_model_len()) == replicas[0].server.max_model_len
            # A whole-model reload through the proxy reaches both replicas.
            before = replicas[1].post("/v1/completions", {"prompt": prompt, "max_tokens": 4, "seed": 1, "logprobs": 0})[
                1
            ]
            changed = AutoModelForCausalLM.from_pretrained(TINY_MODEL_PATH, dtype=torch.float32)
            with torch.no_grad():
                changed.model.norm.weight.mul_(1.5)
            changed.save_pretrained(tmp_path / "v1")
            await control.reload_weights(str(tmp_path / "v1"))
            after = [
                r.post("/v1/completions", {"prompt": prompt, "max_tokens": 4, "seed": 1, "logprobs": 0})[1]
                for r in replicas
            ]
            assert after[0]["choices"] == after[1]["choices"] != before["choices"]
            # A batch split over the replicas answers as one server answers it (same seeds, same samples, in order).
            body = {
                "prompt": [list(range(3, 40)), list(range(50, 90))],
                "max_tokens": 3,
                "n": 2,
                "seed": 7,
                "logprobs": 0,
            }
            through, direct = (
                await client.post_json("/v1/completions", body),
                replicas[1].post("/v1/completions", body)[1],
            )
            assert through["choices"] == direct["choices"] and through["usage"] == direct["usage"]
    finally:
        await runner.cleanup()
        for r in replicas:
            r.close()


async def test_a_replica_that_dies_mid_stream_ends_the_stream_with_an_error_event():
    replicas = [FakeReplica(0)]
    runner, url = await started(replicas)
    async with aiohttp.ClientSession() as s:
        async with s.post(url + "/v1/completions", json={"prompt": [1, 2], "stream": True}) as r:
            status, text = r.status, await r.text()
    events = [event.removeprefix("data: ") for event in text.split("\n\n") if event]
    assert status == 200 and json.loads(events[0])["choices"][0]["text"] == "partial", "passed on as it came"
    error = json.loads(events[1])["error"]
    assert error["code"] == 502 and "proxy:" in error["message"] and events[2:] == ["[DONE]"], events
    await runner.cleanup()


async def test_the_proxy_prints_its_stats_line_with_each_replicas_load(capsys):
    replicas = [FakeReplica(0), FakeReplica(1)]
    runner, url = await started(replicas, stats_interval_s=0.05)
    async with aiohttp.ClientSession() as s:
        await post(s, url + "/v1/completions", {"prompt": TEMPLATE})
    await asyncio.sleep(0.2)
    await runner.cleanup()
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("[proxy] stats ")]
    stats = json.loads(lines[-1].removeprefix("[proxy] stats "))
    assert len(lines) >= 2 and [u["inflight"] for u in stats["upstreams"]] == [0, 0]
    assert sum(u["routed"] for u in stats["upstreams"]) == 1 and stats["router"]["routed"] == 1


async def states(session, url) -> list[str]:
    async with session.get(url + "/proxy/stats") as r:
        return [u["state"] for u in (await r.json())["upstreams"]]


async def until(session, url, wanted: list[str], timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while (found := await states(session, url)) != wanted:
        assert time.monotonic() < deadline, f"replica states {found}, waited for {wanted}"
        await asyncio.sleep(0.05)


async def test_a_replica_that_comes_back_is_given_the_adapters_loaded_meanwhile_before_any_request():
    replicas = [FakeReplica(0), FakeReplica(1)]
    runner, url = await started(replicas, probe_interval_s=0.05)
    async with aiohttp.ClientSession() as s:
        assert (await post(s, url + "/v1/load_lora_adapter", {"lora_name": "v1", "lora_path": "/adapters/v1"}))[
            0
        ] == 200
        port = replicas[1].server.port
        await replicas[1].server.close()
        assert (await post(s, url + "/v1/completions", {"prompt": [5] * 40}))[:2] == (200, "0")  # found down
        assert (await post(s, url + "/v1/load_lora_adapter", {"lora_name": "v2", "lora_path": "/adapters/v2"}))[
            0
        ] == 200, "an adapter load succeeds on the replicas up"
        assert (await post(s, url + "/v1/unload_lora_adapter", {"lora_name": "v1"}))[0] == 200
        back = FakeReplica(1, port=port)
        await back.server.start_server()
        await until(s, url, ["up", "up"])
        assert back.loaded == {"v2"} and "/v1/completions" not in back.calls, "brought to the adapters of now first"
        upstreams = {(await post(s, url + "/v1/completions", {"prompt": [i] * 40}))[1] for i in range(8)}
        assert upstreams == {"0", "1"}, "it gets traffic again"
    await runner.cleanup()
    for replica in (replicas[0], back):
        await replica.server.close()


async def test_a_transfer_group_is_formed_again_without_a_replica_that_went_down_and_with_it_once_back():
    replicas = [FakeReplica(0), FakeReplica(1)]
    runner, url = await started(replicas, probe_interval_s=0.05)
    init = {"init_info": {"master_address": "127.0.0.1", "master_port": 1, "rank_offset": 1, "world_size": 3}}
    transfer = [("/start_weight_update", {}), ("/update_weights", {"update_info": {}}), ("/finish_weight_update", {})]
    async with aiohttp.ClientSession() as s:
        assert (await post(s, url + "/init_weight_transfer_engine", init))[0] == 200
        port = replicas[1].server.port
        await replicas[1].server.close()
        async with s.get(url + "/health") as r:  # the trainer's next call finds it down
            assert r.status == 502
        status, _, text = await post(s, url + "/start_weight_update", {})
        assert status == 409 and "Initialise the transfer again" in text, "the trainer is told to form the group anew"
        assert (
            await post(
                s, url + "/init_weight_transfer_engine", init | {"init_info": init["init_info"] | {"world_size": 2}}
            )
        )[0] == 200
        assert [(await post(s, url + path, body))[0] for path, body in transfer] == [200, 200, 200]

        back = FakeReplica(1, port=port)
        await back.server.start_server()
        await until(s, url, ["up", "behind"])
        assert {(await post(s, url + "/v1/completions", {"prompt": [i] * 40}))[1] for i in range(6)} == {"0"}, (
            "no traffic before it has the current weights"
        )
        assert (await post(s, url + "/start_weight_update", {}))[0] == 409
        assert (await post(s, url + "/init_weight_transfer_engine", init))[0] == 200
        assert [(await post(s, url + path, body))[0] for path, body in transfer] == [200, 200, 200]
        assert await states(s, url) == ["up", "up"] and back.calls["/finish_weight_update"] == 1
    await runner.cleanup()
    for replica in (replicas[0], back):
        await replica.server.close()


async def test_the_dtype_warning_covers_tandem_serve_and_the_servers_behind_tandem_proxy():
    from tandem.generation.client import ControlClient
    from tandem.generation.server_facts import read_facts
    from tandem.runtime.server_checks import check
    from tests.conftest import ServerThread

    replica = ServerThread(dtype="bfloat16", max_num_seqs=4)
    runner, port = await start_proxy(ProxyArgs(upstreams=[replica.url], port=0))
    try:
        for url in (replica.url, f"http://127.0.0.1:{port}"):
            async with ControlClient(url) as control:
                await control.wait_healthy(30)
                facts = await read_facts(control)
            with pytest.warns(
                UserWarning,
                match=f"the server at {url} decodes in bfloat16 and the trainer holds its "
                "weights in float32.*--dtype float32",
            ):
                check(facts, url, "float32")
    finally:
        await runner.cleanup()
        replica.close()


async def test_upstream_api_key_reaches_every_replica_and_the_clients_key_never_does():
    replicas = [FakeReplica(i, api_key="replica-key") for i in range(2)]
    runner, url = await started(replicas, upstream_api_key="replica-key")
    try:
        async with aiohttp.ClientSession(headers={"Authorization": "Bearer client-key"}) as s:
            answers = [await post(s, url + "/v1/completions", {"prompt": [i] * 40}) for i in range(4)]
            assert {status for status, _, _ in answers} == {200}, answers
            async with s.post(url + "/v1/load_lora_adapter", json={"lora_name": "a", "lora_path": "/x"}) as r:
                assert r.status == 200, await r.text()
            async with s.get(url + "/health") as r:
                assert r.status == 200
        assert all(r.loaded == {"a"} for r in replicas), "broadcasts carry the key too"
    finally:
        await runner.cleanup()
        for replica in replicas:
            await replica.server.close()
    unkeyed = [FakeReplica(0, api_key="replica-key")]
    runner, url = await started(unkeyed)
    try:
        async with aiohttp.ClientSession() as s:
            status, _, _ = await post(s, url + "/v1/completions", {"prompt": [1] * 40})
            assert status == 401, "without --upstream-api-key the replica refuses, and the proxy says so"
    finally:
        await runner.cleanup()
        await unkeyed[0].server.close()
