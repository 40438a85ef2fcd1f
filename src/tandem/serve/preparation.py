"""Request preparation: the one path from a generation request to the engine requests that serve it.

`/v1/completions`, `/v1/chat/completions` and `/inference/v1/generate` spell a request differently;
each says what it asks for as an `Ask`, and `Preparer.engine_requests` applies vLLM's rules to all
three alike: prompt checks, the effective max_tokens, the server seed, sampling parameters, `n`,
stop strings. Every refusal is an `ApiError` (400), so the client learns what to change.
"""

import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import cast

from transformers import PreTrainedTokenizerBase

from tandem.chat.prompts import TEMPLATE_ERRORS, render_chat
from tandem.serve import fields, protocol
from tandem.serve.protocol import bad_request
from tandem.serve.requests import EngineRequest
from tandem.serve.sampling import SamplingParams


@dataclass
class Ask:
    """What one request asks the engine for, whichever endpoint it came through."""

    route: str
    """"completions", "chat" or "generate": where vLLM's rules differ (logprob_token_ids, the logit_bias clamp)."""
    prompts: list[list[int]]
    sampling: protocol.Sampling
    max_tokens: int | None
    max_tokens_name: str = "max_tokens"
    default_max_tokens: int | None = None
    """Used when the request sends no max_tokens (16 for completions, the context otherwise)."""
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    sampling_mask: bool = False
    """Return each token's kept vocabulary (`/inference/v1/generate` on a `--return-sampling-mask` server)."""
    cache_salt: str | None = None
    reads_prefix_cache: bool = True


@dataclass
class Preparer:
    """The served model's limits and the server's defaults that every generation request is checked against."""

    tokenizer: PreTrainedTokenizerBase
    vocab_size: int
    max_model_len: int
    defaults: dict
    """Sampling defaults from generation_config.json (`--generation-config`)."""
    max_logprobs: int
    max_num_seqs: int
    return_sampling_mask: bool
    seed_rng: random.Random | None
    """Seeds requests that send none (`--seed`)."""
    trust_request_chat_template: bool = False
    default_chat_template_kwargs: dict = field(default_factory=dict)
    content_format: str = "auto"
    """How message content is handed to the template (`--chat-template-content-format`)."""
    reasoning_effort_map: dict = field(default_factory=dict)
    """`--reasoning-effort-map`: a request's reasoning_effort replaced before the template sees it."""

    # ---- each route's request as an Ask ------------------------------------------------------------------------
    def completion_ask(self, req: protocol.CompletionRequest) -> Ask:
        """`/v1/completions`: echo scores the prompt too (its log-probs default to `logprobs`); `max_tokens: 0` returns
        the prompt alone, after generating one token; `logprob_token_ids` replaces the top-k."""
        protocol.refuse(req.model_dump(), fields.COMPLETIONS)
        only_prompt = bool(req.echo) and req.max_tokens == 0
        if req.logprob_token_ids and only_prompt:
            raise bad_request(
                "`logprob_token_ids` is not supported when `echo=True` and `max_tokens=0` because no "
                "output tokens are generated.",
                "logprob_token_ids",
            )
        protocol.check_listed_logprobs(req.logprob_token_ids, req.logprobs, self.vocab_size, "completions")
        prompts = [self.truncated(ids, req, only_prompt) for ids in self.prompt_ids(req.prompt, req.add_special_tokens)]
        prompt_logprobs = req.logprobs if req.echo and req.prompt_logprobs is None else req.prompt_logprobs
        return Ask(
            "completions",
            prompts,
            req,
            1 if only_prompt else req.max_tokens,
            default_max_tokens=16,
            logprobs=None if req.logprob_token_ids else req.logprobs,
            prompt_logprobs=prompt_logprobs,
            cache_salt=req.cache_salt,
        )

    def chat_ask(self, req: protocol.ChatCompletionRequest) -> Ask:
        """`/v1/chat/completions`: the messages rendered (or vLLM's `kv_transfer_params.prompt_token_ids` in their
        place), `top_logprobs` of -1 for the whole vocabulary; echo scores the prompt too (`top_logprobs` of each)."""
        protocol.refuse(req.model_dump(), fields.CHAT)
        if req.top_logprobs and not req.logprobs:
            raise bad_request(
                "when using `top_logprobs`, `logprobs` must be set to true.", "top_logprobs", req.top_logprobs
            )
        protocol.check_listed_logprobs(req.logprob_token_ids, req.logprobs, self.vocab_size, "chat")
        prompt = self.reused_prompt(req) or self.render_chat(req)
        name = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
        logprobs = None if req.logprob_token_ids or not req.logprobs else req.top_logprobs or 0
        prompt_logprobs = (req.top_logprobs or 0) if req.echo and req.prompt_logprobs is None else req.prompt_logprobs
        return Ask(
            "chat",
            [self.truncated(prompt, req)],
            req,
            req.max_completion_tokens or req.max_tokens,
            name,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            cache_salt=req.cache_salt,
        )

    def generate_ask(self, req: protocol.GenerateRequest) -> Ask:
        """`/inference/v1/generate`: vLLM's raw sampling struct over token ids; max_tokens defaults to the context."""
        sp = req.sampling_params
        protocol.refuse(req.model_dump(), fields.GENERATE)
        protocol.refuse(sp.model_dump(), fields.GENERATE_SAMPLING)
        if req.output_mode == "derender":
            raise bad_request(
                "output_mode='derender' is not supported by tandem serve: it parses the reply into a "
                "message with vLLM's renderers; use output_mode 'tokens' or 'text'.",
                "output_mode",
            )
        if not sp.detokenize and req.output_mode == "text":
            raise bad_request("output_mode='text' requires sampling_params.detokenize to be true", "output_mode")
        if not sp.detokenize and sp.stop:
            raise bad_request(
                "stop strings are only supported when detokenize is True. Set detokenize=True to use stop.", "stop"
            )
        logprobs, prompt_logprobs = (int(v) if isinstance(v, bool) else v for v in (sp.logprobs, sp.prompt_logprobs))
        protocol.check_listed_logprobs(sp.logprob_token_ids, logprobs, self.vocab_size, "generate")
        return Ask(
            "generate",
            [req.token_ids],
            sp,
            sp.max_tokens,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            sampling_mask=self.return_sampling_mask,
            cache_salt=req.cache_salt,
            reads_prefix_cache=not sp.skip_reading_prefix_cache,
        )

    def engine_requests(self, ask: Ask, adapter: str | None) -> list[EngineRequest]:
        """One engine request per prompt, or an ApiError naming the first thing the request got wrong."""
        sampling = ask.sampling
        stops = protocol.stop_strings(sampling.stop)
        protocol.check_cache_salt(ask.cache_salt)
        bad_words = self.bad_word_ids(sampling.bad_words)
        if sampling.skip_special_tokens is None:  # vLLM 0.33: the request's, else generation_config's, else true
            sampling.skip_special_tokens = self.defaults.get("skip_special_tokens", True)
        requests = []
        for ids in ask.prompts:
            self.check_prompt(ids)
            values = {**sampling.model_dump(), "seed": self.seed(sampling.seed)}  # each prompt its own server seed
            params = protocol.sampling_params(
                values,
                self.defaults,
                max_tokens=self.max_tokens(ask, len(ids)),
                max_logprobs=self.max_logprobs,
                vocab_size=self.vocab_size,
                logprobs=ask.logprobs,
                prompt_logprobs=ask.prompt_logprobs,
                clamp_bias=ask.route != "generate",
                bad_words=tuple(bad_words),
            )
            self.check_n(sampling.n, params)
            self.check_sampling_mask_request(params)
            requests.append(
                EngineRequest(
                    prompt=list(ids),
                    params=params,
                    n=sampling.n,
                    adapter=adapter,
                    return_sampling_mask=ask.sampling_mask,
                    cache_salt=ask.cache_salt,
                    stop_check=self.stop_check(stops, sampling.skips_special_tokens, params.min_tokens),
                    reads_prefix_cache=ask.reads_prefix_cache,
                )
            )
        return requests

    def truncated(self, ids: list[int], sampling: protocol.SamplingFields, only_prompt: bool = False) -> list[int]:
        """`truncate_prompt_tokens` applied as vLLM does: the last N tokens kept ("left", the default) or the first N
        ("right"); -1 keeps room for one output token (all of the context when only the prompt is scored)."""
        keep = sampling.truncate_prompt_tokens
        if keep is None:
            return ids
        if keep > self.max_model_len:
            raise bad_request(
                f"truncate_prompt_tokens={keep} cannot be greater than max_model_len = "
                f"{self.max_model_len}. Please request a smaller truncation size.",
                "truncate_prompt_tokens",
                keep,
            )
        if keep == -1:
            keep = self.max_model_len - (0 if only_prompt else 1)
        if len(ids) <= keep:
            return ids
        return ids[:keep] if sampling.truncation_side == "right" else ids[len(ids) - keep :]

    def bad_word_ids(self, words: list[str] | None) -> list[list[int]]:
        """Each bad word's token ids as vLLM finds them: the word, and with a leading space where that tokenizes to
        as many tokens starting with another one."""
        if not words:
            return []
        if "" in words:
            raise bad_request(f"bad_words cannot contain an empty string. Got bad_words={words}", "bad_words", words)
        found: list[list[int]] = []
        for word in dict.fromkeys(words):
            plain = self.tokenizer.encode(word.lstrip(), add_special_tokens=False)
            if not plain:
                raise bad_request("bad_words entries must tokenize to at least one token.", "bad_words", word)
            found.append(plain)
            spaced = self.tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
            if spaced and spaced[0] != plain[0] and len(spaced) == len(plain):
                found.append(spaced)
        if len(found) > protocol.MAX_LISTED_TOKENS:
            raise bad_request(
                f"Too many bad words after tokenization: {len(found)}. The max number is {protocol.MAX_LISTED_TOKENS}.",
                "bad_words",
                len(found),
            )
        bad = sorted({t for ids in found for t in ids if not 0 <= t < self.vocab_size})
        if bad:
            raise bad_request(
                f"The model vocabulary size is {self.vocab_size}, but the following tokens were specified "
                f"as bad: {bad}. All token id values should be integers satisfying: 0 <= token_id <= "
                f"{self.vocab_size - 1}.",
                "bad_words",
                bad,
            )
        return found

    def prompt_ids(
        self, prompt: list[int] | list[list[int]] | str | list[str], add_special_tokens: bool = True
    ) -> list[list[int]]:
        """A completions `prompt` (one or a batch, ids or text) as a list of token-id prompts."""
        if isinstance(prompt, str):
            return [self.tokenizer.encode(prompt, add_special_tokens=add_special_tokens)]
        # The request's schema makes the list all texts, all prompts or all ids: its first item says which.
        if prompt and isinstance(prompt[0], str):
            return [self.tokenizer.encode(p, add_special_tokens=add_special_tokens) for p in prompt]
        if prompt and isinstance(prompt[0], list):
            return prompt
        return [cast(list[int], prompt)]

    def render_chat(self, req: protocol.ChatCompletionRequest | protocol.TokenizeRequest) -> list[int]:
        """The request's messages through the chat template, with its tools and template options, as vLLM renders
        them: a template sent in the request only on a `--trust-request-chat-template` server, the server's default
        template options under the request's, the tokenizer's special tokens added when asked."""
        kwargs = {**self.default_chat_template_kwargs, **(req.chat_template_kwargs or {})}
        if (req.chat_template is not None or "chat_template" in kwargs) and not self.trust_request_chat_template:
            raise bad_request(
                "Chat template is passed with request, but --trust-request-chat-template is not set. "
                "Refused request with untrusted chat template.",
                "chat_template",
            )
        if req.continue_final_message and req.add_generation_prompt and "add_generation_prompt" in req.model_fields_set:
            raise bad_request(
                "Cannot set both `continue_final_message` and `add_generation_prompt` to True.",
                "continue_final_message",
            )
        if req.continue_final_message and req.add_generation_prompt:  # transformers' refusal, which vLLM passes on
            raise bad_request(
                "continue_final_message and add_generation_prompt are not compatible. Use "
                "continue_final_message when you want the model to continue the final message, and "
                "add_generation_prompt when you want to add a header that will prompt it to start a new "
                "assistant message instead.",
                "continue_final_message",
            )
        if (documents := getattr(req, "documents", None)) is not None:
            kwargs["documents"] = documents
        if (effort := getattr(req, "reasoning_effort", None)) is not None:
            kwargs["reasoning_effort"] = effort = self.reasoning_effort_map.get(effort, effort)
            kwargs.setdefault("enable_thinking", effort != "none")
        assert req.messages is not None, "a tokenize request with no messages encodes its prompt instead"
        try:
            tools = [as_vllm_renders(tool) for tool in req.tools] if req.tools else req.tools
            return render_chat(
                self.tokenizer,
                req.messages,
                tools=tools,
                add_generation_prompt=req.add_generation_prompt,
                continue_final_message=req.continue_final_message,
                chat_template=req.chat_template,
                chat_template_kwargs=kwargs,
                content_format=self.content_format,
                add_special_tokens=bool(req.add_special_tokens),
            )
        except TEMPLATE_ERRORS as exc:  # the template rejecting these messages is the caller's input error
            raise bad_request(f"The chat template could not render these messages: {exc}", "messages", None) from None

    def reused_prompt(self, req: protocol.ChatCompletionRequest) -> list[int] | None:
        """vLLM's bypass of the template: `kv_transfer_params.prompt_token_ids` are the prompt, unless the request
        echoes."""
        ids = (req.kv_transfer_params or {}).get("prompt_token_ids")
        if ids is None or req.echo:
            return None
        if not (
            isinstance(ids, list)
            and ids
            and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids)
        ):
            raise bad_request(
                "`kv_transfer_params['prompt_token_ids']` must be a non-empty list of non-negative integers.",
                "kv_transfer_params.prompt_token_ids",
            )
        return ids

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
                "length of the input prompt.",
                "prompt",
                len(ids),
            )

    def max_tokens(self, ask: Ask, prompt_len: int) -> int:
        """vLLM 0.32+: min(max_tokens, max_model_len - prompt_len, generation_config max_new_tokens); a request for
        more than the context on the /v1 routes is refused."""
        requested = ask.max_tokens
        if requested is not None and requested < 1:
            raise bad_request(f"max_tokens must be at least 1, got {requested}.", "max_tokens", requested)
        if requested is not None and requested > self.max_model_len and ask.route != "generate":
            raise bad_request(
                f"{ask.max_tokens_name}={requested} cannot be greater than max_model_len="
                f"{self.max_model_len}. Please request fewer output tokens.",
                ask.max_tokens_name,
                requested,
            )
        caps = [
            self.max_model_len - prompt_len,
            requested if requested is not None else ask.default_max_tokens,
            self.defaults.get("max_tokens"),
        ]
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
            raise bad_request(
                "sampling distribution replay requires temperature > 0", "temperature", params.temperature
            )
        if params.top_k <= 0:
            raise bad_request("sampling distribution replay requires top_k > 0", "top_k", params.top_k)

    def stop_check(
        self, stops: list[str], skip_special: bool, min_tokens: int
    ) -> Callable[[list[int]], str | None] | None:
        """The engine's per-step test for stop strings in the decoded output past its first `min_tokens` tokens (None
        when there are none)."""
        if not stops:
            return None

        def check(output: list[int]) -> str | None:
            decoded = cast(str, self.tokenizer.decode(output, skip_special_tokens=skip_special))  # one sequence: a text
            before = (
                len(self.tokenizer.decode(output[:min_tokens], skip_special_tokens=skip_special)) if min_tokens else 0
            )
            found = protocol.find_stop(decoded, stops, before)
            return found[0] if found else None

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
