"""vLLM 0.33 response bodies built from finished engine sequences (reference/vllm_protocol.md §2-§3, §11)."""

import time
from typing import Callable

from tandem.generation.engine import EngineRequest, Sequence
from tandem.generation.sampling import floor_logprob


class TokenText:
    """Token strings the way vLLM shows them: `decode([id])`, or `token_id:<id>` when asked."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self._cache: dict[int, str] = {}

    def __call__(self, token: int, as_id: bool = False) -> str:
        if as_id:
            return f"token_id:{token}"
        if token not in self._cache:
            self._cache[token] = self.tokenizer.decode([token])
        return self._cache[token]

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)


def output_text(seq: Sequence, text: TokenText, *, include_stop: bool, skip_special: bool) -> str:
    """The choice's `text`: a stop string cuts it; the final EOS/stop token is left out unless asked for."""
    ids = seq.output
    if seq.finish_reason == "stop" and isinstance(seq.stop_reason, str):
        decoded = text.decode(ids, skip_special)
        cut = decoded.find(seq.stop_reason)
        return decoded if cut < 0 else decoded[: cut + len(seq.stop_reason) * include_stop]
    if seq.finish_reason == "stop" and not include_stop:
        ids = ids[:-1]
    return text.decode(ids, skip_special)


def completion_logprobs(seq: Sequence, k: int, text: TokenText, as_ids: bool) -> dict:
    """Completions `logprobs`: the first k+1 entries of each position's map (sampled token first)."""
    tokens = [text(t, as_ids) for t in seq.output]
    offsets, position = [], 0
    for token in tokens:
        offsets.append(position)
        position += len(token)
    limit = None if k < 0 else k + 1
    top = [{text(t, as_ids): floor_logprob(v) for t, v, _ in entries[:limit]} for entries in seq.top_logprobs]
    return {
        "text_offset": offsets, "token_logprobs": [floor_logprob(v) for v in seq.logprobs],
        "tokens": tokens, "top_logprobs": top,
    }


def chat_logprobs(seq: Sequence, k: int, text: TokenText, as_ids: bool) -> dict:
    """Chat `logprobs.content`: per token, the first k entries of the map (sampled first, then by rank)."""

    def entry(token: int, value: float) -> dict:
        s = text(token, as_ids)
        return {"token": s, "logprob": floor_logprob(value), "bytes": list(s.encode())}

    content = []
    for token, value, entries in zip(seq.output, seq.logprobs, seq.top_logprobs):
        content.append({**entry(token, value), "top_logprobs": [entry(t, v) for t, v, _ in entries[: max(k, 0)]]})
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
        None if position is None else {
            str(t): {"logprob": floor_logprob(v), "rank": r, "decoded_token": text(t)} for t, (v, r) in position.items()
        }
        for position in request.prompt_logprobs
    ]


def usage(requests: list[EngineRequest]) -> dict:
    prompt = sum(len(r.prompt) for r in requests)
    completion = sum(len(s.output) for r in requests for s in r.sequences)
    return {
        "prompt_tokens": prompt, "total_tokens": prompt + completion, "completion_tokens": completion,
        "prompt_tokens_details": None, "completion_tokens_details": None,
    }


def completion_body(request_id: str, model: str, fingerprint: str, requests: list[EngineRequest],
                    choice: Callable[[EngineRequest, Sequence], dict]) -> dict:
    choices = [choice(r, s) for r in requests for s in r.sequences]
    for index, c in enumerate(choices):
        c["index"] = index
    return {
        "id": request_id, "object": "text_completion", "created": int(time.time()), "model": model,
        "choices": choices, "service_tier": None, "system_fingerprint": fingerprint, "usage": usage(requests),
        "kv_transfer_params": None, "ec_transfer_params": None, "metrics": None,
    }
