"""The control routes of `tandem serve`: pause and resume, weight reloads, weight transfers and runtime LoRA adapters.

These are vLLM's dev routes (`/pause`, `/collective_rpc`, ...) and its LoRA routes; the trainer drives them
around each weight sync. Anything that changes the model runs on the engine thread between two steps, and
drops the prefix cache there: KV computed with other weights is never reused.
"""

import asyncio
import logging
from pathlib import Path

import torch
from aiohttp import web
from aiohttp.typedefs import Handler
from safetensors import safe_open

from tandem.httpapp import BadQuery, Pause
from tandem.kernels.openmp import in_passing_thread
from tandem.serve import fields, protocol
from tandem.serve.engine import Engine
from tandem.serve.lora import AdapterLoaded, AdapterNotFound, AdapterSet, served_parameters
from tandem.serve.protocol import ApiError, bad_request
from tandem.serve.weight_receiver import Receiver, TransferError

logger = logging.getLogger("tandem.serve")
WEIGHT_TRANSFER_PATHS = (
    "/init_weight_transfer_engine",
    "/start_weight_update",
    "/update_weights",
    "/finish_weight_update",
)


class WeightsError(ValueError):
    """A checkpoint folder that does not fit the served model."""


def load_weights(model: torch.nn.Module, weights_path: str) -> int:
    """Copy a safetensors checkpoint (HF parameter names) into `model` in place; returns tensors loaded. Every file,
    name and shape is checked from the files' headers before the first tensor is copied, so a checkpoint that does
    not fit leaves the served weights as they were."""
    files = sorted(Path(weights_path).glob("*.safetensors"))
    if not files:
        raise WeightsError(f"reload_weights: no *.safetensors files in {weights_path}")
    params = served_parameters(model)
    for file in files:
        for name, shape in checkpoint_shapes(file).items():
            if name not in params:
                raise WeightsError(f"reload_weights: {name!r} in {file.name} is not a parameter of the served model")
            if tuple(params[name].shape) != shape:
                raise WeightsError(
                    f"reload_weights: {name!r} has shape {shape}, the model expects {tuple(params[name].shape)}"
                )
    loaded = 0
    with torch.no_grad():
        for file in files:
            with safe_open(str(file), framework="pt") as f:
                for name in f.keys():
                    params[name].copy_(f.get_tensor(name))
                    loaded += 1
    return loaded


def checkpoint_shapes(file: Path) -> dict[str, tuple[int, ...]]:
    """A safetensors file's tensor names and shapes, read from its header (opening it checks that the file holds all
    the bytes the header promises)."""
    try:
        with safe_open(str(file), framework="pt") as f:
            return {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()}
    except Exception as exc:  # noqa: BLE001 - safetensors' own errors: not a file of its format, or cut short
        raise WeightsError(f"reload_weights: {file.name} is not a readable safetensors file ({exc})") from None


class Control:
    """Pause state, weight reloads, weight transfers and adapter registration over one engine."""

    def __init__(self, engine: Engine, adapters: AdapterSet | None, names: list[str], receiver: Receiver | None = None):
        self.engine, self.adapters, self.names, self.receiver = engine, adapters, names, receiver
        self.pause_mode: str | None = None
        """None while serving; 'abort' and 'wait' refuse new requests, 'keep' freezes the running ones."""

    def routes(self) -> list[tuple[str, str, Handler]]:
        routes: list[tuple[str, str, Handler]] = [
            ("POST", "/pause", self.pause),
            ("POST", "/resume", self.resume),
            ("GET", "/is_paused", self.is_paused),
            ("POST", "/reset_prefix_cache", self.reset_prefix_cache),
            ("POST", "/collective_rpc", self.collective_rpc),
            ("GET", "/weight_info", self.weight_info),
            ("POST", "/v1/load_lora_adapter", self.load_lora),
            ("POST", "/v1/unload_lora_adapter", self.unload_lora),
        ]
        return routes + [("POST", path, self.weight_transfer) for path in WEIGHT_TRANSFER_PATHS]

    # ---- pause -----------------------------------------------------------------------------------
    async def pause(self, request: web.Request) -> web.Response:
        try:
            pause = Pause.from_query(request.query)
        except BadQuery as exc:
            raise bad_request(str(exc), exc.param, exc.value) from None
        self.pause_mode = pause.mode
        if pause.mode == "abort":
            self.engine.abort_all()
        if pause.drains:  # in-flight requests end (abort) or finish (wait) before we report paused
            while not self.engine.idle():
                await asyncio.sleep(0.01)
        if pause.drops_prefix_cache:
            await asyncio.wrap_future(self.engine.call(self.engine.reset_prefix_cache))
        self.engine.set_paused(True)
        return web.json_response({"status": "paused"})

    async def resume(self, _: web.Request) -> web.Response:
        self.pause_mode = None
        self.engine.set_paused(False)
        return web.json_response({"status": "resumed"})

    async def is_paused(self, _: web.Request) -> web.Response:
        return web.json_response({"is_paused": self.pause_mode is not None})

    async def reset_prefix_cache(self, _: web.Request) -> web.Response:
        """Always succeeds: running sequences hold their own copies of the KV they use."""
        await asyncio.wrap_future(self.engine.call(self.engine.reset_prefix_cache))
        return web.json_response({"success": True})

    # ---- weights ---------------------------------------------------------------------------------
    async def collective_rpc(self, request: web.Request) -> web.Response:
        req = await protocol.read(request, protocol.CollectiveRpcRequest, json_only=False)
        if not req.method:
            raise ApiError(400, "Missing 'method' in request body")
        if req.method != "reload_weights":
            raise bad_request(
                f"Unknown collective_rpc method {req.method!r}: tandem serve implements reload_weights.",
                "method",
                req.method,
            )
        path = req.kwargs.get("weights_path") or (req.args[0] if req.args else None)
        if not isinstance(path, str):
            raise bad_request(
                "reload_weights needs kwargs.weights_path: a directory of safetensors files.", "weights_path", path
            )
        if not Path(path).is_dir():
            raise bad_request(f"reload_weights: weights_path {path} is not a directory.", "weights_path", path)

        def reload():
            try:
                load_weights(self.engine.model, path)
            finally:  # a refused checkpoint changed nothing; a disk failing mid-copy did
                self.engine.weights_changed()

        try:
            await asyncio.wrap_future(self.engine.call(reload))
        except WeightsError as exc:
            raise bad_request(str(exc), "weights_path", path) from None
        return web.Response(status=200)

    async def weight_info(self, _: web.Request) -> web.Response:
        return web.json_response({"weight_version": self.engine.weight_version})

    async def weight_transfer(self, request: web.Request) -> web.Response:
        """The four routes of vLLM's weight-transfer API (`--weight-transfer-config`) over the gloo group of
        serve/weight_receiver.py. Joining and receiving block, so they run on a thread; the swap runs on the
        engine thread between two steps and drops the prefix cache."""
        if self.receiver is None:
            raise ApiError(
                500,
                "Weight transfer not configured. Please set weight_transfer_config to enable weight "
                'transfer (tandem serve: --weight-transfer-config \'{"backend": "gloo"}\').',
                "InternalServerError",
            )
        body = await protocol.read(request, protocol.WeightTransferRequest, json_only=False)
        try:
            return await self._transfer_step(self.receiver, request.path, body)
        except TransferError as exc:
            raise ApiError(400, str(exc), "BadRequestError") from None
        except RuntimeError as exc:  # the group failed: a peer died or a collective timed out
            logger.exception("weight transfer %s failed", request.path)
            raise ApiError(500, f"weight transfer failed: {exc}", "InternalServerError") from None

    async def _transfer_step(self, receiver: Receiver, path: str, body: protocol.WeightTransferRequest) -> web.Response:
        if path == "/init_weight_transfer_engine":
            if body.init_info is None:
                raise TransferError("Missing 'init_info' in request body")
            await asyncio.to_thread(receiver.init, body.init_info)
            return web.json_response({"message": "Weight transfer initialized"})
        if path == "/start_weight_update":
            receiver.start()
            return web.json_response({"message": "Weight update started"})
        if path == "/update_weights":
            info = body.update_info
            if isinstance(info, list):  # one entry per worker: this server has one, the entry of its rank
                info = info[0] if len(info) == 1 else None
            if not isinstance(info, dict):
                raise TransferError("Missing 'update_info' in request body (an object, or a list with one per worker)")
            # a thread that ends with the update: its copies' OpenMP team must not outlive it (tandem.kernels.openmp)
            await asyncio.to_thread(in_passing_thread, receiver.receive, info, served_parameters(self.engine.model))
            return web.json_response({"message": "Weights updated"})
        staged = receiver.finish(discard=body.discard)  # "discard": tandem proxy's, see Receiver.finish

        def swap():
            params = served_parameters(self.engine.model)
            try:
                with torch.no_grad():
                    for name, tensor in staged.items():
                        params[name].copy_(tensor)
            finally:
                if staged:
                    self.engine.weights_changed()
            if body.weight_version is not None:  # the label changes with the weights, between the same two steps
                self.engine.weight_version = body.weight_version

        if staged or body.weight_version is not None:
            await asyncio.wrap_future(self.engine.call(swap))
        return web.json_response({"message": "Weight update finished"})

    # ---- LoRA ------------------------------------------------------------------------------------
    async def load_lora(self, request: web.Request) -> web.Response:
        """Check, load and register an adapter on the engine thread. A refused or failed load changes nothing: vLLM's
        404 for a folder without adapter_config.json, its 500 "Call to add_lora method failed: ..." otherwise."""
        req = await protocol.read(request, protocol.LoadLoRARequest)
        protocol.refuse(req.model_dump(), fields.ROUTES["/v1/load_lora_adapter"])
        self.check_loadable(req)

        def add():
            in_use = {r.adapter for r, _ in self.engine.rows if r.adapter}
            self.engine.model = self.adapters.add(
                self.engine.model, req.lora_name, req.lora_path, in_use, replace=req.load_inplace
            )
            self.engine.reset_prefix_cache()

        try:
            await asyncio.wrap_future(self.engine.call(add))
        except AdapterLoaded as exc:  # checked on the engine thread: two loads of one name cannot both pass
            raise ApiError(400, str(exc), "InvalidUserInput") from None
        except AdapterNotFound as exc:
            raise ApiError(404, f"Loading lora {req.lora_name} failed: {exc}", "NotFoundError") from None
        except Exception as exc:  # noqa: BLE001 - vLLM answers any load failure 500 and keeps serving
            logger.warning("loading LoRA adapter %r from %s failed: %s", req.lora_name, req.lora_path, exc)
            raise ApiError(500, f"Call to add_lora method failed: {exc}", "InternalServerError") from None
        return web.Response(text=f"Success: LoRA adapter '{req.lora_name}' added successfully.")

    def check_loadable(self, req: protocol.LoadLoRARequest) -> None:
        """vLLM's refusals before it looks at the adapter's files."""
        if not req.lora_name or not req.lora_path:
            raise ApiError(400, "Both 'lora_name' and 'lora_path' must be provided.", "InvalidUserInput")
        if req.lora_name in self.names:
            raise ApiError(
                400, f"The lora adapter '{req.lora_name}' conflicts with a served base model.", "InvalidUserInput"
            )
        if self.adapters is None:
            raise ApiError(
                500,
                "Call to add_lora method failed: LoRA is not enabled. Use --enable-lora to enable LoRA.",
                "InternalServerError",
            )

    async def unload_lora(self, request: web.Request) -> web.Response:
        req = await protocol.read(request, protocol.UnloadLoRARequest)
        if not req.lora_name:
            raise ApiError(400, "'lora_name' needs to be provided to unload a LoRA adapter.", "InvalidUserInput")
        if self.adapters is None:
            raise ApiError(404, f"The lora adapter '{req.lora_name}' cannot be found.", "NotFoundError")
        adapters = self.adapters

        def remove() -> bool:  # on the engine thread, as every change of what is served
            if req.lora_name not in adapters.paths:
                return False
            adapters.unregister(req.lora_name)
            self.engine.reset_prefix_cache()
            return True

        if not await asyncio.wrap_future(self.engine.call(remove)):
            raise ApiError(404, f"The lora adapter '{req.lora_name}' cannot be found.", "NotFoundError")
        return web.Response(text=f"Success: LoRA adapter '{req.lora_name}' removed successfully.")
