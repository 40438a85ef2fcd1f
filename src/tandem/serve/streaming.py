"""Streaming as vLLM 0.33 does it on its completion and chat routes: server-sent events `data: <json>`
carrying each choice's new tokens as the engine produces them, `finish_reason` on a choice's last chunk, a usage
chunk when asked, then `data: [DONE]`.

The engine thread appends a token to all of a sequence's lists, checks its stop conditions, then either raises the
sequence's `checked` count or sets `finish_reason`. A reader here reads `finish_reason` first: while it is unset only
the checked tokens are sent, so a chunk never holds half a step or a token that completed a stop string. A choice's
text is decoded from all its tokens each time, holding back an unfinished character and any tail that could begin a
stop string; at the end it is the non-streamed text, so the chunks join into it.
"""

import json
import time
from dataclasses import dataclass
from typing import Generic, TypeVar

from tandem.chat.tool_formats import served_reply
from tandem.serve.protocol import ChatCompletionRequest, CompletionRequest
from tandem.serve.requests import EngineRequest, Sequence
from tandem.serve.responses import (
    ChatReply,
    TokenText,
    chat_finish_reason,
    chat_logprobs,
    completion_logprobs,
    echoed,
    message_tool_calls,
    output_text,
    prompt_tokens_details,
    top_count,
    weight_versions,
)

DONE = b"data: [DONE]\n\n"


def sse(data: dict) -> bytes:
    """One server-sent event carrying `data` as JSON."""
    return b"data: " + json.dumps(data).encode() + b"\n\n"


def without_partial(text: str, markers: list[str]) -> str:
    """`text` less its longest tail that is the start of a marker (a stop string, a tool-call tag) but not all of it:
    what may be sent before the next token says whether the marker is there."""
    hold = max((k for marker in markers for k in range(1, len(marker)) if text.endswith(marker[:k])), default=0)
    return text[: len(text) - hold]


@dataclass
class Progress:
    """What one choice has streamed so far."""

    request: EngineRequest
    seq: Sequence
    index: int
    tokens: int = 0
    text: str = ""
    offset: int = 0
    """The completions `text_offset` of its next token."""
    started: bool = False
    done: bool = False

    def ready(self) -> tuple[int, bool]:
        """How many tokens may be sent, and whether the sequence has finished. `finish_reason` is read first: once set,
        every list is complete; before, only the tokens the engine has checked for stop conditions count."""
        if self.seq.finish_reason is not None:
            return len(self.seq.output), True
        return self.seq.checked, False


@dataclass(frozen=True)
class StreamOptions:
    """What a stream carries besides its tokens: usage (the request's `stream_options`, or every stream's on a
    `--enable-force-include-usage` server), the prompt-token details in the last usage chunk, and how many tokens
    a chunk holds at least (`stream_interval`, the request's or `--stream-interval`, whichever is larger)."""

    include_usage: bool = False
    continuous_usage: bool = False
    interval: int = 1
    details: str | None = None
    """"completions" or "chat" on a `--enable-prompt-tokens-details` server."""

    @classmethod
    def of(
        cls, req: CompletionRequest | ChatCompletionRequest, *, force_usage: bool, interval: int, details: bool
    ) -> "StreamOptions":
        options = req.stream_options or {}
        include = force_usage or bool(options.get("include_usage"))
        continuous = force_usage or (include and bool(options.get("continuous_usage_stats")))
        route = "completions" if isinstance(req, CompletionRequest) else "chat"
        return cls(include, continuous, max(req.stream_interval or 1, interval), route if details else None)


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    """A stream's `usage` object (the prompt-token details go on the final usage chunk only, as in vLLM)."""
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


Req = TypeVar("Req", bound=CompletionRequest | ChatCompletionRequest)


class Stream(Generic[Req]):
    """The chunks of one streamed request: `chunks()` after each engine step, `final()` once all have finished."""

    object_name = ""

    def __init__(
        self,
        req: Req,
        requests: list[EngineRequest],
        request_id: str,
        model: str,
        fingerprint: str,
        text: TokenText,
        stops: list[str],
        options: StreamOptions,
    ):
        self.req, self.requests, self.text, self.stops, self.options = req, requests, text, stops, options
        self.head = {"id": request_id, "object": self.object_name, "created": int(time.time()), "model": model}
        self.fingerprint = fingerprint
        self.include_usage, self.continuous_usage = options.include_usage, options.continuous_usage
        self.progress = [Progress(r, s, i) for i, (r, s) in enumerate((r, s) for r in requests for s in r.sequences)]

    def chunks(self) -> list[dict]:
        """The chunks of every token produced since the last call: one per token (or per `interval` tokens, the first
        and the last at once), as vLLM sends them per engine step, so what a client receives never depends on how
        long the server took to read the engine."""
        out = []
        for p in self.progress:
            if p.done:
                continue
            count, finished = p.ready()
            ends, last = [], p.tokens
            for end in range(p.tokens + 1, count + 1):  # as vLLM: once `interval` tokens have gathered since the last
                if end == 1 or end - last >= self.options.interval:
                    ends.append(end)
                    last = end
            if finished and (not ends or ends[-1] != count):
                ends.append(count)
            for end in ends:
                chunk = self._step(p, end, finished and end == count)
                if chunk is not None:
                    out.append(chunk)
        return out

    def _step(self, p: Progress, end: int, finished: bool) -> dict | None:
        """The chunk of choice `p`'s tokens up to `end` (None when it has nothing to say yet)."""
        new, positions = p.seq.output[p.tokens : end], p.seq.top_logprobs[p.tokens : end]
        text = self._final_text(p.seq) if finished else self._visible_text(p.seq.output[:end])
        delta = text[len(p.text) :] if len(text) > len(p.text) else ""
        chunk = self._chunk(p, new, positions, delta, finished)
        p.tokens, p.text, p.done, p.started = end, p.text + delta, finished, True
        if chunk is not None:
            if self.continuous_usage:
                chunk["usage"] = usage(len(p.request.prompt), p.tokens)
            if finished and not self.include_usage:
                chunk["system_fingerprint"] = self.fingerprint
        return chunk

    def final(self) -> list[dict]:
        """The usage chunk when `stream_options.include_usage` asks for it."""
        if not self.include_usage:
            return []
        prompt = sum(len(r.prompt) for r in self.requests)
        totals = usage(prompt, sum(p.tokens for p in self.progress))
        if self.options.details:
            totals["prompt_tokens_details"] = prompt_tokens_details(self.requests[-1], self.options.details)
        return [{**self.head, "choices": [], "usage": totals, "system_fingerprint": self.fingerprint}]

    def _visible_text(self, tokens: list[int]) -> str:
        """The text of a running choice that can be sent now: no unfinished character, no possible stop-string start."""
        return without_partial(self.text.decode(tokens, self.req.skips_special_tokens).rstrip("\ufffd"), self.stops)

    def _final_text(self, seq: Sequence) -> str:
        return output_text(
            seq,
            self.text,
            include_stop=self.req.include_stop_str_in_output,
            skip_special=self.req.skips_special_tokens,
            min_tokens=self.req.min_tokens,
        )

    def _chunk(self, p: Progress, new: list[int], positions: list, delta: str, finished: bool) -> dict | None:
        raise NotImplementedError


class CompletionStream(Stream[CompletionRequest]):
    """`/v1/completions` chunks: `text`, `logprobs` and `token_ids` of the new tokens; with `echo` the first chunk of
    each choice starts with the prompt (its text, ids and log-probs), as in the non-streamed answer."""

    object_name = "text_completion"

    def __init__(self, *args, prompt_texts: list[str]):
        super().__init__(*args)
        self.prompt_text = {id(r): t for r, t in zip(self.requests, prompt_texts)}

    def _chunk(self, p, new, positions, delta, finished):
        req, as_ids = self.req, bool(self.req.return_tokens_as_token_ids)
        tokens, prompt_ids = new, (p.request.prompt if req.return_token_ids and not p.started else None)
        if req.echo and not p.started:  # vLLM sends the prompt's ids with an echo whatever return_token_ids says
            delta, tokens, positions = echoed(req, p.request, delta, new, positions, self.prompt_text[id(p.request)])
            prompt_ids = p.request.prompt
        logprobs = None
        if req.logprobs is not None:
            logprobs = completion_logprobs(tokens, positions, top_count(req), self.text, as_ids, p.offset)
            if logprobs["tokens"]:
                p.offset = logprobs["text_offset"][-1] + len(logprobs["tokens"][-1])
        choice = {
            "index": p.index,
            "text": delta,
            "logprobs": logprobs,
            "finish_reason": p.seq.finish_reason if finished else None,
            "stop_reason": p.seq.stop_reason if finished else None,
            "prompt_token_ids": prompt_ids,
            "token_ids": list(new) if req.return_token_ids else None,
            "weight_versions": weight_versions(p.seq) if finished and req.return_weight_versions else None,
        }
        return {**self.head, "choices": [choice], "kv_transfer_params": None}


class ChatStream(Stream[ChatCompletionRequest]):
    """`/v1/chat/completions` chunks: first, for every choice, `delta: {role, content: ""}` (with the prompt's ids
    when asked); then `delta.content`, `logprobs.content` and `token_ids` of the new tokens. With a `tool_format` the
    content stops where a call may start (hermes: at `<tool_call>`; the other formats hold the whole content to the
    end, where the reading decides what is content), and the choice's last chunk carries the parsed calls as
    `delta.tool_calls` (whole, one entry per call) — or the rest of the text, when the reply makes no valid call."""

    object_name = "chat.completion.chunk"

    def __init__(self, *args, reply: ChatReply):
        super().__init__(*args)
        self.reply, self.tool_format = reply, reply.tool_format
        self.calls: dict[int, list[tuple[str, str]]] = {}
        """Each finished choice's parsed calls, by choice index."""
        self.roles_sent = False

    def chunks(self) -> list[dict]:
        roles = []
        if not self.roles_sent:  # once, even when the first call comes before any token (a step that only prefilled)
            self.roles_sent = True
            request = self.requests[0]
            prompt_text = self.text.decode(request.prompt, False) if self.req.return_prompt_text else None
            for p in self.progress:
                choice = {
                    "index": p.index,
                    "delta": {"role": self.reply.role, "content": ""},
                    "logprobs": None,
                    "finish_reason": None,
                }
                chunk = {
                    **self.head,
                    "choices": [choice],
                    "prompt_token_ids": list(request.prompt) if self.req.return_token_ids else None,
                    "prompt_text": prompt_text,
                }
                roles.append(chunk)
            if self.reply.echoed:  # echo: the continued message's content, before the generated deltas
                roles += [
                    {
                        **self.head,
                        "choices": [
                            {
                                "index": p.index,
                                "delta": {"content": self.reply.echoed},
                                "logprobs": None,
                                "finish_reason": None,
                            }
                        ],
                    }
                    for p in self.progress
                ]
            if self.continuous_usage:
                for chunk in roles:
                    chunk["usage"] = usage(len(request.prompt), 0)
        return roles + super().chunks()

    def _visible_text(self, tokens: list[int]) -> str:
        text = super()._visible_text(tokens)
        if self.tool_format is None:
            return text
        marker = self.tool_format.streams_until
        if marker is None:
            return ""
        return text[: text.find(marker)] if marker in text else without_partial(text, [marker])

    def _final_text(self, seq: Sequence) -> str:
        text = super()._final_text(seq)
        if self.tool_format is None:
            return text
        content, self.calls[seq.index] = served_reply(self.tool_format, text)
        return content or ""

    def _chunk(self, p, new, positions, delta, finished):
        req = self.req
        logprobs = None
        if req.logprobs:
            logprobs = chat_logprobs(new, positions, self.reply.top, self.text, bool(req.return_tokens_as_token_ids))
        parsed = self.calls.get(p.seq.index, []) if finished else []
        calls = [{"index": i, **call} for i, call in enumerate(message_tool_calls(parsed, req.parallel_tool_calls))]
        if not delta and not finished and logprobs is None and not req.return_token_ids:
            return None  # nothing to say yet (a held-back character, stop-string start or tool call)
        message = ({"content": delta} if delta else {}) | ({"tool_calls": calls} if calls else {})
        choice = {
            "index": p.index,
            "delta": message,
            "logprobs": logprobs,
            "finish_reason": chat_finish_reason(p.seq, bool(calls)) if finished else None,
            "token_ids": list(new) if req.return_token_ids else None,
        }
        if finished:
            choice |= {
                "stop_reason": p.seq.stop_reason,
                "weight_versions": weight_versions(p.seq) if req.return_weight_versions else None,
            }
        return {**self.head, "choices": [choice], "kv_transfer_params": None}
