"""The routes of `tandem serve` that describe what it serves and how it is doing: `/health` (and `/ping`), `/version`,
`/v1/models`, `/server_info` (the configuration the trainer reads at connect), `/metrics`, `/load`, `/tokenizer_info`
and `/get_world_size`; and the count of generation requests in flight behind `/load`."""

import json
import time
import uuid

from aiohttp import web
from aiohttp.typedefs import Handler

from tandem import __version__
from tandem.serve.engine import Engine
from tandem.serve.lora import AdapterSet
from tandem.serve.prefix_cache import BLOCK_SIZE
from tandem.serve.prometheus import prometheus_text
from tandem.serve.protocol import bad_request
from tandem.serve.serve_args import VLLM_PROTOCOL_VERSION, ServeArgs

LOAD_TRACKED = ("/v1/completions", "/v1/chat/completions", "/inference/v1/generate", "/invocations")
"""The generation routes `/load` counts (`--enable-server-load-tracking`)."""


def plain(value):
    """A tokenizer's init kwargs as JSON: added tokens by their text."""
    if hasattr(value, "content"):
        return value.content
    if isinstance(value, dict):
        return {str(k): plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    return value


class Info:
    """What the server says about itself, read from its settings and, at each request, from its engine."""

    def __init__(
        self,
        args: ServeArgs,
        engine: Engine,
        tokenizer,
        names: list[str],
        adapters: AdapterSet | None,
        max_model_len: int,
        dtype: str,
        transfer_config: dict | None,
    ):
        self.args, self.engine, self.tokenizer, self.names, self.adapters = args, engine, tokenizer, names, adapters
        self.max_model_len, self.dtype, self.transfer_config = max_model_len, dtype, transfer_config
        self.started = int(time.time())
        self.in_flight = 0

    def routes(self) -> list[tuple[str, str, Handler]]:
        routes: list[tuple[str, str, Handler]] = [
            ("GET", "/health", self.health),
            ("GET", "/ping", self.health),
            ("POST", "/ping", self.health),
            ("GET", "/version", self.version),
            ("GET", "/v1/models", self.models),
            ("GET", "/server_info", self.server_info),
            ("GET", "/get_world_size", self.world_size),
            ("GET", "/metrics", self.metrics),
            ("GET", "/load", self.load),
        ]
        if self.args.enable_tokenizer_info_endpoint:
            routes.append(("GET", "/tokenizer_info", self.tokenizer_info))
        return routes

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
                "recompute_kv_cache_after_weight_updates": self.args.recompute_kv_cache_after_weight_updates,
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
