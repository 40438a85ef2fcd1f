"""Async clients for vLLM-protocol servers (`vllm serve`, `tandem serve`, `tandem proxy`).

`GenerationClient` sends token ids and reads back token ids with their sampler log-probs;
`ControlClient` drives the server around weight syncs (health, pause/resume, reload, LoRA,
`/metrics`). Both use only what vLLM's own HTTP API offers, so they work unchanged
against real vLLM. Transport errors and 502/503/504 are retried with exponential backoff (`max_retries`
times, or for `retry_for_s` seconds: a server that restarts is waited for); a 4xx is the caller's mistake
and is raised at once.
"""

import asyncio
import json
import random
import re
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar

import aiohttp

T = TypeVar("T")

RETRY_STATUSES = (502, 503, 504)
ENGINE_WATCH_S = 1.0
"""How often a control call the engine must act on asks /health meanwhile (vLLM never answers one once its engine died)."""
ENGINE_DEAD = "EngineCore encountered an issue"
"""vLLM's answer (500) once its engine process has died: to the requests in flight, then its front exits (or, with
VLLM_KEEP_ALIVE_ON_ENGINE_DEATH=1, stays up answering so to every request)."""


class ServerError(Exception):
    """A non-2xx answer: `status` and the server's own error message."""

    def __init__(self, status: int, message: str, url: str):
        super().__init__(f"{url} answered {status}: {message}")
        self.status, self.message, self.url = status, message, url


class EngineDead(ServerError):
    """vLLM's engine process died: that server will never generate again (a server restarted in its place would)."""


def server_error(status: int, message: str, url: str) -> ServerError:
    """The error a server answered, as `EngineDead` when it says vLLM's engine died."""
    return (EngineDead if ENGINE_DEAD in message else ServerError)(status, message, url)


def engine_died(error: EngineDead) -> str:
    """What to tell the user when vLLM's engine died (its log has the cause)."""
    return (
        f"the generation server's engine died ({error}; the server's log says why). It will not generate again: "
        "restart the server and resume with resume_from_checkpoint."
    )


class ServerProblem(RuntimeError):
    """The server cannot serve this run as it was started, or it stopped serving: the message says what to change.
    `tandem train` prints it as one line."""


class ServerGone(ConnectionError):
    """The server did not answer at all (refused, reset, timed out) for as long as the client retries."""


def server_gone(error: Exception, timeout_s: float) -> str:
    """What to tell the user when the server stayed away past vllm_server_timeout (`error`: how it went away)."""
    return (
        f"the generation server stopped answering ({error}) and did not come back within vllm_server_timeout="
        f"{timeout_s:g}s; its log says why it stopped. Restart it and resume with resume_from_checkpoint."
    )


@dataclass
class Completion:
    """One generated sequence as the trainer needs it."""

    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str | None
    stop_reason: int | str | None = None
    top_logprobs: list[dict[int, float]] | None = None
    sampling_mask: list[list[int]] | None = None
    weight_versions: list[dict] | None = None
    """Half-open spans of the tokens, each with the label of the weights that sampled it ({"version", "start", "end"});
    None where the server does not say."""
    arrivals: list[float] | None = None
    """When each token reached this process (monotonic seconds): a streamed request's; None otherwise."""

    def token_versions(self, default: int) -> list[int] | None:
        """The policy version of each token from the spans (a label that is no version number, such as the server's
        first weights' "default", counts as `default`); None without spans."""
        if self.weight_versions is None:
            return None
        versions = [default] * len(self.token_ids)
        for span in self.weight_versions:
            label = str(span["version"])
            versions[span["start"] : span["end"]] = [int(label) if label.isdigit() else default] * (
                span["end"] - span["start"]
            )
        return versions


@dataclass
class ServerMetrics:
    """The values of `/metrics` the pacing logic uses, summed over engines (KV usage: capacity-weighted)."""

    kv_cache_usage: float
    running: int
    waiting: int
    preemptions: int
    kv_capacity_tokens: int | None


class _Http:
    def __init__(
        self,
        base_url: str,
        *,
        api_key: str | None = None,
        timeout_s: float = 600.0,
        max_retries: int = 5,
        retry_for_s: float = 0.0,
        backoff_s: float = 0.5,
        max_backoff_s: float = 8.0,
        connections: int = 0,
    ):
        self.base_url, self.api_key = base_url.rstrip("/"), api_key
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.timeout = aiohttp.ClientTimeout(total=timeout_s)
        self.max_retries, self.retry_for_s = max_retries, retry_for_s
        """Transient failures are retried at least `max_retries` times, and for up to `retry_for_s` seconds."""
        self.backoff_s, self.max_backoff_s = backoff_s, max_backoff_s
        self.connections = connections
        self.retries = 0
        """Requests re-sent after a transport error or a 502/503/504 (the trainer logs it as rollout/vllm_retry_count)."""
        self.down_since: float | None = None
        """When the server last stopped answering at all (monotonic seconds); None once any answer came back."""
        self.down_reason = ""
        """The transport error that began the outage."""
        self._session: aiohttp.ClientSession | None = None

    async def __aenter__(self):
        return self

    async def __aexit__(self, *_):
        await self.close()

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    def _client(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            connector = aiohttp.TCPConnector(limit=self.connections)
            self._session = aiohttp.ClientSession(connector=connector, timeout=self.timeout, headers=self.headers)
        return self._session

    async def request(
        self,
        method: str,
        path: str,
        *,
        body: dict | None = None,
        params: dict | None = None,
        retry: bool = True,
        timeout_s: float | None = None,
    ) -> tuple[int, str]:
        """Send one request (retrying transient failures); returns (status, text) of a 2xx, raises ServerError otherwise."""
        return await self.send(method, path, read_text, body=body, params=params, retry=retry, timeout_s=timeout_s)

    async def send(
        self,
        method: str,
        path: str,
        read: Callable[[aiohttp.ClientResponse], Awaitable[T]],
        *,
        body: dict | None = None,
        params: dict | None = None,
        retry: bool = True,
        timeout_s: float | None = None,
    ) -> tuple[int, T]:
        """`request` with a 2xx answer's body read by `read`; a transport error while it reads (a stream cut) is
        retried as one before the answer: the whole request is sent again."""
        url = f"{self.base_url}{path}"
        timeout = aiohttp.ClientTimeout(total=timeout_s) if timeout_s else None
        attempt, start = 0, time.monotonic()
        while True:
            may_retry = retry and (attempt < self.max_retries or time.monotonic() - start < self.retry_for_s)
            try:
                async with self._client().request(method, url, json=body, params=params, timeout=timeout) as response:
                    self.down_since = None
                    if response.status < 300:
                        return response.status, await read(response)
                    text = await response.text()
                    if not (may_retry and response.status in RETRY_STATUSES):
                        message = _error_message(text)
                        raise server_error(response.status, message, url)
            except (TimeoutError, aiohttp.ClientConnectionError, aiohttp.ClientPayloadError) as exc:
                if self.down_since is None:
                    self.down_since, self.down_reason = time.monotonic(), repr(exc)
                if not may_retry:
                    raise ServerGone(
                        f"{url} could not be reached after {attempt + 1} attempt(s) in "
                        f"{time.monotonic() - start:.0f}s: {exc!r}"
                    ) from exc
            attempt += 1
            self.retries += 1
            delay = min(self.max_backoff_s, self.backoff_s * 2 ** (attempt - 1))
            await asyncio.sleep(delay * (0.5 + random.random() / 2))

    async def get_json(self, path: str, **kw) -> dict:
        _, text = await self.request("GET", path, **kw)
        return json.loads(text)

    async def post_json(self, path: str, body: dict | None = None, **kw) -> dict:
        _, text = await self.request("POST", path, body=body, **kw)
        return json_body(text)


async def read_text(response: aiohttp.ClientResponse) -> str:
    return await response.text()


async def read_events(response: aiohttp.ClientResponse) -> list[tuple[float, dict]]:
    """A server-sent event stream's `data:` events up to `[DONE]`, each with when it arrived (monotonic seconds). An
    error event (the server failed mid-stream) raises it as the ServerError it would have answered."""
    events: list[tuple[float, dict]] = []
    async for line in response.content:
        if not line.startswith(b"data:"):
            continue
        payload = line[len(b"data:") :].strip()
        if payload == b"[DONE]":
            break
        events.append((time.monotonic(), stream_event(payload, str(response.url))))
    return events


def stream_event(payload: bytes, url: str) -> dict:
    """One event of a stream, or the error it carries raised."""
    event = json.loads(payload)
    error = event.get("error")
    if isinstance(error, dict):
        message = error.get("message", str(error))
        raise server_error(int(error.get("code") or 500), message, url)
    return event


def _error_message(text: str) -> str:
    try:
        error = json.loads(text).get("error")
    except (json.JSONDecodeError, AttributeError):
        return text.strip()[:500]
    return error.get("message", str(error)) if isinstance(error, dict) else str(error)


class GenerationClient(_Http):
    """Token-in, token-out generation with sampler log-probs."""

    async def complete(
        self,
        prompt_ids: list[int],
        *,
        max_tokens: int,
        model: str | None = None,
        n: int = 1,
        temperature: float = 1.0,
        top_p: float = 1.0,
        top_k: int = 0,
        min_p: float = 0.0,
        repetition_penalty: float = 1.0,
        seed: int | None = None,
        logprobs: int = 0,
        stop_token_ids: list[int] | None = None,
        return_weight_versions: bool = False,
        stream: bool = False,
        **extra,
    ) -> list[Completion]:
        """`/v1/completions` with a token-id prompt. Every sampling field is sent, so server defaults never apply;
        `return_weight_versions` (tandem serve's) asks which weights sampled each token; `stream` has the tokens
        streamed, each completion saying when each of its tokens arrived."""
        body = {
            "prompt": list(prompt_ids),
            "max_tokens": max_tokens,
            "n": n,
            "temperature": temperature,
            "top_p": top_p,
            "top_k": top_k,
            "min_p": min_p,
            "repetition_penalty": repetition_penalty,
            "seed": seed,
            "logprobs": logprobs,
            "return_token_ids": True,
            "return_tokens_as_token_ids": True,
            "stop_token_ids": stop_token_ids or [],
            "skip_special_tokens": False,
            **extra,
        }
        if return_weight_versions:
            body["return_weight_versions"] = True
        if model is not None:
            body["model"] = model
        if stream:
            _, events = await self.send("POST", "/v1/completions", read_events, body=body | {"stream": True})
            return streamed_completions(events, n, logprobs)
        data = await self.post_json("/v1/completions", body)
        return [_completion_choice(c, logprobs) for c in data["choices"]]

    async def score(self, token_ids: list[int], *, model: str | None = None) -> list[float]:
        """The log-prob the server gives each token of `token_ids` after the ones before it (`prompt_logprobs`: a
        teacher-forced forward, nothing sampled that counts); the first token has none, so one fewer than given."""
        body = {
            "prompt": list(token_ids),
            "max_tokens": 1,
            "temperature": 1.0,
            "prompt_logprobs": 0,
            "return_token_ids": True,
            "skip_special_tokens": False,
        }
        if model is not None:
            body["model"] = model
        positions = (await self.post_json("/v1/completions", body))["choices"][0]["prompt_logprobs"][1:]
        return [entries[str(token)]["logprob"] for token, entries in zip(token_ids[1:], positions)]

    async def generate(
        self, prompt_ids: list[int], *, sampling_params: dict, model: str | None = None
    ) -> list[Completion]:
        """`/inference/v1/generate` (needs `--enable-scale-out`); returns sampling masks when the server sends them."""
        body = {
            "token_ids": list(prompt_ids),
            "sampling_params": sampling_params,
            "model": model,
            "return_token_ids": True,
        }
        data = await self.post_json("/inference/v1/generate", body)
        completions = []
        for choice in data["choices"]:
            content = (choice.get("logprobs") or {}).get("content") or []
            completions.append(
                Completion(
                    token_ids=choice["token_ids"],
                    logprobs=[e["logprob"] for e in content],
                    finish_reason=choice.get("finish_reason"),
                    stop_reason=choice.get("stop_reason"),
                    top_logprobs=[{t["token_id"]: t["logprob"] for t in e.get("top_logprobs") or []} for e in content]
                    or None,
                    sampling_mask=choice.get("sampling_mask"),
                    weight_versions=choice.get("weight_versions"),
                )
            )
        return completions


def streamed_completions(events: list[tuple[float, dict]], n: int, logprobs: int) -> list[Completion]:
    """The `n` completions of a streamed `/v1/completions` answer: each choice's chunks (by `index`) joined, each token
    stamped with when its chunk arrived."""
    chunks: list[list[tuple[float, Completion]]] = [[] for _ in range(n)]
    for arrived, event in events:
        for choice in event.get("choices", []):
            chunks[choice["index"]].append((arrived, _completion_choice(choice, logprobs)))
    return [joined(parts, logprobs) for parts in chunks]


def joined(parts: list[tuple[float, Completion]], logprobs: int) -> Completion:
    """One choice's streamed chunks as one completion (the last chunk says why it finished)."""
    return Completion(
        token_ids=[token for _, part in parts for token in part.token_ids],
        logprobs=[value for _, part in parts for value in part.logprobs],
        finish_reason=next((part.finish_reason for _, part in reversed(parts) if part.finish_reason), None),
        stop_reason=next((part.stop_reason for _, part in reversed(parts) if part.stop_reason is not None), None),
        top_logprobs=[entry for _, part in parts for entry in part.top_logprobs or []] if logprobs else None,
        arrivals=[arrived for arrived, part in parts for _ in part.token_ids],
    )


def _completion_choice(choice: dict, logprobs: int) -> Completion:
    lp = choice.get("logprobs") or {}
    top = None
    if logprobs and lp.get("top_logprobs") is not None:
        top = [{int(k.removeprefix("token_id:")): v for k, v in entry.items()} for entry in lp["top_logprobs"]]
    return Completion(
        token_ids=choice.get("token_ids") or [],
        logprobs=lp.get("token_logprobs") or [],
        finish_reason=choice.get("finish_reason"),
        stop_reason=choice.get("stop_reason"),
        top_logprobs=top,
        weight_versions=choice.get("weight_versions"),
    )


class ControlClient(_Http):
    """The control plane: readiness, server facts, pause/resume, weight reload, LoRA adapters, load metrics."""

    async def wait_healthy(self, deadline_s: float = 240.0, interval_s: float = 0.5) -> None:
        """Poll `/health` until it answers 200, or, from `tandem proxy` (whose /health is 200 only when every replica
        is), until its /proxy/stats shows a replica up: it serves on those. TimeoutError naming the URL after
        `deadline_s`."""
        end = time.monotonic() + deadline_s
        last = "no answer"
        while time.monotonic() < end:
            try:
                await self.request("GET", "/health", retry=False, timeout_s=5)
                return
            except (ServerError, ConnectionError) as exc:
                last = str(exc)
                if isinstance(exc, ServerError) and "proxy:" in str(exc) and await self._proxy_serving():
                    return
            await asyncio.sleep(interval_s)
        raise TimeoutError(
            f"{self.base_url}/health did not answer 200 within {deadline_s:.0f}s (last: {last}). "
            "Is the generation server running and is the URL right?"
        )

    async def replica_urls(self) -> list[str]:
        """Behind tandem proxy, its replicas' URLs; [] from a server that is no proxy."""
        try:
            stats = await self.get_json("/proxy/stats", retry=False, timeout_s=5)
        except (ServerError, ConnectionError):
            return []
        return [upstream["url"] for upstream in stats.get("upstreams", [])]

    async def _proxy_serving(self) -> bool:
        """tandem proxy's own view: at least one replica up."""
        try:
            stats = await self.get_json("/proxy/stats", retry=False, timeout_s=5)
        except (ServerError, ConnectionError):
            return False
        return any(upstream.get("state") == "up" for upstream in stats.get("upstreams", []))

    async def models(self) -> list[dict]:
        return (await self.get_json("/v1/models"))["data"]

    async def max_model_len(self) -> int:
        return int((await self.models())[0]["max_model_len"])

    async def version(self) -> dict:
        """`{"version": ...}`; tandem serve adds `tandem_version`."""
        return await self.get_json("/version")

    async def server_info(self) -> dict:
        return await self.get_json("/server_info", params={"config_format": "json"})

    async def world_size(self) -> int:
        return int((await self.get_json("/get_world_size"))["world_size"])

    async def engine_request(self, method: str, path: str, **kw) -> tuple[int, str]:
        """A request the engine must act on (pause, weights, adapters), watched: vLLM's front never answers one once its
        engine process died, but its /health then answers 503 (tandem serve's and tandem proxy's alike)."""
        call = asyncio.ensure_future(self.request(method, path, **kw))
        try:
            while not (await asyncio.wait({call}, timeout=ENGINE_WATCH_S))[0]:
                await self.raise_if_engine_dead()
            return call.result()
        finally:
            call.cancel()

    async def raise_if_engine_dead(self) -> None:
        """Raise `EngineDead` when /health says the engine died; any other answer (or none) passes."""
        try:
            await self.request("GET", "/health", retry=False, timeout_s=5)
        except ServerError as exc:  # tandem proxy answers 503 while any replica is down: dead only if none is up
            if exc.status == 503 and not ("proxy:" in str(exc) and await self._proxy_serving()):
                raise EngineDead(503, "a call waiting on the engine will not be answered", exc.url) from None
        except ConnectionError:
            pass  # gone altogether: the watched call fails on its own

    async def pause(self, mode: str = "keep") -> None:
        await self.engine_request("POST", "/pause", params={"mode": mode})

    async def resume(self) -> None:
        await self.engine_request("POST", "/resume")

    async def is_paused(self) -> bool:
        return bool((await self.get_json("/is_paused"))["is_paused"])

    async def reload_weights(self, weights_path: str) -> None:
        body = {"method": "reload_weights", "kwargs": {"weights_path": weights_path, "is_checkpoint_format": True}}
        await self.engine_request("POST", "/collective_rpc", body=body)

    async def reset_prefix_cache(self) -> bool:
        _, text = await self.engine_request("POST", "/reset_prefix_cache")
        return bool(json_body(text).get("success", True))

    async def init_weight_transfer(self, init_info: dict) -> None:
        """Join the server's workers to the trainer's transfer group (returns once they have joined)."""
        await self.engine_request("POST", "/init_weight_transfer_engine", body={"init_info": init_info}, retry=False)

    async def start_weight_update(self) -> None:
        await self.engine_request("POST", "/start_weight_update", body={}, retry=False)

    async def update_weights(self, names: list[str], dtype_names: list[str], shapes: list[list[int]]) -> None:
        """Announce the tensors the trainer now broadcasts, in this order; returns once the server has them all."""
        body = {"update_info": {"names": names, "dtype_names": dtype_names, "shapes": shapes}}
        await self.engine_request("POST", "/update_weights", body=body, retry=False)

    async def finish_weight_update(self, weight_version: str | None = None) -> None:
        await self.engine_request("POST", "/finish_weight_update", body={"weight_version": weight_version}, retry=False)

    async def load_lora(self, name: str, path: str) -> None:
        await self.engine_request(
            "POST", "/v1/load_lora_adapter", body={"lora_name": name, "lora_path": path, "load_inplace": False}
        )

    async def unload_lora(self, name: str) -> None:
        await self.engine_request("POST", "/v1/unload_lora_adapter", body={"lora_name": name})

    async def metrics(self) -> ServerMetrics:
        _, text = await self.request("GET", "/metrics")
        return parse_metrics(text)


def json_body(text: str) -> dict:
    """A response's JSON object; {} for an empty body (vLLM answers some control routes with none)."""
    return json.loads(text) if text.strip() else {}


_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?\s+(\S+)")
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


def parse_prometheus(text: str) -> list[tuple[str, dict[str, str], float]]:
    """(name, labels, value) for every sample line of a Prometheus text exposition."""
    samples = []
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        match = _SAMPLE.match(line)
        if match:
            name, labels, value = match.groups()
            samples.append((name, dict(_LABEL.findall(labels or "")), float(value)))
    return samples


def parse_metrics(text: str) -> ServerMetrics:
    """The load numbers of a vLLM /metrics page, over all its engines (and replicas, behind `tandem proxy`):
    running, waiting and preemptions summed, KV capacity summed, KV usage of the fullest engine."""
    sums: dict[str, float] = {}
    usage: list[float] = []
    capacity: dict[str, float] = {}
    for name, labels, value in parse_prometheus(text):
        engine = labels.get("engine", "0") + "/" + labels.get("replica", "")
        if name == "vllm:kv_cache_usage_perc":
            usage.append(value)
        elif name == "vllm:cache_config_info" and "kv_cache_size_tokens" in labels:
            capacity[engine] = float(labels["kv_cache_size_tokens"])
        elif name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:num_preemptions_total"):
            sums[name] = sums.get(name, 0.0) + value
    total_capacity = sum(capacity.values()) or None
    return ServerMetrics(
        kv_cache_usage=max(usage, default=0.0),
        running=int(sums.get("vllm:num_requests_running", 0)),
        waiting=int(sums.get("vllm:num_requests_waiting", 0)),
        preemptions=int(sums.get("vllm:num_preemptions_total", 0)),
        kv_capacity_tokens=int(total_capacity) if total_capacity else None,
    )
