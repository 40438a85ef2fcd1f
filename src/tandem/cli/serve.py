"""`tandem serve MODEL`: its flags (vLLM's spellings), their checks, and vLLM's flags it takes, tunes past or refuses."""

import argparse
from pathlib import Path

from tandem.chat.prompts import CONTENT_FORMATS
from tandem.chat.tool_formats import FORMATS
from tandem.cli.user_input import json_object, listen_options, lora_module, switch, user_error
from tandem.errors import UsageError
from tandem.tasks import TINY_MODEL_PATH


def serve_parser(sub) -> None:
    p = sub.add_parser(
        "serve",
        help="generation server speaking vLLM's HTTP protocol (CPU or GPU)",
        description="Serve MODEL over vLLM 0.33's HTTP protocol. MODEL is a local path or 'tiny' for the "
        "built-in model. vLLM's flags that tandem serve does not implement are refused with "
        "the reason; those that only tune vLLM's engine get one line saying so.",
    )
    p.add_argument("model", help="model directory (safetensors) or 'tiny'")
    listen_options(p)
    p.add_argument(
        "--max-model-len", type=int, default=None, help="context length (default: the model's max_position_embeddings)"
    )
    p.add_argument(
        "--dtype", default="auto", help="auto | float32 | bfloat16 | float16 (default auto: the checkpoint's)"
    )
    p.add_argument("--seed", type=int, default=None, help="seed for requests that send none")
    p.add_argument(
        "--api-key",
        default=None,
        help="require 'Authorization: Bearer KEY' on /v1, /v2, /inference, /cohere, as vLLM does",
    )
    p.add_argument(
        "--served-model-name",
        nargs="+",
        default=[],
        help="names the model answers to (default: MODEL as typed; tiny: tiny and its folder)",
    )
    p.add_argument("--tokenizer", default=None, help="tokenizer folder (default: MODEL's)")
    _serve_adapter_and_logprob_options(p)
    _serve_engine_options(p)
    _serve_cache_and_transfer_options(p)
    _serve_chat_and_response_options(p)
    _serve_usage_and_route_options(p)


def _serve_adapter_and_logprob_options(p) -> None:
    """LoRA adapters served by name, and the log-probs and sampling masks a response carries."""
    switch(p, "enable-lora", "allow /v1/load_lora_adapter and adapter names in `model`")
    p.add_argument(
        "--lora-modules",
        nargs="+",
        type=lora_module,
        default=[],
        metavar="NAME=PATH",
        help='adapters loaded at start, each name=path or \'{"name": ..., "path": ...}\' (needs --enable-lora)',
    )
    p.add_argument("--max-loras", type=int, default=1, help="distinct adapters in one batch (default 1)")
    p.add_argument("--max-lora-rank", type=int, default=16, help="largest adapter rank accepted (default 16)")
    p.add_argument("--max-cpu-loras", type=int, default=None, help="adapters kept loaded (default: --max-loras)")
    p.add_argument(
        "--max-logprobs", type=int, default=20, help="cap on logprobs / prompt_logprobs; -1 = vocabulary (default 20)"
    )
    p.add_argument(
        "--logprobs-mode",
        default="raw_logprobs",
        choices=["raw_logprobs", "processed_logprobs", "raw_logits", "processed_logits"],
        help="what logprob fields hold; RL needs processed_logprobs (default raw_logprobs, as vLLM)",
    )
    switch(p, "return-tokens-as-token-ids", "log-prob tokens as 'token_id:N' unless a request says otherwise")
    switch(p, "enable-scale-out", "enable /inference/v1/generate")
    switch(p, "return-sampling-mask", "return each token's kept vocabulary ids (needs top_k > 0)")


def _serve_engine_options(p) -> None:
    """Generation defaults, the engine's batch and decoding, the prefix cache and the weight transfer."""
    p.add_argument(
        "--generation-config", default="auto", help="auto (model's generation_config.json) | vllm (neutral) | a folder"
    )
    p.add_argument(
        "--override-generation-config",
        type=json_object,
        default={},
        metavar="JSON",
        help="sampling defaults over generation_config.json's, e.g. '{\"temperature\": 0.7}'",
    )
    p.add_argument("--max-num-seqs", type=int, default=256, help="sequences decoded together at most (default 256)")
    p.add_argument("--device", default="auto", help="auto | cpu | cuda[:N] (default auto)")
    p.add_argument(
        "--decode-mode",
        default="auto",
        choices=["auto", "exact", "fast"],
        help="exact: log-probs bitwise equal to the trainer's forward (tandem_exact attention, matmuls padded to "
        "the rows that round alike); fast: one token per step, on a CPU grouped attention (tandem_decode) and "
        "large linear layers on oneDNN (default auto: exact on CPU, fast on GPU)",
    )
    p.add_argument(
        "--step-delay-s", type=float, default=0.0, help="benchmarks: sleep this long after every decode step"
    )


def _serve_cache_and_transfer_options(p) -> None:
    """The prefix cache, and how new weights reach the server (a weight-transfer group or a folder)."""
    p.add_argument(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="reuse the KV of earlier requests' whole 16-token blocks, so a repeated prefix (the next turn of "
        "a conversation) is not prefilled again; dropped on every weight or adapter change (default on, as vLLM)",
    )
    p.add_argument(
        "--disable-prefix-caching", dest="enable_prefix_caching", action="store_false", help=argparse.SUPPRESS
    )
    p.add_argument(
        "--prefix-cache-max-tokens",
        type=int,
        default=None,
        help="tokens the prefix cache keeps at most, least recently used evicted (default: --max-num-seqs x --max-model-len)",
    )
    p.add_argument(
        "--weight-transfer-config",
        default=None,
        help='\'{"backend": "gloo"}\' enables /init_weight_transfer_engine, /update_weights, ...: the trainer '
        "streams weights over a torch.distributed gloo group instead of writing them to disk (as vLLM's "
        "flag; nccl is vllm serve's)",
    )
    p.add_argument(
        "--weight-transfer-timeout-s",
        type=float,
        default=600.0,
        help="seconds a weight-transfer collective may wait for the trainer before it fails (default 600)",
    )
    p.add_argument(
        "--recompute-kv-cache-after-weight-updates",
        action="store_true",
        help="after each weight update, compute the running sequences' keys and values again under the new weights, "
        "so every token comes from one version's weights (default: keep the cache, as vLLM's pause keeps it)",
    )


def _serve_chat_and_response_options(p) -> None:
    """Chat rendering, tool calls, usage and streaming, and the server's optional routes and headers."""
    p.add_argument(
        "--chat-template",
        default=None,
        help="a chat template (a file, or the template itself) in place of the tokenizer's",
    )
    p.add_argument(
        "--chat-template-content-format",
        default="auto",
        choices=list(CONTENT_FORMATS),
        help="message content as one string (list parts joined by newlines) or as a list of parts "
        "(default auto: as the template reads it)",
    )
    p.add_argument(
        "--default-chat-template-kwargs",
        type=json_object,
        default={},
        metavar="JSON",
        help="chat-template options for every request, under each request's chat_template_kwargs",
    )
    switch(
        p, "trust-request-chat-template", "accept a chat_template sent in a request (refused otherwise, as vLLM does)"
    )
    p.add_argument(
        "--response-role", default="assistant", help="the reply's role after a generation prompt (default assistant)"
    )
    p.add_argument(
        "--reasoning-effort-map",
        type=json_object,
        default={},
        metavar="JSON",
        help='requests\' reasoning_effort values replaced before the chat template, e.g. \'{"max": "high"}\'',
    )
    switch(
        p,
        "enable-auto-tool-choice",
        'chat requests with tools (tool_choice "auto") get the reply\'s calls in message.tool_calls',
    )
    p.add_argument(
        "--tool-call-parser",
        default=None,
        choices=list(FORMATS),
        help="the format replies write tool calls in, by vLLM's names: hermes (Qwen, Hermes), llama3_json, "
        "mistral, deepseek_v3, granite, pythonic",
    )
    switch(p, "exclude-tools-when-tool-choice-none", 'leave tools out of the prompt when tool_choice is "none"')


def _serve_usage_and_route_options(p) -> None:
    """Usage in responses, streaming, the server's optional routes and headers, and remote code."""
    switch(p, "enable-prompt-tokens-details", "usage.prompt_tokens_details: the prompt tokens the prefix cache held")
    switch(p, "enable-force-include-usage", "every stream carries usage, in each chunk and at its end")
    p.add_argument("--stream-interval", type=int, default=1, help="tokens per streamed chunk at least (default 1)")
    switch(p, "enable-server-load-tracking", "GET /load counts the generation requests being served")
    switch(p, "enable-tokenizer-info-endpoint", "GET /tokenizer_info: the tokenizer's configuration")
    switch(p, "enable-request-id-headers", "every answer carries an X-Request-Id header")
    p.add_argument(
        "--fingerprint-mode",
        default="full",
        choices=["full", "hash", "custom", "none"],
        help="system_fingerprint: tandem's own for full and hash (it has no parallel sizes to add), "
        "--fingerprint-value (custom) or null (none)",
    )
    p.add_argument("--fingerprint-value", default=None, help="system_fingerprint with --fingerprint-mode custom")
    switch(p, "trust-remote-code", "load a model and tokenizer that ship their own code")


def missing_folder(model: str) -> str | None:
    """What is wrong with a model named by a path to a folder that is not there (None for a Hub id or a folder)."""
    if model.startswith(("/", ".", "~")) and not Path(model).expanduser().is_dir():
        return (
            f"{model}: no such model folder. Give a folder with config.json and safetensors weights, a Hub id "
            "(org/name, from this machine's cache when offline), or 'tiny'."
        )
    return None


def run_serve(ns: argparse.Namespace) -> None:
    from tandem.serve.transfer_config import parse_config

    if ns.return_sampling_mask and ns.logprobs_mode != "processed_logprobs":
        user_error("tandem serve: --return-sampling-mask needs --logprobs-mode processed_logprobs (as in vLLM).")
    if ns.lora_modules and not ns.enable_lora:
        user_error("tandem serve: --lora-modules needs --enable-lora (LoRA is not enabled).")
    if ns.stream_interval < 1:
        user_error(f"tandem serve: --stream-interval must be at least 1, got {ns.stream_interval}.")
    if (ns.fingerprint_mode == "custom") != (ns.fingerprint_value is not None):
        user_error(
            "tandem serve: --fingerprint-value goes with --fingerprint-mode custom, and that mode needs a value."
        )
    try:
        parse_config(ns.weight_transfer_config)
    except ValueError as exc:  # not JSON, or a backend tandem serve does not have
        user_error(f"tandem serve: {exc}")
    from tandem.httpapp import run_until_interrupted  # torch and the engine: after the checks that need neither
    from tandem.serve.app import start_server
    from tandem.serve.serve_args import VLLM_PROTOCOL_VERSION, ServeArgs, check_tool_flags

    args = ServeArgs(**{k: v for k, v in vars(ns).items() if k != "command"})
    try:
        check_tool_flags(args)
    except ValueError as exc:
        user_error(f"tandem serve: {exc}")
    if args.model == "tiny":  # answers to the name as typed (vLLM's default) and to its folder (the trainer's name)
        args.served_model_name = args.served_model_name or ["tiny", TINY_MODEL_PATH]
        args.model = TINY_MODEL_PATH
    if problem := missing_folder(args.model):
        user_error(f"tandem serve: {problem}")
    try:
        run_until_interrupted(
            start_server(args),
            lambda port: (
                f"tandem serve: {args.model} on http://{args.host}:{port} (vLLM {VLLM_PROTOCOL_VERSION} protocol)"
            ),
        )
    except (OSError, UsageError, NotImplementedError) as exc:  # a Hub id not there, a port in use, a model it cannot
        user_error(f"tandem serve: {' '.join(str(exc).split())}")  # serve, a --lora-modules adapter refused


def vllm_flags_taken(ns: argparse.Namespace, rest: list[str], parser: argparse.ArgumentParser) -> argparse.Namespace:
    """`tandem serve`'s arguments past its own options: vLLM's flags whose promise it keeps are taken, one it does
    not implement ends the command with its reason in one line, anything else is argparse's unrecognized argument."""
    from tandem.serve.vllm_flags import takes_value, verdict

    unknown, i = [], 0
    while i < len(rest):
        token = rest[i]
        name, eq, value = token[2:].partition("=") if token.startswith("--") else ("", "", "")
        following = rest[i + 1] if i + 1 < len(rest) and not rest[i + 1].startswith("-") else None
        action, why = verdict(name, value if eq else following) if name else ("unknown", "")
        if action == "refuse":
            user_error(f"tandem serve: {why}")
        if action == "take":
            i += 2 if not eq and following is not None and takes_value(name) else 1
            continue
        unknown.append(token)
        i += 1
    if unknown:
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    return ns
