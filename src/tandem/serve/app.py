"""`tandem serve`: an HTTP server that speaks vLLM 0.33's protocol over the batching engine.

Everything the rollout worker and the trainer use against `vllm serve` works here unchanged:
token-in completions with processed log-probs, chat, the scale-out generate endpoint with sampling
masks, the dev routes for pausing and reloading weights, runtime LoRA adapters and `/metrics`.
A bad request gets a 4xx in vLLM's error shape; a bug of the server's gets a 500 with its traceback
in the server log. Either way the server keeps serving. Request preparation lives in preparation.py,
the control routes (pause, weights, LoRA) in control.py, the routes that describe the server in info.py, its
settings in serve_args.py, the response bodies in responses.py.
"""

import asyncio
import contextlib
import gc
import logging
import random
import uuid
from typing import TypeVar

import torch
from aiohttp import web
from pydantic import ValidationError
from transformers import AutoTokenizer

from tandem.chat.tool_formats import tool_call_format
from tandem.errors import UsageError
from tandem.httpapp import api_key_auth, error_response, start_app
from tandem.kernels.openmp import in_passing_thread
from tandem.model import architecture
from tandem.serve import fields, protocol, responses
from tandem.serve.control import Control
from tandem.serve.engine import ENGINE_STOPPED, Engine
from tandem.serve.info import Info
from tandem.serve.lora import AdapterSet
from tandem.serve.preparation import Ask, Preparer
from tandem.serve.protocol import ApiError, bad_request
from tandem.serve.requests import EngineRequest
from tandem.serve.serve_args import (
    ServeArgs,
    check_tool_flags,
    fingerprint,
    generation_config_eos,
    load_model,
    read_chat_template,
    sampling_defaults,
)
from tandem.serve.streaming import DONE, ChatStream, CompletionStream, Stream, StreamOptions, sse
from tandem.serve.transfer_config import parse_config
from tandem.serve.weight_receiver import Receiver

logger = logging.getLogger("tandem.serve")
OpenAIRequest = TypeVar("OpenAIRequest", protocol.CompletionRequest, protocol.ChatCompletionRequest)
PAUSED_MESSAGE = "Generation is paused. Please retry after it resumes."


SERVER_KEY = web.AppKey("tandem_server", object)


@web.middleware
async def request_id_header(request: web.Request, handler):
    """`--enable-request-id-headers`: every answer carries X-Request-Id, the request's own or a new one."""
    response = await handler(request)
    if not response.prepared:  # a stream sent its headers already, with the id (Server._stream)
        response.headers["X-Request-Id"] = request.headers.get("X-Request-Id") or uuid.uuid4().hex
    return response


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
        config = architecture.transformers_model(model).config.get_text_config()  # a VLM serves its language model
        model_len: int = getattr(config, "max_position_embeddings", 2048)
        self.max_model_len = args.max_model_len or model_len
        self.names = args.served_model_name or [args.model]
        self.vocab_size = config.vocab_size
        eos = self.tokenizer.eos_token_id if self.tokenizer.eos_token_id is not None else config.eos_token_id
        self.eos = eos[0] if isinstance(eos, list) else eos
        self.adapters = AdapterSet(args.max_loras, args.max_lora_rank, args.max_cpu_loras) if args.enable_lora else None
        self.engine = self._engine(model, exact)
        self.prepare = self._preparer()
        for module in args.lora_modules:  # before the engine starts: nothing runs yet
            self.engine.model = self.load_at_start(module["name"], module["path"])
        transfer = parse_config(args.weight_transfer_config)
        self.control = Control(
            self.engine,
            self.adapters,
            self.names,
            Receiver(args.weight_transfer_timeout_s) if transfer is not None else None,
        )
        self.info = Info(
            args,
            self.engine,
            self.tokenizer,
            self.names,
            self.adapters,
            self.max_model_len,
            str(next(model.parameters()).dtype),
            transfer,
        )
        self.text = responses.TokenText(self.tokenizer)
        self.fingerprint = fingerprint(args)

    def _engine(self, model: torch.nn.Module, exact: bool) -> Engine:
        args = self.args
        return Engine(
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
            recompute_kv_cache=args.recompute_kv_cache_after_weight_updates,
        )

    def _preparer(self) -> Preparer:
        args = self.args
        return Preparer(
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

    def load_at_start(self, name: str, path: str) -> torch.nn.Module:
        """One `--lora-modules` adapter, refused as vLLM refuses it at start (its refusal ends the start)."""
        where = f"--lora-modules {name}={path}"
        assert self.adapters is not None, "--lora-modules needs --enable-lora (the command line checks it)"
        if name in self.names:
            raise UsageError(f"{where}: The lora adapter '{name}' conflicts with a served base model.")
        try:
            return self.adapters.add(self.engine.model, name, path, set())
        except (LookupError, ValueError) as exc:  # not found, already loaded, refused
            raise UsageError(f"{where}: {exc}") from None

    # ---- app ---------------------------------------------------------------------------------
    def app(self) -> web.Application:
        middlewares = [errors, api_key_auth(self.args.api_key), self.info.track_load]
        if self.args.enable_request_id_headers:
            middlewares.insert(0, request_id_header)
        app = web.Application(middlewares=middlewares, client_max_size=256 * 1024 * 1024)
        app[SERVER_KEY] = self
        routes = [
            ("POST", "/v1/completions", self.completions),
            ("POST", "/v1/chat/completions", self.chat),
            ("POST", "/inference/v1/generate", self.generate),
            ("POST", "/invocations", self.invocations),
            ("POST", "/tokenize", self.tokenize),
            ("POST", "/detokenize", self.detokenize),
        ]
        for method, path, handler in routes + self.info.routes() + self.control.routes():
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
    def _check_stream_fields(req: protocol.CompletionRequest | protocol.ChatCompletionRequest) -> None:
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
        if failed is None or failed.error is None:
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

    async def _streamed(
        self,
        http_request: web.Request,
        req: protocol.CompletionRequest | protocol.ChatCompletionRequest,
        ask: Ask,
        adapter: str | None,
        request_id: str,
        name: str,
        **shape,
    ) -> web.StreamResponse:
        """A completions or chat request answered as a stream: its engine requests, and the stream of its route's
        chunks (`shape`: the completion's echoed prompt texts, or the chat's reply)."""
        requests = self.prepare.engine_requests(ask, adapter)
        stream_cls = ChatStream if isinstance(req, protocol.ChatCompletionRequest) else CompletionStream
        stream = stream_cls(
            req,
            requests,
            request_id,
            name,
            self.fingerprint,
            self.text,
            protocol.stop_strings(req.stop),
            self.stream_options(req),
            **shape,
        )
        return await self._stream(http_request, requests, stream)

    async def _read_openai(self, request: web.Request, model: type[OpenAIRequest]) -> OpenAIRequest:
        """A completions or chat body, with the server's default for `return_tokens_as_token_ids` filled in."""
        req = await protocol.read(request, model)
        if req.return_tokens_as_token_ids is None:
            req.return_tokens_as_token_ids = self.args.return_tokens_as_token_ids
        return req

    def stream_options(self, req: protocol.CompletionRequest | protocol.ChatCompletionRequest) -> StreamOptions:
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
            return await self._streamed(request, req, ask, adapter, request_id, name, prompt_texts=texts)
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
            return await self._streamed(request, req, ask, adapter, request_id, name, reply=reply)
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


async def start_server(args: ServeArgs) -> tuple[web.AppRunner, int]:
    """Start serving in the running event loop; returns the runner and the bound port (for --port 0)."""
    app = in_passing_thread(Server, args).app()  # the main thread stays out of OpenMP (tandem.kernels.openmp)
    gc.freeze()  # the ~200k objects of the imports and the model, never garbage: no collection walks them (2x decode)
    return await start_app(app, args.host, args.port, handler_cancellation=True)
