"""Request preparation: the one path from a generation request to the engine requests that serve it.

`/v1/completions`, `/v1/chat/completions` and `/inference/v1/generate` spell a request differently;
each says what it asks for as an `Ask`, and `Preparer.engine_requests` applies vLLM's rules to all
three alike: prompt checks, the effective max_tokens, the server seed, sampling parameters, `n`,
stop strings. Every refusal is an `ApiError` (400), so the client learns what to change.
"""

import random
from dataclasses import dataclass

from tandem.generation import protocol
from tandem.generation.engine import EngineRequest
from tandem.generation.protocol import bad_request
from tandem.generation.sampling import SamplingParams
from tandem.prompts import TEMPLATE_ERRORS, render_chat


@dataclass
class Ask:
    """What one request asks the engine for, whichever endpoint it came through."""

    prompts: list[list[int]]
    sampling: protocol.Sampling
    max_tokens: int | None
    default_max_tokens: int | None = None
    """Used when the request sends no max_tokens (16 for completions, the context otherwise)."""
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    sampling_mask: bool = False
    """Return each token's kept vocabulary (`/inference/v1/generate` on a `--return-sampling-mask` server)."""


@dataclass
class Preparer:
    """The served model's limits and the server's defaults that every generation request is checked against."""

    tokenizer: object
    vocab_size: int
    max_model_len: int
    defaults: dict
    """Sampling defaults from generation_config.json (`--generation-config`)."""
    max_logprobs: int
    max_num_seqs: int
    return_sampling_mask: bool
    seed_rng: random.Random | None
    """Seeds requests that send none (`--seed`)."""

    def engine_requests(self, ask: Ask, adapter: str | None) -> list[EngineRequest]:
        """One engine request per prompt, or an ApiError naming the first thing the request got wrong."""
        stops = protocol.stop_strings(ask.sampling.stop)
        requests = []
        for ids in ask.prompts:
            self.check_prompt(ids)
            fields = {**ask.sampling.model_dump(), "seed": self.seed(ask.sampling.seed)}  # each prompt its own server seed
            params = protocol.sampling_params(
                fields, self.defaults, max_tokens=self.max_tokens(ask.max_tokens, len(ids), ask.default_max_tokens),
                max_logprobs=self.max_logprobs, vocab_size=self.vocab_size, logprobs=ask.logprobs,
                prompt_logprobs=ask.prompt_logprobs,
            )
            self.check_n(ask.sampling.n, params)
            self.check_sampling_mask_request(params)
            requests.append(EngineRequest(prompt=list(ids), params=params, n=ask.sampling.n, adapter=adapter,
                                          return_sampling_mask=ask.sampling_mask,
                                          stop_check=self.stop_check(stops, ask.sampling.skips_special_tokens)))
        return requests

    def prompt_ids(self, prompt: list[int] | list[list[int]] | str | list[str]) -> list[list[int]]:
        """A completions `prompt` (one or a batch, ids or text) as a list of token-id prompts."""
        if isinstance(prompt, str):
            return [self.tokenizer.encode(prompt)]
        if prompt and isinstance(prompt[0], str):
            return [self.tokenizer.encode(p) for p in prompt]
        if prompt and isinstance(prompt[0], list):
            return prompt
        return [prompt]

    def render_chat(self, req: protocol.ChatCompletionRequest | protocol.TokenizeRequest) -> list[int]:
        """The request's messages through the chat template, with its tools and template options."""
        try:
            tools = [as_vllm_renders(tool) for tool in req.tools] if req.tools else req.tools
            return render_chat(self.tokenizer, req.messages, tools=tools, add_generation_prompt=req.add_generation_prompt,
                               continue_final_message=req.continue_final_message, chat_template=req.chat_template,
                               chat_template_kwargs=req.chat_template_kwargs)
        except TEMPLATE_ERRORS as exc:  # the template rejecting these messages is the caller's input error
            raise bad_request(f"The chat template could not render these messages: {exc}", "messages", None) from None

    def check_prompt(self, ids: list[int]) -> None:
        """vLLM's prompt checks: every id in the vocabulary, not empty, within the context."""
        bad = next((t for t in ids if t >= self.vocab_size), None)
        if bad is not None:
            raise bad_request(f"Token id {bad} is out of vocabulary")  # vLLM names no parameter here
        if not ids:
            raise bad_request("The prompt is empty: send at least one token.", "prompt", ids)
        if len(ids) > self.max_model_len:
            raise bad_request(
                f"This model's maximum context length is {self.max_model_len} tokens. However, your prompt contains "
                f"{len(ids)} input tokens, which exceeds this limit even without any output tokens. Please reduce the "
                "length of the input prompt.", "prompt", len(ids))

    def max_tokens(self, requested: int | None, prompt_len: int, default: int | None) -> int:
        """vLLM 0.32+: min(max_tokens, max_model_len - prompt_len, generation_config max_new_tokens)."""
        if requested is not None and requested < 1:
            raise bad_request(f"max_tokens must be at least 1, got {requested}.", "max_tokens", requested)
        caps = [self.max_model_len - prompt_len, requested if requested is not None else default, self.defaults.get("max_tokens")]
        value = min(c for c in caps if c is not None)
        if value < 1:
            raise bad_request(f"max_tokens must be at least 1, got {value}.", "max_tokens", value)
        return value

    def seed(self, seed: int | None) -> int | None:
        """The request's seed, or a fresh draw from `--seed`'s generator (a new one at every call)."""
        return seed if seed is not None or self.seed_rng is None else self.seed_rng.getrandbits(62)

    def check_n(self, n: int, params: SamplingParams) -> None:
        """`n` as vLLM allows it: at least 1, 1 under greedy sampling, at most the engine's sequences."""
        if n < 1:
            raise bad_request(f"n must be at least 1, got {n}.", "n", n)
        if n > 1 and params.greedy:
            raise bad_request(f"n must be 1 when using greedy sampling, got {n}.", "n", n)
        if n > self.max_num_seqs:
            raise bad_request(f"n must be at most max_num_seqs={self.max_num_seqs}, got {n}.", "n", n)

    def check_sampling_mask_request(self, params: SamplingParams) -> None:
        """A sampling mask lists the top-k kept tokens, so a mask server needs sampling with top_k."""
        if not self.return_sampling_mask:
            return
        if params.temperature <= 0:
            raise bad_request("sampling distribution replay requires temperature > 0", "temperature", params.temperature)
        if params.top_k <= 0:
            raise bad_request("sampling distribution replay requires top_k > 0", "top_k", params.top_k)

    def stop_check(self, stops: list[str], skip_special: bool):
        """The engine's per-step test for stop strings in the decoded output (None when there are none)."""
        if not stops:
            return None

        def check(output: list[int]) -> str | None:
            decoded = self.tokenizer.decode(output, skip_special_tokens=skip_special)
            return next((s for s in stops if s in decoded), None)

        return check


FUNCTION_FIELDS = ("name", "description", "parameters", "strict", "defer_loading")
"""What vLLM keeps of a tool's function when it renders the chat template (its FunctionDefinition)."""


def as_vllm_renders(tool: dict) -> dict:
    """A request's tool as vLLM hands it to the chat template: the function's own fields, unset ones and extras (a
    "return" schema, say) left out, so the same request renders to the same prompt on both servers."""
    if not isinstance(tool, dict) or not isinstance(tool.get("function"), dict):
        return tool
    function = {key: tool["function"][key] for key in FUNCTION_FIELDS if tool["function"].get(key) is not None}
    return {"type": tool.get("type", "function"), "function": function}

