"""vLLM 0.33 response bodies built from finished engine sequences: completions, chat completions and
`/inference/v1/generate`."""

import time
import uuid
from dataclasses import dataclass
from typing import cast

from transformers import PreTrainedTokenizerBase

from tandem.chat.prompts import with_content_as
from tandem.chat.tool_formats import ToolCallFormat, served_reply
from tandem.serve.protocol import ChatCompletionRequest, CompletionRequest, GenerateRequest, find_stop
from tandem.serve.requests import EngineRequest, Sequence
from tandem.serve.sampling import floor_logprob


class TokenText:
    """Token strings the way vLLM shows them: `decode([id])`, or `token_id:<id>` when asked."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        self.tokenizer = tokenizer
        self._cache: dict[int, str] = {}

    def __call__(self, token: int, as_id: bool = False) -> str:
        if as_id:
            return f"token_id:{token}"
        if token not in self._cache:
            self._cache[token] = cast(str, self.tokenizer.decode([token]))
        return self._cache[token]

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        """One sequence's text (transformers' decode also takes a batch, hence its list of texts in the types)."""
        return cast(str, self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens))


def output_text(seq: Sequence, text: TokenText, *, include_stop: bool, skip_special: bool, min_tokens: int = 0) -> str:
    """The choice's `text`: a stop string cuts it (where the engine found it: past the first `min_tokens` tokens); the
    final EOS/stop token is left out unless asked for."""
    ids = seq.output
    if seq.finish_reason == "stop" and isinstance(seq.stop_reason, str):
        decoded = text.decode(ids, skip_special)
        before = len(text.decode(ids[:min_tokens], skip_special)) if min_tokens else 0
        found = find_stop(decoded, [seq.stop_reason], before)
        return decoded if found is None else decoded[: found[1] + len(seq.stop_reason) * include_stop]
    if seq.finish_reason == "stop" and not include_stop:
        ids = ids[:-1]
    return text.decode(ids, skip_special)


def completion_logprobs(
    token_ids: list[int], positions: list, k: int, text: TokenText, as_ids: bool, first_offset: int = 0
) -> dict:
    """Completions `logprobs` over `token_ids`: at each position the first k+1 entries of its map (the token itself
    first, then by rank), or nulls where it has none (an echoed prompt's first token)."""
    tokens = [text(t, as_ids) for t in token_ids]
    offsets, position = [], first_offset
    for token in tokens:
        offsets.append(position)
        position += len(token)
    limit = None if k < 0 else k + 1
    return {
        "text_offset": offsets,
        "token_logprobs": [None if entries is None else floor_logprob(entries[0][1]) for entries in positions],
        "tokens": tokens,
        "top_logprobs": [
            None if entries is None else {text(t, as_ids): floor_logprob(v) for t, v, _ in entries[:limit]}
            for entries in positions
        ],
    }


def prompt_positions(request: EngineRequest) -> list:
    """The prompt's log-prob entries as `(id, value, rank)` lists, the prompt token first (None at position 0)."""
    assert request.prompt_logprobs is not None, "asked only of a request that wants prompt log-probs"
    return [None if p is None else [(t, v, r) for t, (v, r) in p.items()] for p in request.prompt_logprobs]


def chat_logprobs(token_ids: list[int], positions: list, k: int, text: TokenText, as_ids: bool) -> dict:
    """Chat `logprobs.content`: per token, the first k entries of its map (sampled first, then by rank)."""

    def entry(token: int, value: float) -> dict:
        s = text(token, as_ids)
        return {"token": s, "logprob": floor_logprob(value), "bytes": list(s.encode())}

    content = []
    for token, entries in zip(token_ids, positions):
        listed = entries if k < 0 else entries[:k]
        content.append({**entry(token, entries[0][1]), "top_logprobs": [entry(t, v) for t, v, _ in listed]})
    return {"content": content}


def generate_logprobs(seq: Sequence) -> dict:
    """`/inference/v1/generate` logprobs (0.32+): integer token ids, top list not trimmed."""
    content = []
    for token, value, entries in zip(seq.output, seq.logprobs, seq.top_logprobs):
        top = [{"token_id": t, "logprob": floor_logprob(v), "rank": r} for t, v, r in entries]
        rank = entries[0][2] if entries else None
        content.append({"token_id": token, "logprob": floor_logprob(value), "rank": rank, "top_logprobs": top})
    return {"content": content}


def prompt_logprobs_json(request: EngineRequest, text: TokenText) -> list | None:
    if request.prompt_logprobs is None:
        return None
    return [
        None
        if position is None
        else {
            str(t): {"logprob": floor_logprob(v), "rank": r, "decoded_token": text(t)} for t, (v, r) in position.items()
        }
        for position in request.prompt_logprobs
    ]


def usage(requests: list[EngineRequest], details: str | None = None) -> dict:
    """`usage`; with `details` ("completions" or "chat", `--enable-prompt-tokens-details`) the prompt tokens the prefix
    cache held (the last prompt's, as vLLM reports a batch) and, in chat, those it newly stored."""
    prompt = sum(len(r.prompt) for r in requests)
    completion = sum(len(s.output) for r in requests for s in r.sequences)
    return {
        "prompt_tokens": prompt,
        "total_tokens": prompt + completion,
        "completion_tokens": completion,
        "prompt_tokens_details": prompt_tokens_details(requests[-1], details) if details else None,
        "completion_tokens_details": None,
    }


def prompt_tokens_details(request: EngineRequest, route: str) -> dict:
    created = request.created_cache_tokens if route == "chat" else None
    return {"cached_tokens": request.cached_tokens, "created_cache_tokens": created, "multimodal_tokens": None}


def top_count(req: CompletionRequest | ChatCompletionRequest) -> int:
    """How many of each position's entries a response lists: all (-1) for `logprob_token_ids` or a whole-vocabulary
    request, else the request's count (completions' `logprobs`, chat's `top_logprobs`)."""
    if req.logprob_token_ids:
        return -1
    if isinstance(req, CompletionRequest):
        return req.logprobs or 0  # asked only of a request that wants log-probs
    return req.top_logprobs or 0


def weight_versions(seq: Sequence) -> list[dict]:
    """`weight_versions`: half-open spans of the output's tokens, each with the label of the weights that sampled it."""
    starts = [start for _, start in seq.weight_versions]
    return [
        {"version": version, "start": start, "end": end}
        for (version, start), end in zip(seq.weight_versions, starts[1:] + [len(seq.output)])
    ]


def completion_choice(
    req: CompletionRequest, request: EngineRequest, seq: Sequence, text: TokenText, prompt_text: str
) -> dict:
    """One choice. With `echo` its text and log-probs start with the prompt's (vLLM 0.33): the prompt as sent ("" when
    token ids are returned), its log-probs (the first null) and then the output's; `max_tokens: 0` gives the prompt
    alone, though one token was generated (in `token_ids` and `usage`, as vLLM does)."""
    output = output_text(
        seq,
        text,
        include_stop=req.include_stop_str_in_output,
        skip_special=req.skips_special_tokens,
        min_tokens=req.min_tokens,
    )
    as_ids = bool(req.return_tokens_as_token_ids)
    token_ids, positions = list(seq.output), seq.top_logprobs
    if req.echo:
        output, token_ids, positions = echoed(req, request, output, token_ids, positions, prompt_text)
    return {
        "index": 0,
        "text": output,
        "logprobs": None
        if req.logprobs is None
        else completion_logprobs(token_ids, positions, top_count(req), text, as_ids),
        "finish_reason": seq.finish_reason,
        "stop_reason": seq.stop_reason,
        "token_ids": list(seq.output) if req.return_token_ids else None,
        "prompt_logprobs": prompt_logprobs_json(request, text),
        "prompt_token_ids": list(request.prompt) if req.return_token_ids else None,
        "routed_experts": None,
        "weight_versions": weight_versions(seq) if req.return_weight_versions else None,
    }


def echoed(
    req: CompletionRequest, request: EngineRequest, output: str, token_ids: list[int], positions: list, prompt_text: str
) -> tuple[str, list[int], list]:
    """Text, token ids and log-prob positions with the prompt in front, as `echo` shows them: the prompt as sent (""
    when token ids are returned) and, with `logprobs`, the prompt's log-probs; `max_tokens: 0` gives the prompt alone."""
    only_prompt = req.max_tokens == 0
    text = ("" if req.return_token_ids else prompt_text) + ("" if only_prompt else output)
    if req.logprobs is None:
        return text, token_ids, positions
    return (
        text,
        request.prompt + ([] if only_prompt else token_ids),
        prompt_positions(request) + ([] if only_prompt else positions),
    )


def completion_body(
    request_id: str,
    model: str,
    fingerprint: str | None,
    req: CompletionRequest,
    requests: list[EngineRequest],
    text: TokenText,
    prompt_texts: list[str],
    details: bool = False,
) -> dict:
    """`/v1/completions`: choices numbered across prompts, then samples (prompt i's sample j is i·n + j)."""
    triples = [(r, s, prompt) for r, prompt in zip(requests, prompt_texts) for s in r.sequences]
    choices = [
        {**completion_choice(req, r, s, text, prompt), "index": index} for index, (r, s, prompt) in enumerate(triples)
    ]
    return {
        "id": request_id,
        "object": "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": choices,
        "service_tier": None,
        "system_fingerprint": fingerprint,
        "usage": usage(requests, "completions" if details else None),
        "kv_transfer_params": None,
        "ec_transfer_params": None,
        "metrics": None,
    }


def message_tool_calls(calls: list[tuple[str, str]], parallel: bool | None) -> list[dict]:
    """Parsed (name, arguments JSON) calls as `message.tool_calls`; the first alone when the request set
    `parallel_tool_calls: false`."""
    return [
        {
            "id": f"chatcmpl-tool-{uuid.uuid4().hex}",
            "type": "function",
            "function": {"name": name, "arguments": arguments},
        }
        for name, arguments in (calls if parallel is not False else calls[:1])
    ]


def chat_finish_reason(seq: Sequence, called: bool) -> str | None:
    """vLLM reports a reply that stopped on its own after tool calls as "tool_calls"; a length cut stays visible."""
    return "tool_calls" if called and seq.finish_reason == "stop" else seq.finish_reason


@dataclass(frozen=True)
class ChatReply:
    """How each chat choice is written: its role, what `echo` puts before the reply, how many log-prob entries it
    lists, the tool-call format its calls are read in."""

    role: str
    echoed: str
    top: int
    text: TokenText
    tool_format: ToolCallFormat | None

    @classmethod
    def of(
        cls, req: ChatCompletionRequest, response_role: str, text: TokenText, tool_format: ToolCallFormat | None
    ) -> "ChatReply":
        """vLLM's rules: the role is `--response-role` after a generation prompt, else the last message's; echo
        repeats the last message's content when its role is the reply's (a continued assistant message)."""
        last = req.messages[-1] if req.messages and isinstance(req.messages[-1], dict) else {}
        role = response_role if req.add_generation_prompt else str(last.get("role", response_role))
        echoed = ""
        if req.echo and last.get("role") == role and isinstance(last.get("content"), (str, list)):
            echoed = with_content_as(last, "string")["content"]  # parts joined, as the prompt rendered them
        return cls(role, echoed, top_count(req), text, tool_format)

    def choice(self, req: ChatCompletionRequest, seq: Sequence) -> dict:
        """One choice; with a `tool_format` (tool_choice "auto" on a server with a tool-call parser) the reply's tool
        calls move from the content to `message.tool_calls`, as vLLM's parser of that format reads them."""
        generated = output_text(
            seq,
            self.text,
            include_stop=req.include_stop_str_in_output,
            skip_special=req.skips_special_tokens,
            min_tokens=req.min_tokens,
        )
        content: str | None = generated
        calls = []
        if self.tool_format is not None:
            content, parsed = served_reply(self.tool_format, generated)
            calls = message_tool_calls(parsed, req.parallel_tool_calls)
        message = {
            "role": self.role,
            "content": self.echoed + (content or "") if self.echoed else content,
            "refusal": None,
            "annotations": None,
            "audio": None,
            "function_call": None,
            "reasoning": None,
        }
        as_ids = bool(req.return_tokens_as_token_ids)
        return {
            "index": seq.index,
            "message": message | ({"tool_calls": calls} if calls else {}),
            "logprobs": chat_logprobs(seq.output, seq.top_logprobs, self.top, self.text, as_ids)
            if req.logprobs
            else None,
            "finish_reason": chat_finish_reason(seq, bool(calls)),
            "stop_reason": seq.stop_reason,
            "token_ids": list(seq.output) if req.return_token_ids else None,
            "routed_experts": None,
            "weight_versions": weight_versions(seq) if req.return_weight_versions else None,
        }


def chat_body(
    request_id: str,
    model: str,
    fingerprint: str | None,
    req: ChatCompletionRequest,
    request: EngineRequest,
    reply: ChatReply,
    details: bool = False,
) -> dict:
    return {
        "id": request_id,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": [reply.choice(req, s) for s in request.sequences],
        "service_tier": None,
        "system_fingerprint": fingerprint,
        "usage": usage([request], "chat" if details else None),
        "prompt_logprobs": prompt_logprobs_json(request, reply.text),
        "prompt_token_ids": list(request.prompt) if req.return_token_ids else None,
        "prompt_text": reply.text.decode(request.prompt, skip_special_tokens=False) if req.return_prompt_text else None,
        "kv_transfer_params": None,
        "ec_transfer_params": None,
        "metrics": None,
    }


def generate_choice(req: GenerateRequest, seq: Sequence, text: TokenText, sampling_mask: bool) -> dict:
    """One choice, its tokens labelled with the weights that sampled them."""
    sp = req.sampling_params
    choice = {
        "index": seq.index,
        "finish_reason": seq.finish_reason,
        "stop_reason": seq.stop_reason,
        "token_ids": list(seq.output),
        "routed_experts": None,
        "sampling_mask": seq.sampling_masks if sampling_mask else None,
        "weight_versions": weight_versions(seq),
        "logprobs": generate_logprobs(seq) if sp.logprobs is not None else None,
    }
    if req.output_mode == "text":
        choice["text"] = output_text(
            seq, text, include_stop=False, skip_special=sp.skips_special_tokens, min_tokens=sp.min_tokens
        )
    return choice


def generate_body(
    request_id: str,
    model: str,
    req: GenerateRequest,
    request: EngineRequest,
    text: TokenText,
    sampling_mask: bool,
    details: bool = False,
) -> dict:
    """`/inference/v1/generate`: token ids out; `sampling_mask` when the server returns masks."""
    return {
        "request_id": request_id,
        "model": model,
        "created": int(time.time()),
        "usage": usage([request], "completions" if details else None),
        "prompt_logprobs": prompt_logprobs_json(request, text),
        "prompt_token_id_logprobs": None,
        "prompt_token_ids": list(req.token_ids) if req.return_token_ids else None,
        "mm_placeholders": None,
        "metrics": None,
        "kv_transfer_params": None,
        "ec_transfer_params": None,
        "output_mode": req.output_mode,
        "choices": [generate_choice(req, s, text, sampling_mask) for s in request.sequences],
    }
