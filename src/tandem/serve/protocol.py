"""vLLM 0.33 request bodies and error shapes, as `tandem serve` accepts and answers them.

Request models ignore unknown fields (vLLM's `extra="allow"`). Whatever the client got wrong is
raised as an `ApiError` (a 400 unless said otherwise), which the server answers as
`{"error": {"message", "type", "param", "code"}}` with the HTTP status equal to `code`,
as vLLM answers. Any other exception is a bug of the server's, answered 500.
"""

import json
import math
import re
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from tandem.httpapp import error_body
from tandem.serve.fields import REFUSED, Rule
from tandem.serve.sampling import SamplingParams

INT64_MAX = 2**63 - 1
MAX_STOP_STRINGS = 4
MAX_LISTED_TOKENS = 128
"""vLLM's caps on logprob_token_ids and on bad_words after tokenization."""
MAX_CACHE_SALT = 128
MIN_TEMPERATURE = 0.01
"""vLLM raises a temperature in (0, 0.01) to this: below it the scaled logits overflow."""
TokenId = Annotated[int, Field(ge=0)]
Int64 = Annotated[int, Field(ge=-(2**63), le=INT64_MAX)]


class ApiError(Exception):
    """An answer in vLLM's error shape: the client's mistake (4xx), or a refusal vLLM itself answers 5xx."""

    def __init__(self, status: int, message: str, type: str = "BadRequestError", param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param = status, sanitize(message), type, param

    def body(self) -> dict:
        return error_body(self.status, self.message, self.type, self.param)


def bad_request(message: str, param: str | None = None, value: Any = None) -> ApiError:
    """A 400 like vLLM's VLLMValidationError: the message names the parameter and its value (each when set)."""
    extras = [f"{name}={v}" for name, v in (("parameter", param), ("value", value)) if v is not None]
    if extras:
        message = f"{message} ({', '.join(extras)})"
    return ApiError(400, message, "BadRequestError", param)


def validation_error(exc: ValidationError) -> ApiError:
    errors = exc.errors()
    lines = [f"  {'.'.join(str(part) for part in e['loc'])}: {e['msg']}" for e in errors]
    plural = "s" if len(errors) > 1 else ""
    return ApiError(400, f"{len(errors)} validation error{plural}:\n" + "\n".join(lines), "Bad Request")


_PATH = re.compile(r"(?:/(?:home|usr|opt|var|tmp|root|lib|mnt|srv)(?:/[^\s'\"]*)?|(?:/[^\s/'\"]+){2,}\.\w+)")


def sanitize(message: str) -> str:
    """vLLM hides file paths in error messages: they become `<path>`."""
    return _PATH.sub("<path>", message)


class Request(BaseModel):
    model_config = ConfigDict(extra="allow")


class RepetitionDetection(Request):
    max_pattern_size: int = 0
    min_pattern_size: int = 0
    min_count: int = 0


class Sampling(Request):
    """vLLM's sampling fields; None means "the server default". `/inference/v1/generate` takes them raw."""

    n: Int64 = 1
    """null is 1, as in vLLM's chat."""
    temperature: float | None = None
    top_p: float | None = None
    top_k: Int64 | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    seed: Int64 | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[TokenId] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    min_tokens: Int64 = 0
    skip_special_tokens: bool | None = None
    logit_bias: dict[str, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    logprob_token_ids: list[int] | None = None
    repetition_detection: RepetitionDetection | None = None
    stream_interval: Annotated[int, Field(ge=1)] | None = None

    @field_validator("n", mode="before")
    @classmethod
    def _null_is_one(cls, n: Any) -> Any:
        return 1 if n is None else n

    @property
    def skips_special_tokens(self) -> bool:
        """`skip_special_tokens` with vLLM's default, true (the server's default is set into the field first)."""
        return self.skip_special_tokens is not False


class SamplingFields(Sampling):
    """The sampling fields of completions and chat, with the OpenAI-style output switches."""

    truncate_prompt_tokens: Annotated[int, Field(ge=-1, le=INT64_MAX)] | None = None
    truncation_side: Literal["left", "right"] | None = None
    cache_salt: Any = None
    return_token_ids: bool | None = None
    return_tokens_as_token_ids: bool | None = None
    return_weight_versions: bool = False
    stream: bool | None = False
    stream_options: dict | None = None
    request_id: str | None = None


class CompletionRequest(SamplingFields):
    model: str | None = None
    prompt: list[TokenId] | list[list[TokenId]] | str | list[str]
    max_tokens: Int64 | None = 16
    logprobs: Int64 | None = None
    prompt_logprobs: Int64 | None = None
    echo: bool | None = False
    add_special_tokens: bool = True


class ChatCompletionRequest(SamplingFields):
    model: str | None = None
    messages: list[dict[str, Any]]
    max_completion_tokens: Int64 | None = None
    max_tokens: Int64 | None = None
    logprobs: bool | None = False
    top_logprobs: Int64 | None = 0
    prompt_logprobs: Int64 | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    """None: "auto" when `tools` are given, else "none" (vLLM's default)."""
    parallel_tool_calls: bool | None = True
    echo: bool = False
    add_special_tokens: bool = False
    documents: list[dict[str, str]] | None = None
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"] | None = None
    return_prompt_text: bool | None = None
    kv_transfer_params: dict[str, Any] | None = None


class GenerateSampling(Sampling):
    """`/inference/v1/generate`'s `sampling_params`: vLLM's raw struct, whose max_tokens defaults to the context."""

    max_tokens: Int64 | None = None
    logprobs: Int64 | bool | None = None
    prompt_logprobs: Int64 | bool | None = None
    detokenize: bool = True
    skip_reading_prefix_cache: bool | None = None


class GenerateRequest(Request):
    """`/inference/v1/generate`: token ids in, token ids out."""

    request_id: str | None = None
    token_ids: list[TokenId]
    sampling_params: GenerateSampling = Field(default_factory=GenerateSampling)
    model: str | None = None
    return_token_ids: bool | None = None
    output_mode: Literal["tokens", "text", "derender"] = "tokens"
    stream: bool | None = False
    stream_options: dict | None = None
    cache_salt: Any = None


class TokenizeRequest(Request):
    model: str | None = None
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    return_token_strs: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None


class DetokenizeRequest(Request):
    model: str | None = None
    tokens: list[TokenId]


class LoadLoRARequest(Request):
    lora_name: str = ""
    lora_path: str = ""
    load_inplace: bool = False
    is_3d_lora_weight: bool = False


class UnloadLoRARequest(Request):
    lora_name: str = ""
    lora_int_id: int | None = None


class CollectiveRpcRequest(Request):
    method: str | None = None
    args: list = Field(default_factory=list)
    kwargs: dict = Field(default_factory=dict)
    timeout: float | None = None


class WeightTransferRequest(Request):
    """The body of vLLM's weight-transfer routes; `discard` is tandem proxy's."""

    init_info: dict | None = None
    update_info: dict | list | None = None
    weight_version: str | None = None
    discard: bool = False


def parse(model: type[BaseModel], body: Any) -> Any:
    if not isinstance(body, dict):
        raise ApiError(
            400,
            f"1 validation error:\n  body: Input should be a valid dictionary, got {type(body).__name__}",
            "Bad Request",
        )
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        raise validation_error(exc) from None


async def read(request, model: type[BaseModel], *, json_only: bool = True) -> Any:
    """An aiohttp request's JSON body as `model`. `json_only` refuses other media types, as vLLM's
    `validate_json_request` does; without it an empty body reads as `{}`."""
    if json_only and request.content_type != "application/json":
        raise ApiError(400, "Unsupported Media Type: Only 'application/json' is allowed", "Bad Request")
    raw = await request.read()
    if not raw and not json_only:
        raw = b"{}"
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ApiError(
            400, f"1 validation error:\n  body: JSON decode error: {getattr(exc, 'msg', exc)}", "Bad Request"
        ) from None
    return parse(model, body)


def sampling_params(
    fields: dict[str, Any],
    defaults: dict[str, Any],
    *,
    max_tokens: int,
    max_logprobs: int,
    vocab_size: int,
    logprobs: int | None,
    prompt_logprobs: int | None,
    clamp_bias: bool = True,
    bad_words: tuple[list[int], ...] = (),
) -> SamplingParams:
    """Resolve request fields over the server's defaults and check them as vLLM's SamplingParams does. `clamp_bias`:
    logit_bias values clamped to [-100, 100] (the /v1 routes; /inference/v1/generate takes them as sent)."""

    def pick(name: str, neutral: Any) -> Any:
        value = fields.get(name)
        return value if value is not None else defaults.get(name, neutral)

    listed = fields.get("logprob_token_ids") or None
    params = SamplingParams(
        temperature=float(pick("temperature", 1.0)),
        top_p=float(pick("top_p", 1.0)),
        top_k=int(pick("top_k", 0)),
        min_p=float(pick("min_p", 0.0)),
        repetition_penalty=float(pick("repetition_penalty", 1.0)),
        presence_penalty=float(pick("presence_penalty", 0.0)),
        frequency_penalty=float(pick("frequency_penalty", 0.0)),
        max_tokens=max_tokens,
        min_tokens=int(fields.get("min_tokens") or 0),
        stop_token_ids=list(fields.get("stop_token_ids") or []),
        ignore_eos=bool(fields.get("ignore_eos")),
        logprobs=logprobs,
        prompt_logprobs=prompt_logprobs,
        seed=None if fields.get("seed") == -1 else fields.get("seed"),
        logit_bias=logit_bias(fields.get("logit_bias"), vocab_size, clamp_bias),
        allowed_token_ids=allowed_token_ids(fields.get("allowed_token_ids"), vocab_size),
        bad_words=list(bad_words),
        logprob_token_ids=listed,
        repetition_detection=repetition_detection(fields.get("repetition_detection")),
    )
    check_ranges(params)
    if params.greedy:
        params.top_p, params.top_k, params.min_p = 1.0, 0, 0.0
    elif params.temperature < MIN_TEMPERATURE:
        params.temperature = MIN_TEMPERATURE
    check_logprobs(params, max_logprobs, vocab_size)
    return params


def out_of_vocabulary(name: str, ids: list[int], vocab_size: int) -> None:
    """vLLM's engine check of listed token ids."""
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise bad_request(
            f"token_id(s) {bad} in {name} contain out-of-vocab token ids. Vocabulary size: {vocab_size}", name, bad
        )


def logit_bias(bias: dict[str, float] | None, vocab_size: int, clamp: bool) -> dict[int, float]:
    """`logit_bias` with integer ids, checked as vLLM does (and, unlike vLLM, every value finite: an infinite bias
    leaves nothing to sample)."""
    if not bias:
        return {}
    not_ints = [key for key in bias if not is_int(key)]
    if not_ints:
        raise bad_request(
            f"logit_bias contains key(s) that cannot be converted to integer token IDs: {not_ints}",
            "logit_bias",
            not_ints,
        )
    ids = {int(key): value for key, value in bias.items()}
    out_of_vocabulary("logit_bias", list(ids), vocab_size)
    infinite = [key for key, value in ids.items() if not math.isfinite(value)]
    if infinite:
        raise bad_request(
            f"logit_bias values must be finite numbers; token ids {infinite} have none.", "logit_bias", infinite
        )
    return {key: min(100.0, max(-100.0, value)) for key, value in ids.items()} if clamp else ids


def is_int(text: str) -> bool:
    """Whether Python's int() reads `text`, as vLLM reads logit_bias keys."""
    try:
        int(text)
        return True
    except ValueError:
        return False


def allowed_token_ids(ids: list[int] | None, vocab_size: int) -> list[int] | None:
    if ids is None:
        return None
    if not ids:
        raise bad_request("allowed_token_ids is not None and empty!", "allowed_token_ids", ids)
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise bad_request("allowed_token_ids contains out-of-vocab token id!", "allowed_token_ids", bad)
    return sorted(set(ids))


def repetition_detection(spec: dict | None) -> tuple[int, int, int] | None:
    """(min_pattern_size, max_pattern_size, min_count), or None when off (max_pattern_size 0)."""
    if spec is None:
        return None
    low, high, count = spec.get("min_pattern_size", 0), spec.get("max_pattern_size", 0), spec.get("min_count", 0)
    if low < 0 or high < 0 or low > high:
        raise bad_request(
            "max_pattern_size, min_pattern_size must be >=0, with min_pattern_size <= max_pattern_size. "
            "Set both to 0 to disable repetitive pattern detection.",
            "repetition_detection",
            spec,
        )
    if high == 0:
        return None
    if count < 2:
        raise bad_request(
            "min_count must be >= 2 to detect repetitive patterns in engine output. If you do not wish "
            "to detect repetitive patterns, set max_pattern_size to 0.",
            "repetition_detection",
            spec,
        )
    return low, high, count


def check_listed_logprobs(ids: list[int] | None, logprobs: Any, vocab_size: int, route: str) -> None:
    """`logprob_token_ids` as vLLM checks it: with `logprobs` set (true in chat; equal to their number on
    /inference/v1/generate), at most 128 of them, each in the vocabulary."""
    if not ids:
        return
    if route == "chat" and not logprobs:
        raise bad_request("when using `logprob_token_ids`, `logprobs` must be set to true.", "logprob_token_ids")
    if route == "completions" and logprobs is None:
        raise bad_request("when using `logprob_token_ids`, `logprobs` must be set.", "logprob_token_ids")
    if route == "generate" and logprobs is not None and logprobs != len(ids):
        raise bad_request(
            "When both logprobs and logprob_token_ids are set, logprobs must equal "
            f"len(logprob_token_ids). Got logprobs={logprobs}, len(logprob_token_ids)={len(ids)}.",
            "logprob_token_ids",
        )
    if len(ids) > MAX_LISTED_TOKENS:
        raise bad_request(
            f"Requested logprob_token_ids of length {len(ids)}, which is greater than max allowed: {MAX_LISTED_TOKENS}",
            "logprob_token_ids",
            len(ids),
        )
    out_of_vocabulary("logprob_token_ids", ids, vocab_size)


def check_cache_salt(salt: Any) -> None:
    """vLLM's rules for `cache_salt`: a non-empty string of at most 128 characters without @, /, \\ or NUL."""
    if salt is None:
        return
    if not isinstance(salt, str) or not salt:
        raise bad_request("Parameter 'cache_salt' must be a non-empty string if provided.", "cache_salt")
    if len(salt) > MAX_CACHE_SALT or any(c in salt for c in "@/\\\0"):
        raise bad_request(
            "Parameter 'cache_salt' must be at most 128 characters and must not contain '@', '/', '\\\\', or NUL.",
            "cache_salt",
        )


def refuse(fields: dict[str, Any], rules: dict[str, Rule]) -> None:
    """A 400 for the first field that asks for what tandem serve does not implement (fields.py's tables)."""
    for name, rule in rules.items():
        if rule.status == REFUSED and fields.get(name) not in rule.accepted:
            raise bad_request(f"`{name}` is not supported by tandem serve: {rule.note}.", name, fields.get(name))


def check_ranges(params: SamplingParams) -> None:
    """vLLM's range checks of the sampling fields."""
    checks = [
        ("temperature", 0.0 <= params.temperature <= 2.0, "temperature must be in [0, 2]"),
        ("top_p", 0.0 < params.top_p <= 1.0, "top_p must be in (0, 1]"),
        ("top_k", params.top_k >= -1, "top_k must be 0 (disable), or at least 1"),
        ("min_p", 0.0 <= params.min_p <= 1.0, "min_p must be in [0, 1]"),
        (
            "repetition_penalty",
            params.repetition_penalty > 0 and params.repetition_penalty != float("inf"),
            "repetition_penalty must be greater than zero",
        ),
        ("presence_penalty", -2.0 <= params.presence_penalty <= 2.0, "presence_penalty must be in [-2, 2]"),
        ("frequency_penalty", -2.0 <= params.frequency_penalty <= 2.0, "frequency_penalty must be in [-2, 2]"),
        ("min_tokens", 0 <= params.min_tokens <= max(params.max_tokens, 0), "min_tokens must be in [0, max_tokens]"),
    ]
    for name, ok, message in checks:
        if not ok:
            value = getattr(params, name)
            raise bad_request(f"{message}, got {value}.", name, value)


def check_logprobs(params: SamplingParams, max_logprobs: int, vocab_size: int) -> None:
    """The `--max-logprobs` cap (-1 asks for the whole vocabulary), and stop ids inside the vocabulary."""
    for name, kind in (("logprobs", "sample"), ("prompt_logprobs", "prompt")):
        value = getattr(params, name)
        if value is None:
            continue
        requested = vocab_size if value == -1 else value
        if value < -1 or (max_logprobs != -1 and requested > max_logprobs):
            raise bad_request(
                f"Requested {kind} logprobs of {value}, which is greater than max allowed: {max_logprobs}", name, value
            )
    out_of_vocab = [t for t in params.stop_token_ids if t >= vocab_size]
    if out_of_vocab:
        raise bad_request(f"Token id {out_of_vocab[0]} is out of vocabulary", "stop_token_ids", out_of_vocab[0])


def stop_strings(stop: str | list[str] | None) -> list[str]:
    strings = [stop] if isinstance(stop, str) else list(stop or [])
    if len(strings) > MAX_STOP_STRINGS:
        raise bad_request(
            f"At most {MAX_STOP_STRINGS} stop strings are allowed, got {len(strings)}.", "stop", len(strings)
        )
    if any(s == "" for s in strings):
        raise bad_request("Empty strings are not allowed in stop.", "stop", strings)
    return strings


def find_stop(text: str, stops: list[str], before: int = 0) -> tuple[str, int] | None:
    """The first stop string in `text` and where it starts, a match lying wholly in its first `before` characters
    (the text of the first min_tokens tokens, where vLLM does not look) left out."""
    found = [(at, stop) for stop in stops if (at := text.find(stop, max(0, before - len(stop) + 1))) >= 0]
    return (min(found)[1], min(found)[0]) if found else None


def tool_choice(req: ChatCompletionRequest, parser: str | None, auto_tools: bool) -> str:
    """The request's `tool_choice` checked as vLLM 0.33 checks it: "auto" (read the reply's calls) or "none"
    (`tools` only rendered into the prompt). "required" and named functions need output constrained to the call's
    JSON schema, which tandem serve does not implement: a 400 saying so."""
    if req.tools == []:
        raise bad_request(
            "`tools` must not be an empty array. Either provide at least one tool or omit the field entirely.", "tools"
        )
    choice = req.tool_choice if req.tool_choice is not None or not req.tools else "auto"
    if choice is None or choice == "none":
        return "none"
    if req.tools is None:
        raise bad_request("When using `tool_choice`, `tools` must be set.", "tool_choice")
    if choice not in ("auto", "required") and not isinstance(choice, dict):
        raise bad_request(
            f'Invalid value for `tool_choice`: {choice}! Only named tools, "none", "auto" or "required" are supported.',
            "tool_choice",
        )
    if isinstance(choice, dict):
        usage = 'Correct usage: `{"type": "function", "function": {"name": "my_function"}}`'
        function = choice.get("function")
        if not isinstance(function, dict):
            raise bad_request(
                f"Invalid value for `function`: `{function}` in `tool_choice`! {usage}", "tool_choice.function"
            )
        name = function.get("name")
        if not isinstance(name, str) or not name:
            raise bad_request(
                f"Expected field `name` in `function` in `tool_choice`! {usage}", "tool_choice.function.name"
            )
        if not any(isinstance(tool, dict) and (tool.get("function") or {}).get("name") == name for tool in req.tools):
            raise bad_request(
                "The tool specified in `tool_choice` does not match any of the specified `tools`", "tool_choice"
            )
    if choice == "auto":
        if not auto_tools:
            raise bad_request('"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set')
        return "auto"
    described = f'function "{choice["function"]["name"]}"' if isinstance(choice, dict) else f'"{choice}"'
    if parser is None:
        raise bad_request(f"tool_choice={described} requires --tool-call-parser to be set")
    raise bad_request(
        f"tool_choice={described} is not supported by tandem serve: vLLM constrains the output to the "
        "call's JSON schema (guided decoding), which tandem serve does not implement. Send "
        'tool_choice "auto" (the model decides) or "none".',
        "tool_choice",
    )
