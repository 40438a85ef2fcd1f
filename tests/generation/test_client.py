"""The async clients against `tandem serve` and against small fake servers that fail on purpose."""

import asyncio
import socket
import time

import pytest
from aiohttp import web

from tandem.generation.client import (
    ENGINE_DEAD,
    ControlClient,
    EngineDead,
    GenerationClient,
    ServerError,
    ServerGone,
    ServerProblem,
    parse_metrics,
)
from tests.conftest import chat_prompt


async def test_complete_returns_token_ids_and_sampler_logprobs(server, tokenizer):
    async with GenerationClient(server.url) as client:
        [completion] = await client.complete(chat_prompt(tokenizer, "What is 4 + 4?"), max_tokens=8, seed=1, logprobs=2)
    assert len(completion.token_ids) == len(completion.logprobs) == len(completion.top_logprobs)
    assert completion.finish_reason in ("stop", "length")
    assert all(
        entry[token] == lp
        for entry, token, lp in zip(completion.top_logprobs, completion.token_ids, completion.logprobs)
    )


async def test_a_streamed_completion_is_the_same_completion_with_when_each_token_arrived(server, tokenizer):
    """What the rollout worker asks of a server that cannot label its tokens' versions (vLLM): the tokens streamed, each
    stamped with its arrival, joined per choice into what the plain request returns."""
    prompt = chat_prompt(tokenizer, "Count to ten.")
    settings = {"max_tokens": 12, "n": 2, "seed": 5, "logprobs": 2, "temperature": 1.0}
    async with GenerationClient(server.url) as client:
        plain = await client.complete(prompt, **settings)
        before = time.monotonic()
        streamed = await client.complete(prompt, **settings, stream=True)
        after = time.monotonic()
    for one, other in zip(plain, streamed, strict=True):
        assert (one.token_ids, one.logprobs, one.top_logprobs) == (other.token_ids, other.logprobs, other.top_logprobs)
        assert one.finish_reason == other.finish_reason and one.arrivals is None
        assert len(other.arrivals) == len(other.token_ids)
        assert before <= other.arrivals[0] and other.arrivals == sorted(other.arrivals) and other.arrivals[-1] <= after


async def test_an_error_event_in_a_stream_is_raised_as_the_servers_error():
    """A server that fails mid-stream sends an error event (vLLM's engine dying, one is its ENGINE_DEAD message)."""

    async def failing(request):
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        chunk = '{"choices": [{"index": 0, "text": "a", "token_ids": [7], "logprobs": {"token_logprobs": [-0.5]}}]}'
        await response.write(f"data: {chunk}\n\n".encode())
        await response.write(f'data: {{"error": {{"message": "{ENGINE_DEAD}", "code": 500}}}}\n\n'.encode())
        return response

    app = web.Application()
    app.router.add_post("/v1/completions", failing)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        async with GenerationClient(f"http://127.0.0.1:{port}") as client:
            with pytest.raises(EngineDead, match="EngineCore encountered an issue"):
                await client.complete([1, 2], max_tokens=4, stream=True)
    finally:
        await runner.cleanup()


async def test_generate_returns_sampling_masks(mask_server):
    async with GenerationClient(mask_server.url) as client:
        completions = await client.generate(
            [1, 274, 205], sampling_params={"max_tokens": 4, "top_k": 5, "logprobs": 0, "n": 2, "seed": 3}
        )
    assert len(completions) == 2
    for c in completions:
        assert len(c.sampling_mask) == len(c.token_ids) == len(c.logprobs)


async def test_control_plane_round_trip(server):
    async with ControlClient(server.url) as control:
        await control.wait_healthy(deadline_s=5)
        assert await control.max_model_len() == 1024
        assert (await control.server_info())["vllm_config"]["lora_config"]["max_loras"] == 2
        assert await control.world_size() == 1
        await control.pause("keep")
        assert await control.is_paused()
        await control.resume()
        assert not await control.is_paused()
        assert await control.reset_prefix_cache()
        metrics = await control.metrics()
    assert metrics.kv_capacity_tokens == 64 * 1024 and 0.0 <= metrics.kv_cache_usage <= 1.0


async def test_a_4xx_is_raised_at_once_with_the_server_message(server):
    async with GenerationClient(server.url, max_retries=3) as client:
        with pytest.raises(ServerError) as info:
            await client.complete([1, 5], max_tokens=2, model="missing-model")
        assert client.retries == 0
    assert info.value.status == 404 and "does not exist" in info.value.message


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def fake_server(handler) -> tuple[web.AppRunner, str]:
    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", handler)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    return runner, f"http://127.0.0.1:{port}"


async def test_503_is_retried_with_backoff_until_it_succeeds():
    calls = []

    async def handler(request):
        calls.append(time.monotonic())
        if len(calls) < 3:
            return web.json_response(
                {
                    "error": {
                        "message": "Generation is paused.",
                        "type": "ServiceUnavailableError",
                        "param": None,
                        "code": 503,
                    }
                },
                status=503,
            )
        return web.json_response(
            {"choices": [{"token_ids": [7], "logprobs": {"token_logprobs": [-0.5]}, "finish_reason": "length"}]}
        )

    runner, url = await fake_server(handler)
    try:
        async with GenerationClient(url, backoff_s=0.05) as client:
            [completion] = await client.complete([1], max_tokens=1)
            assert client.retries == 2
    finally:
        await runner.cleanup()
    assert completion.token_ids == [7] and completion.logprobs == [-0.5]
    assert calls[1] - calls[0] >= 0.02, "a retry waits for its backoff"


async def test_retries_give_up_after_max_retries():
    async def handler(request):
        return web.json_response({"error": {"message": "busy", "type": "x", "param": None, "code": 503}}, status=503)

    runner, url = await fake_server(handler)
    try:
        async with GenerationClient(url, backoff_s=0.01, max_retries=2) as client:
            with pytest.raises(ServerError) as info:
                await client.complete([1], max_tokens=1)
            assert client.retries == 2
    finally:
        await runner.cleanup()
    assert info.value.status == 503


async def test_a_server_that_comes_back_within_retry_for_s_is_waited_for():
    port = free_port()
    url = f"http://127.0.0.1:{port}"

    async def handler(request):
        return web.json_response(
            {"choices": [{"token_ids": [7], "logprobs": {"token_logprobs": [-0.5]}, "finish_reason": "length"}]}
        )

    async def come_back_after(seconds):
        await asyncio.sleep(seconds)
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", handler)
        runner = web.AppRunner(app)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        return runner

    server = asyncio.ensure_future(come_back_after(1.5))
    try:
        async with GenerationClient(url, backoff_s=0.05, max_backoff_s=0.2, max_retries=0, retry_for_s=30) as client:
            [completion] = await client.complete([1], max_tokens=1)
            assert client.retries >= 3, "refused connections were retried until the server was back"
            assert client.down_since is None, "the outage ended with the first answer"
    finally:
        await (await server).cleanup()
    assert completion.token_ids == [7]


async def test_vllms_dead_engine_is_told_from_other_server_errors_and_a_missing_dev_mode_is_named():
    """vLLM 0.32's answers: 500 with the engine-dead message once its engine process died; 404 for /server_info
    without VLLM_SERVER_DEV_MODE=1."""
    from tandem.generation.server_facts import read_facts

    async def handler(request):
        if request.path == "/v1/completions":
            message = f"{ENGINE_DEAD}. See stack trace (above) for the root cause."
            return web.json_response(
                {"error": {"message": message, "type": "InternalServerError", "param": None, "code": 500}}, status=500
            )
        if request.path == "/version":
            return web.json_response({"version": "0.32.0"})
        return web.json_response({"detail": "Not Found"}, status=404)

    runner, url = await fake_server(handler)
    try:
        async with GenerationClient(url) as client, ControlClient(url) as control:
            with pytest.raises(EngineDead, match="answered 500: EngineCore encountered an issue"):
                await client.complete([1], max_tokens=1)
            with pytest.raises(ServerProblem, match="/server_info answered 404.*VLLM_SERVER_DEV_MODE=1"):
                await read_facts(control)
    finally:
        await runner.cleanup()


async def test_a_weight_update_the_dead_engine_never_answers_ends_when_health_says_503():
    """vLLM 0.32 with its engine process killed (and VLLM_KEEP_ALIVE_ON_ENGINE_DEATH=1): a control call that goes to the
    engine hangs for good, while /health answers 503."""
    never = asyncio.Event()

    async def handler(request):
        if request.path == "/health":
            return web.Response(status=503)
        await never.wait()
        return web.Response(status=500)

    runner, url = await fake_server(handler)
    try:
        async with ControlClient(url) as control:
            start = time.monotonic()
            with pytest.raises(
                EngineDead, match="/health answered 503: a call waiting on the engine will not be answered"
            ):
                await control.update_weights(["w"], ["float32"], [[1]])
            assert time.monotonic() - start < 5, "found out at the first look at /health, not after the call's timeout"
    finally:
        never.set()
        await runner.cleanup()


async def test_an_unreachable_server_is_an_outage_with_its_start_and_cause_then_server_gone_naming_the_url():
    url = f"http://127.0.0.1:{free_port()}"
    async with GenerationClient(url, backoff_s=0.01, max_retries=1) as client:
        before = time.monotonic()
        with pytest.raises(ServerGone, match=f"{url}.*could not be reached after 2 attempt"):
            await client.complete([1], max_tokens=1)
        assert before <= client.down_since <= time.monotonic() and "ClientConnectorError" in client.down_reason


async def test_wait_healthy_times_out_with_a_clear_message():
    async with ControlClient(f"http://127.0.0.1:{free_port()}") as control:
        with pytest.raises(TimeoutError, match="did not answer 200"):
            await control.wait_healthy(deadline_s=0.5, interval_s=0.1)


def test_metrics_parsing_sums_engines_and_reports_the_fullest_engines_kv_usage():
    text = """# HELP vllm:kv_cache_usage_perc KV-cache usage.
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.5
vllm:kv_cache_usage_perc{engine="1",model_name="m"} 0.25
vllm:num_requests_running{engine="0",model_name="m"} 3.0
vllm:num_requests_running{engine="1",model_name="m"} 4.0
vllm:num_requests_waiting{engine="0",model_name="m"} 1.0
vllm:num_preemptions_total{engine="0",model_name="m"} 2.0
vllm:cache_config_info{block_size="16",engine="0",kv_cache_size_tokens="1000",model_name="m"} 1.0
vllm:cache_config_info{block_size="16",engine="1",kv_cache_size_tokens="3000",model_name="m"} 1.0
"""
    m = parse_metrics(text)
    assert (m.running, m.waiting, m.preemptions, m.kv_capacity_tokens) == (7, 1, 2, 4000)
    assert m.kv_cache_usage == 0.5, "the largest engine's usage (a full engine preempts, whatever the others hold)"


async def test_a_client_that_disconnects_frees_its_slot(server):
    engine = server.server.engine
    client = GenerationClient(server.url, max_retries=0)
    task = asyncio.create_task(client.complete([1, 5, 6], max_tokens=1000, n=8, ignore_eos=True))
    deadline = time.monotonic() + 10
    while engine.stats().running == 0 and time.monotonic() < deadline:
        await asyncio.sleep(0.005)
    assert engine.stats().running == 8
    task.cancel()
    await client.close()  # the connection drops mid-request
    while engine.stats().running and time.monotonic() < deadline:
        await asyncio.sleep(0.01)
    assert engine.stats().running == 0 and engine.stats().kv_used_tokens == 0
    assert engine.finished_total["abort"] >= 8
