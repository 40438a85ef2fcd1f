"""`ServeArgs`, the settings of `tandem serve` (its command-line flags, vLLM's names), and what the server reads from
them and from the model's folder as it starts: the device and dtype, the sampling defaults, the chat template, the
fingerprint and the model itself."""

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch

from tandem.chat.tool_formats import FORMATS
from tandem.model import architecture

VLLM_PROTOCOL_VERSION = "0.33.0"
"""The vLLM release whose HTTP protocol `tandem serve` speaks."""
GENERATION_CONFIG_FIELDS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "presence_penalty": "presence_penalty",
    "frequency_penalty": "frequency_penalty",
    "max_new_tokens": "max_tokens",
    "skip_special_tokens": "skip_special_tokens",
}


@dataclass
class ServeArgs:
    """`tandem serve` flags; names and defaults follow `vllm serve` where it has them."""

    model: str
    host: str = "127.0.0.1"
    port: int = 8000
    max_model_len: int | None = None
    dtype: str = "auto"
    seed: int | None = None
    api_key: str | None = None
    served_model_name: list[str] = field(default_factory=list)
    enable_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None
    max_logprobs: int = 20
    logprobs_mode: str = "raw_logprobs"
    enable_scale_out: bool = False
    return_sampling_mask: bool = False
    generation_config: str = "auto"
    max_num_seqs: int = 256
    device: str = "auto"
    decode_mode: str = "auto"
    step_delay_s: float = 0.0
    enable_prefix_caching: bool = True
    prefix_cache_max_tokens: int | None = None
    trust_remote_code: bool = False
    weight_transfer_config: str | None = None
    """JSON, as vLLM's flag: '{"backend": "gloo"}' enables the weight-transfer routes (serve/weight_receiver.py)."""
    weight_transfer_timeout_s: float = 600.0
    recompute_kv_cache_after_weight_updates: bool = False
    """Compute the running sequences' keys and values again after each weight update, so every token comes from one
    version's weights (else the tokens after an update read the cache the older weights computed)."""
    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None
    """Reads chat replies' tool calls into `message.tool_calls`, in one of the formats of tool_formats.py (vLLM's
    names: hermes, llama3_json, mistral, deepseek_v3, granite, pythonic)."""
    exclude_tools_when_tool_choice_none: bool = False
    tokenizer: str | None = None
    chat_template: str | None = None
    """A file or the template itself, in place of the tokenizer's."""
    chat_template_content_format: str = "auto"
    default_chat_template_kwargs: dict = field(default_factory=dict)
    trust_request_chat_template: bool = False
    response_role: str = "assistant"
    reasoning_effort_map: dict = field(default_factory=dict)
    return_tokens_as_token_ids: bool = False
    enable_prompt_tokens_details: bool = False
    enable_force_include_usage: bool = False
    stream_interval: int = 1
    enable_server_load_tracking: bool = False
    enable_tokenizer_info_endpoint: bool = False
    enable_request_id_headers: bool = False
    lora_modules: list[dict] = field(default_factory=list)
    """Adapters loaded at start: {"name", "path"} each (`--lora-modules name=path` or its JSON form)."""
    override_generation_config: dict = field(default_factory=dict)
    fingerprint_mode: str = "full"
    fingerprint_value: str | None = None


def pick_device(name: str) -> torch.device:
    return torch.device(("cuda" if torch.cuda.is_available() else "cpu") if name == "auto" else name)


def pick_dtype(name: str) -> torch.dtype | str:
    if name == "auto":
        return "auto"
    dtypes = {
        "float32": torch.float32,
        "float": torch.float32,
        "float64": torch.float64,
        "bfloat16": torch.bfloat16,
        "float16": torch.float16,
        "half": torch.float16,
    }
    if name not in dtypes:
        raise ValueError(f"--dtype {name!r} is not one of auto, {', '.join(dtypes)}")
    return dtypes[name]


def read_generation_config(folder: str) -> dict:
    """The keys a model folder's generation_config.json sets explicitly ({} when it has none)."""
    config_file = Path(folder) / "generation_config.json"
    return json.loads(config_file.read_text()) if config_file.is_file() else {}


def generation_config_eos(folder: str) -> set[int]:
    """The extra EOS ids a model's generation_config.json lists (vLLM stops on them too)."""
    eos = read_generation_config(folder).get("eos_token_id")
    return set(eos if isinstance(eos, list) else [eos] if eos is not None else [])


def sampling_defaults(args: ServeArgs) -> dict:
    """Server-side sampling defaults: generation_config.json's explicit values ('auto'), or none ('vllm'), with
    `--override-generation-config` over them."""
    config = {}
    if args.generation_config != "vllm":
        config = read_generation_config(args.model if args.generation_config == "auto" else args.generation_config)
    config = {**config, **args.override_generation_config}
    return {ours: config[theirs] for theirs, ours in GENERATION_CONFIG_FIELDS.items() if theirs in config}


def read_chat_template(template: str) -> str:
    """`--chat-template`: a file's text, or the template itself."""
    path = Path(template)
    return path.read_text() if path.is_file() else template


def fingerprint(args: ServeArgs) -> str | None:
    """`system_fingerprint` by `--fingerprint-mode`: tandem's (full, hash), the given value (custom) or none."""
    if args.fingerprint_mode == "none":
        return None
    if args.fingerprint_mode == "custom":
        return args.fingerprint_value
    return f"vllm-{VLLM_PROTOCOL_VERSION}-tandem"


def check_tool_flags(args: ServeArgs) -> None:
    """`--enable-auto-tool-choice` and `--tool-call-parser` as vLLM takes them."""
    if args.enable_auto_tool_choice and args.tool_call_parser is None:
        raise ValueError("--enable-auto-tool-choice requires --tool-call-parser")
    if args.tool_call_parser is not None and args.tool_call_parser not in FORMATS:
        raise ValueError(
            f"--tool-call-parser {args.tool_call_parser!r} is not one tandem serve has: "
            f"{', '.join(FORMATS)} (vLLM's names for them)"
        )


def load_model(args: ServeArgs) -> tuple[torch.nn.Module, bool]:
    """The model on its device, and whether it decodes exactly (--decode-mode; exact is the CPU default)."""
    device = pick_device(args.device)
    if args.decode_mode not in ("auto", "exact", "fast"):
        raise ValueError(f"--decode-mode {args.decode_mode!r} is not one of auto, exact, fast")
    exact = args.decode_mode == "exact" or (args.decode_mode == "auto" and device.type == "cpu")
    model: torch.nn.Module = architecture.from_pretrained(
        args.model,
        dtype=pick_dtype(args.dtype),
        trust_remote_code=args.trust_remote_code,
        attn_implementation="eager" if exact else None,
    )
    return model.to(device).eval(), exact
