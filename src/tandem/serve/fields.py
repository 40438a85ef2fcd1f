"""Every request field of vLLM 0.33's protocol, and what `tandem serve` does with it.

The rule: a field acts as in vLLM, or is ignored exactly where vLLM ignores it too (a field for a part of vLLM that
is not configured), or, where tandem serve does not implement what it asks for, a value that would change the
answer is a 400 naming the field and why. A field sent at its default is always accepted: the OpenAI SDK, lm-eval
and TRL send `logit_bias: null`, `use_beam_search: false`. Never accepted and silently ignored.

The tables are the serve reference's source (docs/references/serve.md) and the refusals' (`protocol.refuse`).
"""

from dataclasses import dataclass
from typing import Any

ACTS, AS_VLLM, REFUSED = "acts", "ignored, as by vLLM", "refused"


@dataclass(frozen=True)
class Rule:
    status: str
    note: str = ""
    """Why (AS_VLLM, REFUSED) or what it does when the name does not say (ACTS)."""
    accepted: tuple = (None,)
    """REFUSED: the values that ask for nothing tandem lacks (its defaults), accepted."""


def acts(note: str = "") -> Rule:
    return Rule(ACTS, note)


def ignored(reason: str) -> Rule:
    return Rule(AS_VLLM, reason)


def refused(reason: str, *accepted: Any) -> Rule:
    return Rule(REFUSED, reason, (None, *accepted))


NO_GUIDED = "structured outputs (guided decoding) are not implemented by tandem serve; use vllm serve"
NO_MEDIA = "tandem serve renders text only (no multimodal processor)"
NO_REASONING = (
    "needs a reasoning parser (--reasoning-parser), which tandem serve does not have; vLLM refuses it "
    "without one as well"
)
FOR_RENDER = "read by the /render endpoints only; vLLM ignores it here"
NO_CONNECTOR = "passed to a KV or encoder-cache connector, which neither tandem serve nor a plain vllm serve has"

SAMPLING = {
    "n": acts(),
    "temperature": acts("0 is greedy; (0, 0.01) is raised to 0.01"),
    "top_p": acts(),
    "top_k": acts(),
    "min_p": acts(),
    "repetition_penalty": acts(),
    "presence_penalty": acts(),
    "frequency_penalty": acts(),
    "seed": acts("-1 is unseeded; child i of n uses seed + i"),
    "stop": acts(),
    "stop_token_ids": acts(),
    "include_stop_str_in_output": acts(),
    "ignore_eos": acts(),
    "min_tokens": acts(),
    "max_tokens": acts(),
    "skip_special_tokens": acts("unset: generation_config.json's value, then true"),
    "spaces_between_special_tokens": refused(
        "tandem serve decodes with the tokenizer's own decode, which has no such switch for fast tokenizers", True
    ),
    "allowed_token_ids": acts("every other token's logit is -inf"),
    "bad_words": acts("a word's last token is banned once the rest of it was generated"),
    "logprob_token_ids": acts("these tokens' log-probs at every position, with the sampled one's"),
    "repetition_detection": acts('finish_reason "repetition" once a pattern repeats min_count times'),
    "thinking_token_budget": refused(NO_REASONING, -1),
    "routed_experts_prompt_start": ignored(
        "applies to routed_experts, returned only with --enable-return-routed-experts, which tandem serve does not have"
    ),
    "stream_interval": acts("tokens per streamed chunk at least (the first and last chunks are sent at once)"),
    "structured_outputs": refused(NO_GUIDED),
}
"""The sampling fields completions and chat share with `/inference/v1/generate`'s `sampling_params`."""

OPENAI = SAMPLING | {
    "model": acts("a served name or a LoRA adapter's"),
    "request_id": acts(),
    "stream": acts(),
    "stream_options": acts("include_usage, continuous_usage_stats"),
    "return_token_ids": acts(),
    "return_tokens_as_token_ids": acts("unset: --return-tokens-as-token-ids"),
    "return_weight_versions": acts(),
    "logit_bias": acts(
        "added to the logits before the penalties, clamped to [-100, 100]; an infinite value is a 400 "
        "(it would leave nothing to sample)"
    ),
    "truncate_prompt_tokens": acts("-1: max_model_len - 1"),
    "truncation_side": acts('"left" (the default) keeps the end'),
    "prompt_logprobs": acts(),
    "add_special_tokens": acts(),
    "cache_salt": acts("requests with different salts share no prefix-cache block"),
    "use_beam_search": refused(
        "beam search is not implemented by tandem serve: sample n sequences, or use vllm serve", False
    ),
    "length_penalty": ignored("scores beams only; without beam search vLLM ignores it too"),
    "user": ignored("vLLM ignores it"),
    "watermarking": ignored(
        "applied only when the engine has a watermark configured, which tandem serve does not; "
        "vLLM then logs a warning and generates as usual"
    ),
    "priority": ignored(
        "orders the queue only under --scheduling-policy priority; under vLLM's default first-come, "
        "first-served policy it changes nothing, as in tandem serve"
    ),
    "session_id": ignored("vLLM only copies it into KV-cache events"),
    "response_format": refused(NO_GUIDED, {"type": "text"}),
    "kv_transfer_params": ignored(NO_CONNECTOR),
    "ec_transfer_params": ignored(NO_CONNECTOR),
    "vllm_xargs": ignored("extra arguments for logits-processor plugins; no built-in sampler reads them"),
    "return_token_offsets": ignored(FOR_RENDER),
    "mm_payload": ignored(FOR_RENDER),
    "return_mm_kwargs": ignored(FOR_RENDER),
}
"""What completions and chat share."""

COMPLETIONS = OPENAI | {
    "prompt": acts("token ids, text, or a batch of either"),
    "echo": acts(),
    "logprobs": acts(),
    "suffix": refused("fill-in-the-middle needs a model with FIM rendering, which tandem serve does not implement"),
    "prompt_embeds": refused("tandem serve takes token ids or text (vLLM needs --enable-prompt-embeds for it)"),
}

CHAT = OPENAI | {
    "messages": acts("text content, or a list of text parts"),
    "max_completion_tokens": acts(),
    "logprobs": acts(),
    "top_logprobs": acts("-1: the whole vocabulary (needs --max-logprobs -1)"),
    "tools": acts(),
    "tool_choice": acts('"auto" and "none"; "required" and named functions are refused: they need guided decoding'),
    "parallel_tool_calls": acts(),
    "add_generation_prompt": acts(),
    "continue_final_message": acts(),
    "echo": acts("the last message's content starts the reply when its role is the reply's"),
    "documents": acts("passed to the chat template"),
    "chat_template": acts("needs --trust-request-chat-template"),
    "chat_template_kwargs": acts("over --default-chat-template-kwargs"),
    "reasoning_effort": acts("passed to the chat template, with enable_thinking unless set"),
    "include_reasoning": ignored("hides what a reasoning parser separates; without one there is nothing to hide"),
    "return_prompt_text": acts(),
    "kv_transfer_params": acts("its prompt_token_ids replace the rendered messages (not with echo), as in vLLM"),
    "media_io_kwargs": refused(NO_MEDIA, {}),
    "mm_processor_kwargs": refused(NO_MEDIA, {}),
}

GENERATE = {
    "request_id": acts(),
    "token_ids": acts(),
    "sampling_params": acts("the fields below"),
    "model": acts(),
    "return_token_ids": acts(),
    "output_mode": acts('"tokens" and "text"; "derender" is refused'),
    "stream": refused("tandem serve answers this route whole; /v1/completions streams the same tokens", False),
    "stream_options": ignored("read by streams only"),
    "cache_salt": acts(),
    "token_offsets": ignored("an echo of /render's offsets; vLLM does not read it to generate"),
    "features": refused(NO_MEDIA),
    "content_parts": refused(NO_MEDIA),
    "reasoning_ended": ignored("starts structured outputs at once; without them it changes nothing"),
    "reasoning_parser_kwargs": ignored("for output_mode derender's parser"),
    "parse_context": ignored("read by output_mode derender only"),
    "priority": OPENAI["priority"],
    "kv_transfer_params": ignored(NO_CONNECTOR),
    "ec_transfer_params": ignored(NO_CONNECTOR),
}

GENERATE_SAMPLING = SAMPLING | {
    "logprobs": acts("true is 1"),
    "prompt_logprobs": acts("true is 1"),
    "logit_bias": acts(
        "added to the logits before the penalties (not clamped on this route, as in vLLM; an infinite value is a 400)"
    ),
    "watermarking": OPENAI["watermarking"],
    "prompt_logprob_token_ids": refused(
        "scoring listed prompt tokens needs vLLM's V2 model runner; tandem serve returns prompt_logprobs"
    ),
    "prompt_logprob_start": refused("goes with prompt_logprob_token_ids"),
    "stream_interval": ignored("this route answers whole (its stream is refused), so there are no chunks to space"),
    "flat_logprobs": ignored("the engine's internal container; the JSON is the same"),
    "detokenize": acts("false: no text (output_mode text needs it)"),
    "output_kind": ignored("set by the route (whole or streamed), as in vLLM"),
    "skip_clone": ignored("an internal copy switch"),
    "output_text_buffer_length": ignored("recomputed from stop"),
    "extra_args": ignored("for logits-processor plugins; no built-in sampler reads them"),
    "skip_reading_prefix_cache": acts(),
    "trace_decode_token_ids": refused("needs --enable-trace-replay, which tandem serve does not have"),
}

TOKENIZE = {
    "model": acts(),
    "prompt": acts(),
    "messages": acts(),
    "add_special_tokens": acts(),
    "add_generation_prompt": acts(),
    "continue_final_message": acts(),
    "return_token_strs": acts(),
    "chat_template": acts("needs --trust-request-chat-template"),
    "chat_template_kwargs": acts(),
    "tools": acts(),
    "media_io_kwargs": refused(NO_MEDIA, {}),
    "mm_processor_kwargs": refused(NO_MEDIA, {}),
}

ROUTES = {
    "/v1/completions": COMPLETIONS,
    "/v1/chat/completions": CHAT,
    "/inference/v1/generate": GENERATE,
    "/inference/v1/generate sampling_params": GENERATE_SAMPLING,
    "/tokenize": TOKENIZE,
    "/detokenize": {"model": acts(), "tokens": acts()},
    "/v1/load_lora_adapter": {
        "lora_name": acts(),
        "lora_path": acts(),
        "load_inplace": acts(),
        "is_3d_lora_weight": refused("tandem serve loads PEFT's 2D LoRA layout", False),
    },
    "/v1/unload_lora_adapter": {"lora_name": acts(), "lora_int_id": ignored("vLLM's handler does not read it")},
}
"""Every route's fields, as vLLM 0.33 declares them."""
