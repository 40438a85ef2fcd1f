"""`tandem serve`: an HTTP server that speaks vLLM 0.33's protocol over the batching engine.

Everything the rollout worker and the trainer use against `vllm serve` works here unchanged:
token-in completions with processed log-probs, chat, the scale-out generate endpoint with sampling
masks, the dev routes for pausing and reloading weights, runtime LoRA adapters and `/metrics`.
A bad request gets a 4xx in vLLM's error shape; a bug of the server's gets a 500 with its traceback
in the server log. Either way the server keeps serving. Request preparation lives in preparation.py,
the control routes (pause, weights, LoRA) in control.py, the response bodies in responses.py.
"""

import asyncio
import contextlib
import gc
import json
import logging
import random
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import torch
from aiohttp import web
from pydantic import ValidationError
from transformers import AutoTokenizer

from tandem import __version__
from tandem.chat.tool_formats import FORMATS, tool_call_format
from tandem.errors import UsageError
from tandem.httpapp import api_key_auth, error_response, start_app
from tandem.kernels.openmp import in_passing_thread
from tandem.model import architecture
from tandem.serve import fields, protocol, responses
from tandem.serve.control import Control
from tandem.serve.engine import ENGINE_STOPPED, Engine, EngineRequest
from tandem.serve.lora import AdapterSet
from tandem.serve.prefix_cache import BLOCK_SIZE
from tandem.serve.preparation import Ask, Preparer
from tandem.serve.protocol import ApiError, bad_request
from tandem.serve.streaming import DONE, ChatStream, CompletionStream, Stream, StreamOptions, sse
from tandem.serve.weight_receiver import Receiver, parse_config

logger = logging.getLogger("tandem.serve")
VLLM_PROTOCOL_VERSION = "0.33.0"
PAUSED_MESSAGE = "Generation is paused. Please retry after it resumes."
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


SERVER_KEY = web.AppKey("tandem_server", object)
LOAD_TRACKED = ("/v1/completions", "/v1/chat/completions", "/inference/v1/generate", "/invocations")


def plain(value):
    """A tokenizer's init kwargs as JSON: added tokens by their text."""
    if hasattr(value, "content"):
        return value.content
    if isinstance(value, dict):
        return {str(k): plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    return value


@web.middleware
async def request_id_header(request: web.Request, handler):
    """`--enable-request-id-headers`: every answer carries X-Request-Id, the request's own or a new one."""
    response = await handler(request)
    if not response.prepared:  # a stream sent its headers already, with the id (Server._stream)
        response.headers["X-Request-Id"] = request.headers.get("X-Request-Id") or uuid.uuid4().hex
    return response


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


@web.middleware
async def errors(request: web.Request, handler):
    """Deliberate answers (ApiError, HTTP errors) keep their status; any other exception is a bug of the
    server's: 500 in vLLM's shape, its traceback in the server log, and the server keeps serving."""
    try:
        return await handler(request)
    except ApiError as exc:
        return web.json_response(exc.body(), status=exc.status)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        return error_response(exc.status, exc.reason, exc.reason)
    except NotImplementedError as exc:
        return error_response(501, str(exc), "NotImplementedError")
    except Exception as exc:
        logger.exception("error while serving %s %s", request.method, request.path)
        return error_response(500, protocol.sanitize(f"{type(exc).__name__}: {exc}"), "InternalServerError")


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
    model = architecture.auto_class(args.model, trust_remote_code=args.trust_remote_code).from_pretrained(
        args.model,
        dtype=pick_dtype(args.dtype),
        trust_remote_code=args.trust_remote_code,
        attn_implementation="eager" if exact else None,
    )
    return model.to(device).eval(), exact


class Server:
    """The HTTP layer: reads requests, has them prepared and run by the engine, shapes vLLM's responses."""

    def __init__(self, args: ServeArgs):
        check_tool_flags(args)
        self.args = args
        self.tokenizer = AutoTokenizer.from_pretrained(
            args.tokenizer or args.model, trust_remote_code=args.trust_remote_code
        )
        if args.chat_template is not None:
            self.tokenizer.chat_template = read_chat_template(args.chat_template)
        self.tool_format = (
            None if args.tool_call_parser is None else tool_call_format(args.tool_call_parser, self.tokenizer)
        )
        model, exact = load_model(args)
        config = model.config.get_text_config()  # a vision-language model serves its language model
        self.max_model_len = args.max_model_len or getattr(config, "max_position_embeddings", 2048)
        self.names = args.served_model_name or [args.model]
        self.vocab_size = config.vocab_size
        eos = self.tokenizer.eos_token_id if self.tokenizer.eos_token_id is not None else config.eos_token_id
        self.eos = eos[0] if isinstance(eos, list) else eos
        self.adapters = AdapterSet(args.max_loras, args.max_lora_rank, args.max_cpu_loras) if args.enable_lora else None
        self.engine = Engine(
            model,
            max_model_len=self.max_model_len,
            eos_token_id=self.eos,
            extra_stop_token_ids=sorted(generation_config_eos(args.model) - {self.eos}),
            max_num_seqs=args.max_num_seqs,
            logprobs_mode=args.logprobs_mode,
            adapters=self.adapters,
            exact=exact,
            step_delay_s=args.step_delay_s,
            prefix_caching=args.enable_prefix_caching,
            prefix_cache_max_tokens=args.prefix_cache_max_tokens,
        )
        self.prepare = Preparer(
            self.tokenizer,
            self.vocab_size,
            self.max_model_len,
            sampling_defaults(args),
            args.max_logprobs,
            args.max_num_seqs,
            args.return_sampling_mask,
            random.Random(args.seed) if args.seed is not None else None,
            args.trust_request_chat_template,
            args.default_chat_template_kwargs,
            args.chat_template_content_format,
            args.reasoning_effort_map,
        )
        for module in args.lora_modules:  # before the engine starts: nothing runs yet
            self.engine.model = self.load_at_start(module["name"], module["path"])
        transfer = parse_config(args.weight_transfer_config)
        self.control = Control(
            self.engine,
            self.adapters,
            self.names,
            Receiver(args.weight_transfer_timeout_s) if transfer is not None else None,
        )
        self.transfer_config = transfer
        self.text = responses.TokenText(self.tokenizer)
        self.fingerprint = fingerprint(args)
        self.started = int(time.time())
        self.in_flight = 0
        self.dtype = str(next(model.parameters()).dtype)

    def load_at_start(self, name: str, path: str) -> torch.nn.Module:
        """One `--lora-modules` adapter, refused as vLLM refuses it at start (its refusal ends the start)."""
        where = f"--lora-modules {name}={path}"
        if name in self.names:
            raise UsageError(f"{where}: The lora adapter '{name}' conflicts with a served base model.")
        try:
            return self.adapters.add(self.engine.model, name, path, set())
        except (LookupError, ValueError) as exc:  # not found, already loaded, refused
            raise UsageError(f"{where}: {exc}") from None

    # ---- app ---------------------------------------------------------------------------------
    def app(self) -> web.Application:
        middlewares = [errors, api_key_auth(self.args.api_key), self.track_load]
        if self.args.enable_request_id_headers:
            middlewares.insert(0, request_id_header)
        app = web.Application(middlewares=middlewares, client_max_size=256 * 1024 * 1024)
        app[SERVER_KEY] = self
        routes = [
            ("GET", "/health", self.health),
            ("GET", "/version", self.version),
            ("GET", "/v1/models", self.models),
            ("POST", "/v1/completions", self.completions),
            ("POST", "/v1/chat/completions", self.chat),
            ("POST", "/inference/v1/generate", self.generate),
            ("POST", "/tokenize", self.tokenize),
            ("POST", "/detokenize", self.detokenize),
            ("GET", "/server_info", self.server_info),
            ("GET", "/get_world_size", self.world_size),
            ("GET", "/metrics", self.metrics),
            ("POST", "/invocations", self.invocations),
            ("GET", "/load", self.load),
            ("GET", "/ping", self.health),
            ("POST", "/ping", self.health),
        ]
        if self.args.enable_tokenizer_info_endpoint:
            routes.append(("GET", "/tokenizer_info", self.tokenizer_info))
        for method, path, handler in routes + self.control.routes():
            app.router.add_route(method, path, handler)
        app.on_startup.append(self._start_engine)
        app.on_cleanup.append(self._stop_engine)
        return app

    async def _start_engine(self, _: web.Application) -> None:
        self.engine.start()

    async def _stop_engine(self, _: web.Application) -> None:
        await asyncio.get_running_loop().run_in_executor(None, self.engine.stop)

    # ---- generation --------------------------------------------------------------------------
    def _adapter_for(self, model: str | None) -> tuple[str, str | None]:
        """(name to echo, adapter or None) for a request's `model` field; 404 for an unknown name."""
        if model is None or model in self.names:
            return model or self.names[0], None
        if self.adapters and model in self.adapters.paths:
            return model, model
        valid = ", ".join(self.names + (list(self.adapters.paths) if self.adapters else []))
        raise ApiError(404, f"The model `{model}` does not exist. Valid aliases: {valid}.", "NotFoundError", "model")

    def _admit(self, model: str | None) -> tuple[str, str | None]:
        """What every generation request passes first: a served model (or adapter), a running engine, no pause."""
        name, adapter = self._adapter_for(model)
        if not self.engine.alive:
            raise ApiError(500, ENGINE_STOPPED, "InternalServerError")
        if self.control.pause_mode in ("abort", "wait"):
            raise ApiError(503, PAUSED_MESSAGE, "ServiceUnavailableError")
        return name, adapter

    @staticmethod
    def _check_stream_fields(req: protocol.SamplingFields) -> None:
        """vLLM's rules for the streaming fields: `stream_options` only with `stream`, no prompt log-probs streamed."""
        if req.stream_options is not None and not req.stream:
            raise bad_request(
                "Stream options can only be defined when `stream=True`.", "stream_options", req.stream_options
            )
        if req.stream and req.prompt_logprobs is not None and (req.prompt_logprobs > 0 or req.prompt_logprobs == -1):
            raise bad_request("`prompt_logprobs` are not available when `stream=True`.", "prompt_logprobs", None)

    async def _steps(self, requests: list[EngineRequest], every_step: bool):
        """Submit `requests` and yield after each engine step that touched them (`every_step`, for streams) or once
        they have all finished; leaving early (the client went away) aborts the unfinished ones, freeing their slots."""
        loop = asyncio.get_running_loop()
        wake = asyncio.Event()

        def notifier(request: EngineRequest):
            def notify():  # on the engine thread
                if every_step or request.finished:
                    loop.call_soon_threadsafe(wake.set)

            return notify

        for request in requests:
            request.notify = notifier(request)
            self.engine.submit(request)
        try:
            while True:
                await wake.wait()
                wake.clear()
                finished = all(r.finished for r in requests)
                yield
                if finished:
                    return
        finally:
            for request in requests:
                if not request.finished:
                    self.engine.abort(request)

    @staticmethod
    def _failure(requests: list[EngineRequest]) -> ApiError | None:
        """Why the engine failed these requests, or None."""
        if not any(s.finish_reason == "error" for r in requests for s in r.sequences):
            return None
        failed = next((r for r in requests if r.error), None)
        if failed is None:
            return ApiError(
                500,
                "The generation engine failed while serving this request: see the server log.",
                "InternalServerError",
            )
        return ApiError(
            failed.error_status,
            failed.error,
            "BadRequestError" if failed.error_status == 400 else "InternalServerError",
        )

    async def _generate(self, ask: Ask, adapter: str | None) -> list[EngineRequest]:
        """Prepare, submit and wait until every request has finished."""
        requests = self.prepare.engine_requests(ask, adapter)
        async with contextlib.aclosing(self._steps(requests, every_step=False)) as steps:
            async for _ in steps:
                pass
        if (failure := self._failure(requests)) is not None:
            raise failure
        return requests

    async def _stream(
        self, http_request: web.Request, requests: list[EngineRequest], stream: Stream
    ) -> web.StreamResponse:
        """Server-sent events: the stream's chunks after every engine step, an engine failure as an error event (the
        status is already 200), the usage chunk, `[DONE]`. A client that goes away aborts its requests at once."""
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        if self.args.enable_request_id_headers:
            response.headers["X-Request-Id"] = http_request.headers.get("X-Request-Id") or uuid.uuid4().hex
        await response.prepare(http_request)
        try:
            async with contextlib.aclosing(self._steps(requests, every_step=True)) as steps:
                async for _ in steps:
                    for chunk in stream.chunks():
                        await response.write(sse(chunk))
            failure = self._failure(requests)
            for chunk in [failure.body()] if failure else stream.final():
                await response.write(sse(chunk))
            await response.write(DONE)
            await response.write_eof()
        except ConnectionResetError:  # the client left; closing `steps` aborted what it had not received
            pass
        return response

    async def _read_openai(self, request: web.Request, model: type) -> protocol.SamplingFields:
        """A completions or chat body, with the server's default for `return_tokens_as_token_ids` filled in."""
        req = await protocol.read(request, model)
        if req.return_tokens_as_token_ids is None:
            req.return_tokens_as_token_ids = self.args.return_tokens_as_token_ids
        return req

    def stream_options(self, req: protocol.SamplingFields) -> StreamOptions:
        return StreamOptions.of(
            req,
            force_usage=self.args.enable_force_include_usage,
            interval=self.args.stream_interval,
            details=self.args.enable_prompt_tokens_details,
        )

    def _request_id(self, request: web.Request, body_id: str | None) -> str:
        return request.headers.get("X-Request-Id") or body_id or uuid.uuid4().hex

    async def completions(self, request: web.Request) -> web.StreamResponse:
        req = await self._read_openai(request, protocol.CompletionRequest)
        name, adapter = self._admit(req.model)
        self._check_stream_fields(req)
        ask = self.prepare.completion_ask(req)
        request_id = f"cmpl-{self._request_id(request, req.request_id)}"
        texts = self._prompt_texts(req.prompt, ask.prompts) if req.echo else [""] * len(ask.prompts)
        if req.stream:
            requests = self.prepare.engine_requests(ask, adapter)
            stream = CompletionStream(
                req,
                requests,
                request_id,
                name,
                self.fingerprint,
                self.text,
                protocol.stop_strings(req.stop),
                self.stream_options(req),
                prompt_texts=texts,
            )
            return await self._stream(request, requests, stream)
        engine_requests = await self._generate(ask, adapter)
        return web.json_response(
            responses.completion_body(
                request_id,
                name,
                self.fingerprint,
                req,
                engine_requests,
                self.text,
                texts,
                self.args.enable_prompt_tokens_details,
            )
        )

    def _prompt_texts(self, prompt, ids: list[list[int]]) -> list[str]:
        """What echo returns of each prompt: the text as sent, or token ids decoded with their special tokens."""
        if isinstance(prompt, str):
            return [prompt]
        if prompt and isinstance(prompt[0], str):
            return list(prompt)
        return [self.text.decode(p, skip_special_tokens=False) for p in ids]

    async def chat(self, request: web.Request) -> web.StreamResponse:
        req = await self._read_openai(request, protocol.ChatCompletionRequest)
        name, adapter = self._admit(req.model)
        self._check_stream_fields(req)
        choice = protocol.tool_choice(req, self.args.tool_call_parser, self.args.enable_auto_tool_choice)
        if choice == "none" and self.args.exclude_tools_when_tool_choice_none:
            req.tools = None
        tool_format = self.tool_format if choice == "auto" else None
        if tool_format is not None and tool_format.keeps_special_tokens:
            req.skip_special_tokens = False  # as vLLM's parser: the format's markers may be special tokens
        ask = self.prepare.chat_ask(req)
        request_id = f"chatcmpl-{self._request_id(request, req.request_id)}"
        reply = responses.ChatReply.of(req, self.args.response_role, self.text, tool_format)
        if req.stream:
            requests = self.prepare.engine_requests(ask, adapter)
            stream = ChatStream(
                req,
                requests,
                request_id,
                name,
                self.fingerprint,
                self.text,
                protocol.stop_strings(req.stop),
                self.stream_options(req),
                reply=reply,
            )
            return await self._stream(request, requests, stream)
        (engine_request,) = await self._generate(ask, adapter)
        return web.json_response(
            responses.chat_body(
                request_id, name, self.fingerprint, req, engine_request, reply, self.args.enable_prompt_tokens_details
            )
        )

    async def generate(self, request: web.Request) -> web.Response:
        if not self.args.enable_scale_out:
            raise ApiError(
                403,
                "Scale-out endpoints are disabled. Restart vllm serve with --enable-scale-out to enable them.",
                "PermissionDeniedError",
            )
        req = await protocol.read(request, protocol.GenerateRequest)
        name, adapter = self._admit(req.model)
        (engine_request,) = await self._generate(self.prepare.generate_ask(req), adapter)
        request_id = f"generate-tokens-{self._request_id(request, req.request_id)}"
        return web.json_response(
            responses.generate_body(
                request_id,
                name,
                req,
                engine_request,
                self.text,
                self.args.return_sampling_mask,
                self.args.enable_prompt_tokens_details,
            )
        )

    async def invocations(self, request: web.Request) -> web.StreamResponse:
        """SageMaker's route, as vLLM serves it: the body is a chat request when it reads as one, else a completion."""
        body = await protocol.read(request, protocol.Request)
        for handler, model in (
            (self.chat, protocol.ChatCompletionRequest),
            (self.completions, protocol.CompletionRequest),
        ):
            try:
                model.model_validate(body.model_dump())
            except ValidationError:
                continue
            return await handler(request)
        raise bad_request(
            "Cannot find suitable handler for request. Expected one of: ['ChatCompletionRequest', 'CompletionRequest']"
        )

    # ---- tokenizer -----------------------------------------------------------------------------
    async def tokenize(self, request: web.Request) -> web.Response:
        req = await protocol.read(request, protocol.TokenizeRequest)
        protocol.refuse(req.model_dump(), fields.TOKENIZE)
        self._adapter_for(req.model)
        if req.messages is not None:
            ids = self.prepare.render_chat(req)
        elif req.prompt is not None:
            add_special = req.add_special_tokens if req.add_special_tokens is not None else True
            ids = self.tokenizer.encode(req.prompt, add_special_tokens=add_special)
        else:
            raise bad_request("Either `prompt` or `messages` must be provided.", "prompt", None)
        return web.json_response(
            {
                "count": len(ids),
                "max_model_len": self.max_model_len,
                "tokens": ids,
                "token_strs": self.tokenizer.convert_ids_to_tokens(ids) if req.return_token_strs else None,
            }
        )

    async def detokenize(self, request: web.Request) -> web.Response:
        req = await protocol.read(request, protocol.DetokenizeRequest)
        self._adapter_for(req.model)
        bad = next((t for t in req.tokens if t >= self.vocab_size), None)
        if bad is not None:
            raise bad_request(f"Token id {bad} is out of vocabulary", "tokens", bad)
        return web.json_response({"prompt": self.tokenizer.decode(req.tokens)})

    # ---- info ----------------------------------------------------------------------------------
    async def health(self, _: web.Request) -> web.Response:
        return web.Response(status=200 if self.engine.alive else 503)

    async def version(self, _: web.Request) -> web.Response:
        return web.json_response({"version": VLLM_PROTOCOL_VERSION, "tandem_version": __version__})

    def _model_card(self, name: str, root: str, parent: str | None, max_len: int | None) -> dict:
        permission = {
            "id": f"modelperm-{uuid.uuid4().hex}",
            "object": "model_permission",
            "created": self.started,
            "allow_create_engine": False,
            "allow_sampling": True,
            "allow_logprobs": True,
            "allow_search_indices": False,
            "allow_view": True,
            "allow_fine_tuning": False,
            "organization": "*",
            "group": None,
            "is_blocking": False,
        }
        return {
            "id": name,
            "object": "model",
            "created": self.started,
            "owned_by": "vllm",
            "root": root,
            "parent": parent,
            "max_model_len": max_len,
            "permission": [permission],
        }

    async def models(self, _: web.Request) -> web.Response:
        cards = [self._model_card(n, self.args.model, None, self.max_model_len) for n in self.names]
        for lora, path in list(self.adapters.paths.items()) if self.adapters else []:  # the engine thread adds
            cards.append(self._model_card(lora, path, self.names[0], None))
        return web.json_response({"object": "list", "data": cards})

    @property
    def prefix_caching(self) -> bool:
        """Whether prefix caching is on: asked for and possible (a model with recurrent layers has none)."""
        return self.engine.prefix_cache is not None

    def config(self) -> dict:
        stats = self.engine.stats()
        lora = None
        if self.adapters:
            lora = {
                "max_lora_rank": self.adapters.max_lora_rank,
                "max_loras": self.adapters.max_loras,
                "max_cpu_loras": self.adapters.max_cpu_loras,
            }
        return {
            "model_config": {
                "model": self.args.model,
                "served_model_name": self.names[0],
                "dtype": self.dtype,
                "max_model_len": self.max_model_len,
                "max_logprobs": self.args.max_logprobs,
                "logprobs_mode": self.args.logprobs_mode,
                "return_sampling_mask": self.args.return_sampling_mask,
                "generation_config": self.args.generation_config,
                "seed": self.args.seed,
                "decode_mode": "exact" if self.engine.exact else "fast",
            },
            "cache_config": {
                "block_size": BLOCK_SIZE,
                "num_gpu_blocks": stats.kv_capacity_tokens // BLOCK_SIZE,
                "kv_cache_size_tokens": stats.kv_capacity_tokens,
                "enable_prefix_caching": self.prefix_caching,
            },
            "scheduler_config": {"max_num_seqs": self.args.max_num_seqs},
            "parallel_config": {"data_parallel_size": 1, "tensor_parallel_size": 1, "pipeline_parallel_size": 1},
            "lora_config": lora,
            "device_config": {"device": str(self.engine.device)},
            "weight_transfer_config": self.transfer_config,
        }

    async def server_info(self, request: web.Request) -> web.Response:
        fmt = request.query.get("config_format", "text")
        if fmt not in ("text", "json"):
            raise bad_request(f"config_format must be 'text' or 'json', got {fmt!r}.", "config_format", fmt)
        config = self.config()
        return web.json_response(
            {
                "vllm_config": config if fmt == "json" else str(config),
                "vllm_env": {},
                "system_env": {"server": "tandem serve"},
            }
        )

    async def load(self, _: web.Request) -> web.Response:
        """In-flight generation requests (`--enable-server-load-tracking`; 0 without it, as vLLM answers)."""
        return web.json_response({"server_load": self.in_flight})

    async def tokenizer_info(self, _: web.Request) -> web.Response:
        """The tokenizer's configuration, as vLLM's `--enable-tokenizer-info-endpoint` shows it."""
        info = {k: v for k, v in plain(self.tokenizer.init_kwargs).items() if k not in ("vocab_file", "merges_file")}
        info["tokenizer_class"] = type(self.tokenizer).__name__
        if self.args.chat_template is not None:
            info["chat_template"] = self.tokenizer.chat_template
        return web.json_response(info, dumps=lambda value: json.dumps(value, default=str))

    @web.middleware
    async def track_load(self, request: web.Request, handler):
        """Count the generation requests being served, their streams included (`--enable-server-load-tracking`)."""
        if not (self.args.enable_server_load_tracking and request.path in LOAD_TRACKED):
            return await handler(request)
        self.in_flight += 1
        try:
            return await handler(request)
        finally:
            self.in_flight -= 1

    async def world_size(self, _: web.Request) -> web.Response:
        return web.json_response({"world_size": 1})

    async def metrics(self, _: web.Request) -> web.Response:
        return web.Response(
            body=prometheus_text(self.engine.stats(), self.names[0], self.prefix_caching).encode(),
            headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"},
        )


def prometheus_text(stats, model_name: str, prefix_caching: bool) -> str:
    """The `/metrics` exposition with vLLM's names and labels."""
    labels = f'engine="0",model_name="{model_name}"'
    lines = []

    def metric(name: str, kind: str, help_text: str, samples: list[tuple[str, float]], common: str = labels) -> None:
        lines.extend([f"# HELP {name} {help_text}", f"# TYPE {name} {kind}"])
        lines.extend(f"{name}{{{extra}{common}}} {float(value)}" for extra, value in samples)

    usage = stats.kv_used_tokens / stats.kv_capacity_tokens if stats.kv_capacity_tokens else 0.0
    metric("vllm:kv_cache_usage_perc", "gauge", "KV-cache usage. 1 means 100 percent usage.", [("", usage)])
    metric(
        "vllm:num_requests_running", "gauge", "Number of requests in model execution batches.", [("", stats.running)]
    )
    metric("vllm:num_requests_waiting", "gauge", "Number of requests waiting to be processed.", [("", stats.waiting)])
    metric(
        "vllm:num_preemptions_total",
        "counter",
        "Cumulative number of preemption from the engine.",
        [("", stats.preemptions_total)],
    )
    metric(
        "vllm:prompt_tokens_total", "counter", "Number of prefill tokens processed.", [("", stats.prompt_tokens_total)]
    )
    metric(
        "vllm:generation_tokens_total",
        "counter",
        "Number of generation tokens processed.",
        [("", stats.generation_tokens_total)],
    )
    metric(
        "vllm:prefix_cache_queries_total",
        "counter",
        "Prefix cache queries, in terms of number of queried tokens.",
        [("", stats.prefix_cache_queries_total)],
    )
    metric(
        "vllm:prefix_cache_hits_total",
        "counter",
        "Prefix cache hits, in terms of number of cached tokens.",
        [("", stats.prefix_cache_hits_total)],
    )
    metric(
        "vllm:request_success_total",
        "counter",
        "Count of successfully processed requests.",
        [(f'finished_reason="{reason}",', count) for reason, count in sorted(stats.finished_total.items())],
    )
    blocks = stats.kv_capacity_tokens // BLOCK_SIZE
    info = (
        f'block_size="{BLOCK_SIZE}",enable_prefix_caching="{prefix_caching}",kv_cache_size_tokens="{stats.kv_capacity_tokens}",'
        f'num_gpu_blocks="{blocks}",'
    )
    metric(
        "vllm:cache_config_info", "gauge", "Information of the LLMEngine CacheConfig", [(info, 1)], common='engine="0"'
    )  # vLLM labels its config info by engine alone
    return "\n".join(lines) + "\n"


async def start_server(args: ServeArgs) -> tuple[web.AppRunner, int]:
    """Start serving in the running event loop; returns the runner and the bound port (for --port 0)."""
    app = in_passing_thread(Server, args).app()  # the main thread stays out of OpenMP (tandem.kernels.openmp)
    gc.freeze()  # the ~200k objects of the imports and the model, never garbage: no collection walks them (2x decode)
    return await start_app(app, args.host, args.port, handler_cancellation=True)
