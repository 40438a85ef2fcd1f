"""What the proxy reads from a request and writes back, as pure functions: the prompt the router hashes, a
completions batch split into one request per prompt and the answers merged back, the headers that pass through, its
errors in vLLM's shape, and the replicas' `/metrics` put together."""

from typing import TYPE_CHECKING

from aiohttp import web

from tandem.chat.prompts import render_chat
from tandem.generation.client import parse_metrics
from tandem.httpapp import error_response

if TYPE_CHECKING:  # a replica, as the messages about it name it (replicas.py imports this module)
    from tandem.proxy.replicas import Upstream

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


def failed_on(what: str, failed: "list[tuple[Upstream, int, bytes]]", total: int, note: str = "") -> str:
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


def load_lines(loads: dict[int, dict[str, float]]) -> list[str]:
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


def replica_load(text: str) -> dict[str, float]:
    """One replica's load from its /metrics: its engines summed, KV usage as its fullest engine's."""
    m = parse_metrics(text)
    return {
        "num_requests_running": m.running,
        "num_requests_waiting": m.waiting,
        "num_preemptions": m.preemptions,
        "kv_cache_usage_perc": m.kv_cache_usage,
        "kv_cache_size_tokens": m.kv_capacity_tokens or 0,
    }
