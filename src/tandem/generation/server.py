"""`tandem serve`: an HTTP server that speaks vLLM 0.33's protocol over the batching engine.

Everything the rollout worker and the trainer use against `vllm serve` works here unchanged:
token-in completions with processed log-probs, chat, the scale-out generate endpoint with sampling
masks, the dev routes for pausing and reloading weights, runtime LoRA adapters and `/metrics`.
A bad request gets a 4xx in vLLM's error shape and the server keeps serving.
"""

import asyncio
import json
import logging
import random
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import torch
from aiohttp import web
from pydantic import BaseModel
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from tandem.generation import protocol, responses
from tandem.generation.engine import Engine, EngineRequest
from tandem.generation.lora import AdapterNotFound, AdapterSet
from tandem.generation.protocol import ApiError, bad_request, parse

logger = logging.getLogger("tandem.serve")
VLLM_PROTOCOL_VERSION = "0.33.0"
PAUSED_MESSAGE = "Generation is paused. Please retry after it resumes."
AUTH_PREFIXES = ("/v1", "/v2", "/inference", "/cohere")
GENERATION_CONFIG_FIELDS = {
    "temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
    "repetition_penalty": "repetition_penalty", "presence_penalty": "presence_penalty",
    "frequency_penalty": "frequency_penalty", "max_new_tokens": "max_tokens",
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


SERVER_KEY = web.AppKey("tandem_server", object)


def pick_device(name: str) -> torch.device:
    return torch.device(("cuda" if torch.cuda.is_available() else "cpu") if name == "auto" else name)


def pick_dtype(name: str) -> torch.dtype | str:
    if name == "auto":
        return "auto"
    dtypes = {"float32": torch.float32, "float": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16, "float16": torch.float16, "half": torch.float16}
    if name not in dtypes:
        raise ValueError(f"--dtype {name!r} is not one of auto, {', '.join(dtypes)}")
    return dtypes[name]


def read_generation_config(folder: str) -> dict:
    """The keys a model folder's generation_config.json sets explicitly ({} when it has none)."""
    config_file = Path(folder) / "generation_config.json"
    return json.loads(config_file.read_text()) if config_file.is_file() else {}


def sampling_defaults(args: ServeArgs) -> dict:
    """Server-side sampling defaults: generation_config.json's explicit values ('auto'), or none ('vllm')."""
    if args.generation_config == "vllm":
        return {}
    config = read_generation_config(args.model if args.generation_config == "auto" else args.generation_config)
    return {ours: config[theirs] for theirs, ours in GENERATION_CONFIG_FIELDS.items() if theirs in config}


def load_weights(model: torch.nn.Module, weights_path: str) -> int:
    """Copy a safetensors checkpoint (HF parameter names) into `model` in place; returns tensors loaded."""
    files = sorted(Path(weights_path).glob("*.safetensors"))
    if not files:
        raise ValueError(f"reload_weights: no *.safetensors files in {weights_path}")
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    params = {name.replace(".base_layer", ""): p for name, p in base.named_parameters()}
    loaded = 0
    with torch.no_grad():
        for file in files:
            for name, tensor in load_file(str(file)).items():
                if name not in params:
                    raise ValueError(f"reload_weights: {name!r} in {file.name} is not a parameter of the served model")
                if params[name].shape != tensor.shape:
                    raise ValueError(f"reload_weights: {name!r} has shape {tuple(tensor.shape)}, the model expects {tuple(params[name].shape)}")
                params[name].copy_(tensor)
                loaded += 1
    return loaded


class Server:
    """The HTTP layer: validates requests, submits them to the engine, shapes vLLM's responses."""

    def __init__(self, args: ServeArgs):
        self.args = args
        self.tokenizer = AutoTokenizer.from_pretrained(args.model)
        device = pick_device(args.device)
        if args.decode_mode not in ("auto", "exact", "fast"):
            raise ValueError(f"--decode-mode {args.decode_mode!r} is not one of auto, exact, fast")
        exact = args.decode_mode == "exact" or (args.decode_mode == "auto" and device.type == "cpu")
        attention = "eager" if exact else "sdpa"
        model = AutoModelForCausalLM.from_pretrained(args.model, dtype=pick_dtype(args.dtype), attn_implementation=attention)
        model.to(device).eval()
        config = model.config
        self.max_model_len = args.max_model_len or getattr(config, "max_position_embeddings", 2048)
        self.names = args.served_model_name or [args.model]
        self.vocab_size = config.vocab_size
        self.defaults = sampling_defaults(args)
        eos = self.tokenizer.eos_token_id if self.tokenizer.eos_token_id is not None else config.eos_token_id
        self.eos = eos[0] if isinstance(eos, list) else eos
        extra = self._generation_config_eos() - {self.eos}
        self.adapters = AdapterSet(args.max_loras, args.max_lora_rank, args.max_cpu_loras) if args.enable_lora else None
        self.engine = Engine(
            model, max_model_len=self.max_model_len, eos_token_id=self.eos, extra_stop_token_ids=sorted(extra),
            max_num_seqs=args.max_num_seqs, logprobs_mode=args.logprobs_mode, adapters=self.adapters, exact=exact,
            step_delay_s=args.step_delay_s,
        )
        self.text = responses.TokenText(self.tokenizer)
        self.pause_mode: str | None = None
        self.seed_rng = random.Random(args.seed) if args.seed is not None else None
        self.fingerprint = f"vllm-{VLLM_PROTOCOL_VERSION}-tandem"
        self.started = int(time.time())
        self.dtype = str(next(model.parameters()).dtype)

    def _generation_config_eos(self) -> set[int]:
        eos = read_generation_config(self.args.model).get("eos_token_id")
        return set(eos if isinstance(eos, list) else [eos] if eos is not None else [])

    # ---- app ---------------------------------------------------------------------------------
    def app(self) -> web.Application:
        app = web.Application(middlewares=[self._errors, self._auth], client_max_size=256 * 1024 * 1024)
        app[SERVER_KEY] = self
        routes = [
            ("GET", "/health", self.health), ("GET", "/version", self.version), ("GET", "/v1/models", self.models),
            ("POST", "/v1/completions", self.completions), ("POST", "/v1/chat/completions", self.chat),
            ("POST", "/inference/v1/generate", self.generate), ("POST", "/tokenize", self.tokenize),
            ("POST", "/detokenize", self.detokenize), ("GET", "/server_info", self.server_info),
            ("GET", "/get_world_size", self.world_size), ("POST", "/pause", self.pause), ("POST", "/resume", self.resume),
            ("GET", "/is_paused", self.is_paused), ("POST", "/reset_prefix_cache", self.reset_prefix_cache),
            ("POST", "/collective_rpc", self.collective_rpc), ("GET", "/weight_info", self.weight_info),
            ("POST", "/v1/load_lora_adapter", self.load_lora), ("POST", "/v1/unload_lora_adapter", self.unload_lora),
            ("GET", "/metrics", self.metrics),
        ]
        for path in ("/init_weight_transfer_engine", "/start_weight_update", "/update_weights", "/finish_weight_update"):
            routes.append(("POST", path, self.weight_transfer))
        for method, path, handler in routes:
            app.router.add_route(method, path, handler)
        app.on_startup.append(self._start_engine)
        app.on_cleanup.append(self._stop_engine)
        return app

    async def _start_engine(self, _: web.Application) -> None:
        self.engine.start()

    async def _stop_engine(self, _: web.Application) -> None:
        await asyncio.get_running_loop().run_in_executor(None, self.engine.stop)

    @web.middleware
    async def _errors(self, request: web.Request, handler):
        try:
            return await handler(request)
        except ApiError as exc:
            return web.json_response(exc.body(), status=exc.status)
        except web.HTTPException as exc:
            if exc.status < 400:
                raise
            return web.json_response({"error": {"message": exc.reason, "type": exc.reason, "param": None, "code": exc.status}}, status=exc.status)
        except (ValueError, TypeError) as exc:
            return web.json_response(ApiError(400, str(exc)).body(), status=400)
        except NotImplementedError as exc:
            return web.json_response(ApiError(501, str(exc), "NotImplementedError").body(), status=501)
        except Exception as exc:  # a bug of ours: answer 500 in the usual shape and keep serving
            logger.exception("error while serving %s %s", request.method, request.path)
            return web.json_response(ApiError(500, f"{type(exc).__name__}: {exc}", "InternalServerError").body(), status=500)

    @web.middleware
    async def _auth(self, request: web.Request, handler):
        if self.args.api_key and request.path.startswith(AUTH_PREFIXES):
            if request.headers.get("Authorization") != f"Bearer {self.args.api_key}":
                return web.json_response({"error": "Unauthorized"}, status=401)
        return await handler(request)

    async def _body(self, request: web.Request, model: type[BaseModel]):
        if request.content_type != "application/json":
            raise ApiError(400, "Unsupported Media Type: Only 'application/json' is allowed", "Bad Request")
        try:
            body = json.loads(await request.read())
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ApiError(400, f"1 validation error:\n  body: JSON decode error: {exc.msg if hasattr(exc, 'msg') else exc}", "Bad Request") from None
        return parse(model, body)

    # ---- generation --------------------------------------------------------------------------
    def _adapter_for(self, model: str | None) -> tuple[str, str | None]:
        """(name to echo, adapter or None) for a request's `model` field; 404 for an unknown name."""
        if model is None or model in self.names:
            return model or self.names[0], None
        if self.adapters and model in self.adapters.paths:
            return model, model
        valid = ", ".join(self.names + (list(self.adapters.paths) if self.adapters else []))
        raise ApiError(404, f"The model `{model}` does not exist. Valid aliases: {valid}.", "NotFoundError", "model")

    def _check_accepting(self) -> None:
        if not self.engine.alive:
            raise ApiError(500, "The generation engine has stopped: see the server log.", "InternalServerError")
        if self.pause_mode in ("abort", "wait"):
            raise ApiError(503, PAUSED_MESSAGE, "ServiceUnavailableError")

    def _check_prompt(self, ids: list[int]) -> None:
        bad = next((t for t in ids if t >= self.vocab_size), None)
        if bad is not None:
            raise bad_request(f"Token id {bad} is out of vocabulary", "prompt", bad)
        if not ids:
            raise bad_request("The prompt is empty: send at least one token.", "prompt", ids)
        if len(ids) > self.max_model_len:
            raise bad_request(
                f"This model's maximum context length is {self.max_model_len} tokens. However, your prompt contains "
                f"{len(ids)} input tokens, which exceeds this limit even without any output tokens. Please reduce the "
                "length of the input prompt.", "prompt", len(ids))

    def _max_tokens(self, requested: int | None, prompt_len: int, default: int | None) -> int:
        """vLLM 0.32+: min(max_tokens, max_model_len - prompt_len, generation_config max_new_tokens)."""
        if requested is not None and requested < 1:
            raise bad_request(f"max_tokens must be at least 1, got {requested}.", "max_tokens", requested)
        caps = [self.max_model_len - prompt_len, requested if requested is not None else default, self.defaults.get("max_tokens")]
        value = min(c for c in caps if c is not None)
        if value < 1:
            raise bad_request(f"max_tokens must be at least 1, got {value}.", "max_tokens", value)
        return value

    def _seed(self, seed: int | None) -> int | None:
        return seed if seed is not None or self.seed_rng is None else self.seed_rng.getrandbits(62)

    def _check_sampling_mask_request(self, params) -> None:
        if not self.args.return_sampling_mask:
            return
        if params.temperature <= 0:
            raise bad_request("sampling distribution replay requires temperature > 0", "temperature", params.temperature)
        if params.top_k <= 0:
            raise bad_request("sampling distribution replay requires top_k > 0", "top_k", params.top_k)

    def _stop_check(self, stops: list[str], skip_special: bool):
        if not stops:
            return None

        def check(output: list[int]) -> str | None:
            decoded = self.text.decode(output, skip_special)
            return next((s for s in stops if s in decoded), None)

        return check

    async def _run(self, requests: list[EngineRequest]) -> None:
        """Submit and wait; a cancelled handler (client gone) aborts its requests and frees their slots."""
        loop = asyncio.get_running_loop()
        futures = [loop.create_future() for _ in requests]

        def notifier(request, future):
            def notify():
                if request.finished:
                    loop.call_soon_threadsafe(lambda: future.done() or future.set_result(None))
            return notify

        for request, future in zip(requests, futures):
            request.notify = notifier(request, future)
            self.engine.submit(request)
        try:
            await asyncio.gather(*futures)
        finally:
            for request in requests:
                if not request.finished:
                    self.engine.abort(request)
        if any(s.finish_reason == "error" for r in requests for s in r.sequences):
            reason = next((r.error for r in requests if r.error), None)
            raise ApiError(500, reason or "The generation engine failed while serving this request: see the server log.",
                           "InternalServerError")

    def _engine_request(self, ids, fields: dict, *, n, adapter, max_tokens, default_max, logprobs, prompt_logprobs,
                        stops, skip_special, sampling_mask=False) -> EngineRequest:
        self._check_prompt(ids)
        params = protocol.sampling_params(
            {**fields, "seed": self._seed(fields.get("seed"))}, self.defaults,
            max_tokens=self._max_tokens(max_tokens, len(ids), default_max), max_logprobs=self.args.max_logprobs,
            vocab_size=self.vocab_size, logprobs=logprobs, prompt_logprobs=prompt_logprobs,
            stop_token_ids=fields.get("stop_token_ids") or [],
        )
        protocol.check_n(n, params)
        if n > self.args.max_num_seqs:
            raise bad_request(f"n must be at most max_num_seqs={self.args.max_num_seqs}, got {n}.", "n", n)
        self._check_sampling_mask_request(params)
        return EngineRequest(
            prompt=list(ids), params=params, n=n, adapter=adapter, return_sampling_mask=sampling_mask,
            stop_check=self._stop_check(stops, skip_special),
        )

    def _prompts(self, prompt) -> list[list[int]]:
        if isinstance(prompt, str):
            return [self.tokenizer.encode(prompt)]
        if prompt and isinstance(prompt[0], str):
            return [self.tokenizer.encode(p) for p in prompt]
        if prompt and isinstance(prompt[0], list):
            return prompt
        return [prompt]

    def _request_id(self, request: web.Request, body_id: str | None) -> str:
        return request.headers.get("X-Request-Id") or body_id or uuid.uuid4().hex

    async def completions(self, request: web.Request) -> web.Response:
        req = await self._body(request, protocol.CompletionRequest)
        name, adapter = self._adapter_for(req.model)
        self._check_accepting()
        if req.stream:
            raise ApiError(400, "stream=true is not supported by tandem serve; send stream=false.", "BadRequestError", "stream")
        if req.stream_options is not None:
            raise bad_request("Stream options can only be defined when `stream=True`.", "stream_options", req.stream_options)
        stops = protocol.stop_strings(req.stop)
        skip_special = req.skip_special_tokens if req.skip_special_tokens is not None else True
        fields = req.model_dump()
        engine_requests = [
            self._engine_request(ids, fields, n=req.n, adapter=adapter, max_tokens=req.max_tokens, default_max=16,
                                 logprobs=req.logprobs, prompt_logprobs=req.prompt_logprobs, stops=stops, skip_special=skip_special)
            for ids in self._prompts(req.prompt)
        ]
        await self._run(engine_requests)
        as_ids = bool(req.return_tokens_as_token_ids)

        def choice(r: EngineRequest, s) -> dict:
            text = output_text = responses.output_text(s, self.text, include_stop=req.include_stop_str_in_output, skip_special=skip_special)
            if req.echo:
                text = self.text.decode(r.prompt, skip_special) + output_text
            return {
                "index": 0, "text": text,
                "logprobs": None if req.logprobs is None else responses.completion_logprobs(s, req.logprobs, self.text, as_ids),
                "finish_reason": s.finish_reason, "stop_reason": s.stop_reason,
                "token_ids": list(s.output) if req.return_token_ids else None,
                "prompt_logprobs": responses.prompt_logprobs_json(r, self.text),
                "prompt_token_ids": list(r.prompt) if req.return_token_ids else None,
                "routed_experts": None, "weight_versions": None,
            }

        request_id = f"cmpl-{self._request_id(request, req.request_id)}"
        return web.json_response(responses.completion_body(request_id, name, self.fingerprint, engine_requests, choice))

    def _render_chat(self, messages, tools, add_generation_prompt, continue_final_message, chat_template, kwargs) -> list[int]:
        try:
            ids = self.tokenizer.apply_chat_template(
                messages, tools=tools, add_generation_prompt=add_generation_prompt and not continue_final_message,
                continue_final_message=continue_final_message, chat_template=chat_template,
                tokenize=True, return_dict=False, **(kwargs or {}),
            )
        except Exception as exc:  # template errors are the caller's input
            raise bad_request(f"The chat template could not render these messages: {exc}", "messages", None) from None
        return list(ids)

    async def chat(self, request: web.Request) -> web.Response:
        req = await self._body(request, protocol.ChatCompletionRequest)
        name, adapter = self._adapter_for(req.model)
        self._check_accepting()
        if req.stream:
            raise ApiError(400, "stream=true is not supported by tandem serve; send stream=false.", "BadRequestError", "stream")
        if req.top_logprobs and not req.logprobs:
            raise bad_request("when using `top_logprobs`, `logprobs` must be set to true.", "top_logprobs", req.top_logprobs)
        ids = self._render_chat(req.messages, req.tools, req.add_generation_prompt, req.continue_final_message,
                                req.chat_template, req.chat_template_kwargs)
        stops = protocol.stop_strings(req.stop)
        skip_special = req.skip_special_tokens if req.skip_special_tokens is not None else True
        top = req.top_logprobs or 0
        engine_request = self._engine_request(
            ids, req.model_dump(), n=req.n, adapter=adapter, max_tokens=req.max_completion_tokens or req.max_tokens,
            default_max=None, logprobs=(top if top >= 0 else -1) if req.logprobs else None,
            prompt_logprobs=req.prompt_logprobs, stops=stops, skip_special=skip_special,
        )
        await self._run([engine_request])
        as_ids = bool(req.return_tokens_as_token_ids)
        choices = [
            {
                "index": i,
                "message": {
                    "role": "assistant", "content": responses.output_text(s, self.text, include_stop=req.include_stop_str_in_output, skip_special=skip_special),
                    "refusal": None, "annotations": None, "audio": None, "function_call": None, "reasoning": None,
                },
                "logprobs": responses.chat_logprobs(s, top, self.text, as_ids) if req.logprobs else None,
                "finish_reason": s.finish_reason, "stop_reason": s.stop_reason,
                "token_ids": list(s.output) if req.return_token_ids else None,
                "routed_experts": None, "weight_versions": None,
            }
            for i, s in enumerate(engine_request.sequences)
        ]
        return web.json_response({
            "id": f"chatcmpl-{self._request_id(request, req.request_id)}", "object": "chat.completion",
            "created": int(time.time()), "model": name, "choices": choices, "service_tier": None,
            "system_fingerprint": self.fingerprint, "usage": responses.usage([engine_request]),
            "prompt_logprobs": responses.prompt_logprobs_json(engine_request, self.text),
            "prompt_token_ids": ids if req.return_token_ids else None, "prompt_text": None,
            "kv_transfer_params": None, "ec_transfer_params": None, "metrics": None,
        })

    async def generate(self, request: web.Request) -> web.Response:
        if not self.args.enable_scale_out:
            raise ApiError(403, "Scale-out endpoints are disabled. Restart vllm serve with --enable-scale-out to enable them.", "PermissionDeniedError")
        req = await self._body(request, protocol.GenerateRequest)
        name, adapter = self._adapter_for(req.model)
        self._check_accepting()
        if req.stream:
            raise ApiError(400, "stream=true is not supported by tandem serve; send stream=false.", "BadRequestError", "stream")
        sp = req.sampling_params
        if not isinstance(sp.get("n", 1), int):
            raise bad_request(f"n must be an integer, got {sp.get('n')!r}.", "n", sp.get("n"))
        stops = protocol.stop_strings(sp.get("stop"))
        skip_special = sp.get("skip_special_tokens", True)
        engine_request = self._engine_request(
            req.token_ids, sp, n=sp.get("n", 1), adapter=adapter,
            max_tokens=sp.get("max_tokens"), default_max=None, logprobs=sp.get("logprobs"),
            prompt_logprobs=sp.get("prompt_logprobs"), stops=stops, skip_special=skip_special,
            sampling_mask=self.args.return_sampling_mask,
        )
        await self._run([engine_request])
        choices = [
            {
                "index": i, "finish_reason": s.finish_reason, "stop_reason": s.stop_reason, "token_ids": list(s.output),
                "routed_experts": None, "sampling_mask": s.sampling_masks if self.args.return_sampling_mask else None,
                "weight_versions": None, "logprobs": responses.generate_logprobs(s) if sp.get("logprobs") is not None else None,
                **({"text": responses.output_text(s, self.text, include_stop=False, skip_special=skip_special)} if req.output_mode == "text" else {}),
            }
            for i, s in enumerate(engine_request.sequences)
        ]
        return web.json_response({
            "request_id": f"generate-tokens-{self._request_id(request, req.request_id)}", "model": name,
            "created": int(time.time()), "usage": responses.usage([engine_request]),
            "prompt_logprobs": responses.prompt_logprobs_json(engine_request, self.text), "prompt_token_id_logprobs": None,
            "prompt_token_ids": list(req.token_ids), "mm_placeholders": None, "metrics": None,
            "kv_transfer_params": None, "ec_transfer_params": None, "output_mode": req.output_mode, "choices": choices,
        })

    # ---- tokenizer -----------------------------------------------------------------------------
    async def tokenize(self, request: web.Request) -> web.Response:
        req = await self._body(request, protocol.TokenizeRequest)
        self._adapter_for(req.model)
        if req.messages is not None:
            ids = self._render_chat(req.messages, req.tools, req.add_generation_prompt, req.continue_final_message,
                                    req.chat_template, req.chat_template_kwargs)
        elif req.prompt is not None:
            add_special = req.add_special_tokens if req.add_special_tokens is not None else True
            ids = self.tokenizer.encode(req.prompt, add_special_tokens=add_special)
        else:
            raise bad_request("Either `prompt` or `messages` must be provided.", "prompt", None)
        return web.json_response({
            "count": len(ids), "max_model_len": self.max_model_len, "tokens": ids,
            "token_strs": self.tokenizer.convert_ids_to_tokens(ids) if req.return_token_strs else None,
        })

    async def detokenize(self, request: web.Request) -> web.Response:
        req = await self._body(request, protocol.DetokenizeRequest)
        self._adapter_for(req.model)
        bad = next((t for t in req.tokens if t >= self.vocab_size), None)
        if bad is not None:
            raise bad_request(f"Token id {bad} is out of vocabulary", "tokens", bad)
        return web.json_response({"prompt": self.tokenizer.decode(req.tokens)})

    # ---- info ----------------------------------------------------------------------------------
    async def health(self, _: web.Request) -> web.Response:
        return web.Response(status=200 if self.engine.alive else 503)

    async def version(self, _: web.Request) -> web.Response:
        from tandem import __version__

        return web.json_response({"version": VLLM_PROTOCOL_VERSION, "tandem_version": __version__})

    def _model_card(self, name: str, root: str, parent: str | None, max_len: int | None) -> dict:
        permission = {
            "id": f"modelperm-{uuid.uuid4().hex}", "object": "model_permission", "created": self.started,
            "allow_create_engine": False, "allow_sampling": True, "allow_logprobs": True, "allow_search_indices": False,
            "allow_view": True, "allow_fine_tuning": False, "organization": "*", "group": None, "is_blocking": False,
        }
        return {"id": name, "object": "model", "created": self.started, "owned_by": "vllm", "root": root,
                "parent": parent, "max_model_len": max_len, "permission": [permission]}

    async def models(self, _: web.Request) -> web.Response:
        cards = [self._model_card(n, self.args.model, None, self.max_model_len) for n in self.names]
        for lora, path in (self.adapters.paths.items() if self.adapters else []):
            cards.append(self._model_card(lora, path, self.names[0], None))
        return web.json_response({"object": "list", "data": cards})

    def config(self) -> dict:
        stats = self.engine.stats()
        lora = None
        if self.adapters:
            lora = {"max_lora_rank": self.adapters.max_lora_rank, "max_loras": self.adapters.max_loras, "max_cpu_loras": self.adapters.max_cpu_loras}
        return {
            "model_config": {
                "model": self.args.model, "served_model_name": self.names[0], "dtype": self.dtype,
                "max_model_len": self.max_model_len, "max_logprobs": self.args.max_logprobs,
                "logprobs_mode": self.args.logprobs_mode, "return_sampling_mask": self.args.return_sampling_mask,
                "generation_config": self.args.generation_config, "seed": self.args.seed,
                "decode_mode": "exact" if self.engine.exact else "fast",
            },
            "cache_config": {"block_size": 16, "num_gpu_blocks": stats.kv_capacity_tokens // 16, "kv_cache_size_tokens": stats.kv_capacity_tokens},
            "scheduler_config": {"max_num_seqs": self.args.max_num_seqs},
            "parallel_config": {"data_parallel_size": 1, "tensor_parallel_size": 1, "pipeline_parallel_size": 1},
            "lora_config": lora,
            "device_config": {"device": str(self.engine.device)},
        }

    async def server_info(self, request: web.Request) -> web.Response:
        fmt = request.query.get("config_format", "text")
        if fmt not in ("text", "json"):
            raise bad_request(f"config_format must be 'text' or 'json', got {fmt!r}.", "config_format", fmt)
        config = self.config()
        return web.json_response({"vllm_config": config if fmt == "json" else str(config), "vllm_env": {}, "system_env": {"server": "tandem serve"}})

    async def world_size(self, _: web.Request) -> web.Response:
        return web.json_response({"world_size": 1})

    async def weight_info(self, _: web.Request) -> web.Response:
        return web.json_response({"weight_version": "default"})

    async def weight_transfer(self, _: web.Request) -> web.Response:
        raise ApiError(500, "Weight transfer not configured. Please set weight_transfer_config to enable weight transfer. "
                            "tandem serve has no NCCL weight transfer: reload weights with /collective_rpc reload_weights.",
                       "InternalServerError")

    async def metrics(self, _: web.Request) -> web.Response:
        return web.Response(body=prometheus_text(self.engine.stats(), self.names[0]).encode(),
                            headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"})

    # ---- dev routes ------------------------------------------------------------------------------
    async def pause(self, request: web.Request) -> web.Response:
        mode = request.query.get("mode", "abort")
        if mode not in ("abort", "wait", "keep"):
            return web.json_response({"error": f"Invalid pause mode {mode!r}: use abort, wait or keep."}, status=400)
        self.pause_mode = mode
        if mode == "abort":
            self.engine.abort_all()
        if mode in ("abort", "wait"):  # in-flight requests end (abort) or drain (wait) before we report paused
            while not self.engine.idle():
                await asyncio.sleep(0.01)
        self.engine.set_paused(True)
        return web.json_response({"status": "paused"})

    async def resume(self, _: web.Request) -> web.Response:
        self.pause_mode = None
        self.engine.set_paused(False)
        return web.json_response({"status": "resumed"})

    async def is_paused(self, _: web.Request) -> web.Response:
        return web.json_response({"is_paused": self.pause_mode is not None})

    async def reset_prefix_cache(self, _: web.Request) -> web.Response:
        # tandem serve keeps no prefix cache across requests, so there is nothing stale to drop.
        return web.json_response({"success": True})

    async def collective_rpc(self, request: web.Request) -> web.Response:
        try:
            body = json.loads(await request.read() or b"{}")
        except json.JSONDecodeError as exc:
            raise ApiError(400, f"1 validation error:\n  body: JSON decode error: {exc.msg}", "Bad Request") from None
        req = parse(protocol.CollectiveRpcRequest, body)
        if not req.method:
            raise ApiError(400, "Missing 'method' in request body")
        if req.method != "reload_weights":
            raise bad_request(f"Unknown collective_rpc method {req.method!r}: tandem serve implements reload_weights.", "method", req.method)
        path = req.kwargs.get("weights_path") or (req.args[0] if req.args else None)
        if not isinstance(path, str):
            raise bad_request("reload_weights needs kwargs.weights_path: a directory of safetensors files.", "weights_path", path)
        if not Path(path).is_dir():
            raise bad_request(f"reload_weights: weights_path {path} is not a directory.", "weights_path", path)
        await asyncio.wrap_future(self.engine.call(lambda: load_weights(self.engine.model, path)))
        return web.Response(status=200)

    # ---- LoRA ------------------------------------------------------------------------------------
    async def load_lora(self, request: web.Request) -> web.Response:
        req = await self._body(request, protocol.LoadLoRARequest)
        if not req.lora_name or not req.lora_path:
            raise ApiError(400, "Both 'lora_name' and 'lora_path' must be provided.", "InvalidUserInput")
        if req.lora_name in self.names:
            raise ApiError(400, f"The lora adapter '{req.lora_name}' conflicts with a served base model.", "InvalidUserInput")
        if self.adapters is None:
            raise ApiError(500, "Call to add_lora method failed: LoRA is not enabled. Use --enable-lora to enable LoRA.", "InternalServerError")
        if req.lora_name in self.adapters.paths and not req.load_inplace:
            raise ApiError(400, f"The lora adapter '{req.lora_name}' has already been loaded. If you want to load the "
                                "adapter in place, set 'load_inplace' to True.", "InvalidUserInput")
        try:
            self.adapters.check(req.lora_name, req.lora_path)
        except AdapterNotFound as exc:
            raise ApiError(404, str(exc), "NotFoundError") from None
        except ValueError as exc:
            raise ApiError(500, f"Call to add_lora method failed: {exc}", "InternalServerError") from None

        def register_and_load():
            self.adapters.register(req.lora_name, req.lora_path)
            in_use = {r.adapter for r, _ in self.engine.rows if r.adapter}
            self.engine.model = self.adapters.ensure_loaded(self.engine.model, {req.lora_name}, in_use)

        try:
            await asyncio.wrap_future(self.engine.call(register_and_load))
        except Exception as exc:
            self.adapters.paths.pop(req.lora_name, None)
            raise ApiError(500, f"Call to add_lora method failed: {exc}", "InternalServerError") from None
        return web.Response(text=f"Success: LoRA adapter '{req.lora_name}' added successfully.")

    async def unload_lora(self, request: web.Request) -> web.Response:
        req = await self._body(request, protocol.UnloadLoRARequest)
        if not req.lora_name:
            raise ApiError(400, "'lora_name' needs to be provided to unload a LoRA adapter.", "InvalidUserInput")
        if self.adapters is None or req.lora_name not in self.adapters.paths:
            raise ApiError(404, f"The lora adapter '{req.lora_name}' cannot be found.", "NotFoundError")
        self.adapters.unregister(req.lora_name)
        return web.Response(text=f"Success: LoRA adapter '{req.lora_name}' removed successfully.")


def prometheus_text(stats, model_name: str) -> str:
    """The `/metrics` exposition with vLLM's names and labels (reference/vllm_protocol.md §9)."""
    labels = f'engine="0",model_name="{model_name}"'
    lines = []

    def metric(name: str, kind: str, help_text: str, samples: list[tuple[str, float]]) -> None:
        lines.extend([f"# HELP {name} {help_text}", f"# TYPE {name} {kind}"])
        lines.extend(f"{name}{{{extra}{labels}}} {float(value)}" for extra, value in samples)

    usage = stats.kv_used_tokens / stats.kv_capacity_tokens if stats.kv_capacity_tokens else 0.0
    metric("vllm:kv_cache_usage_perc", "gauge", "KV-cache usage. 1 means 100 percent usage.", [("", usage)])
    metric("vllm:num_requests_running", "gauge", "Number of requests in model execution batches.", [("", stats.running)])
    metric("vllm:num_requests_waiting", "gauge", "Number of requests waiting to be processed.", [("", stats.waiting)])
    metric("vllm:num_preemptions_total", "counter", "Cumulative number of preemption from the engine.", [("", stats.preemptions_total)])
    metric("vllm:prompt_tokens_total", "counter", "Number of prefill tokens processed.", [("", stats.prompt_tokens_total)])
    metric("vllm:generation_tokens_total", "counter", "Number of generation tokens processed.", [("", stats.generation_tokens_total)])
    metric("vllm:request_success_total", "counter", "Count of successfully processed requests.",
           [(f'finished_reason="{reason}",', count) for reason, count in sorted(stats.finished_total.items())])
    blocks = stats.kv_capacity_tokens // 16
    info = f'block_size="16",enable_prefix_caching="False",kv_cache_size_tokens="{stats.kv_capacity_tokens}",num_gpu_blocks="{blocks}",'
    metric("vllm:cache_config_info", "gauge", "Information of the LLMEngine CacheConfig", [(info, 1)])
    return "\n".join(lines) + "\n"


async def start_server(args: ServeArgs) -> tuple[web.AppRunner, int]:
    """Start serving in the running event loop; returns the runner and the bound port (for --port 0)."""
    server = Server(args)
    runner = web.AppRunner(server.app(), handler_cancellation=True, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, args.host, args.port)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    return runner, port

