"""What a generation server says about itself, read once at connect into one typed object both processes use.

`read_facts` is the one reader of a server's self-description: `/version`, vLLM's `/server_info?config_format=json`
(a development route: `VLLM_SERVER_DEV_MODE=1`) and `/v1/models`. It turns vLLM's nested config and environment into
plain fields, and the engine (tandem serve, or vLLM) into the capabilities the trainer chooses by, so no other module
reads a raw config or asks which engine it talks to. tandem serve answers the same routes in vLLM's shapes and says
so with a `tandem_version` in `/version`; a server behind `tandem proxy` answers through it.

A second engine (SGLang, say) would implement this module's contract: answer `read_facts` from its own routes, with
the same fields and capabilities; the weight sync and the checks would then take it as they take vLLM.
"""

import re
from dataclasses import dataclass

from tandem.generation.client import ServerError, ServerProblem


@dataclass(frozen=True)
class AdapterSlots:
    """A server's room for LoRA adapters (vLLM's --max-loras and --max-lora-rank; None: not said)."""

    max_loras: int | None
    max_lora_rank: int | None


@dataclass(frozen=True)
class ServerFacts:
    engine: str
    """"tandem" (tandem serve, or tandem proxy in front of it) or "vllm"."""
    version: str
    """The engine's version (tandem serve: the vLLM protocol version it speaks)."""
    served_names: tuple[str, ...]
    """The model names it serves (`/v1/models`), first the default."""
    max_model_len: int
    """Its context length: prompt and completion together."""
    dtype: str
    """The dtype it decodes in ("bfloat16"; "" when not said)."""
    device: str
    """"cpu", "cuda", ... ("" when not said)."""
    weight_transfer: str | None
    """The backend of its weight-transfer group ("gloo", "nccl", ...); None: it reloads weights from a folder."""
    adapters: AdapterSlots | None
    """Its LoRA room; None: started without LoRA support."""
    loads_adapters_at_runtime: bool
    """It loads adapters while it runs (vLLM: VLLM_ALLOW_RUNTIME_LORA_UPDATING; assumed when not listed)."""
    data_parallel_size: int
    """Engines behind one API server: a control call (an adapter load) reaches only the one that answers it."""
    returns_sampling_masks: bool
    """It returns each token's kept set under top-k / top-p (vLLM: --return-sampling-mask)."""
    max_num_seqs: int
    """Sequences it decodes at once."""
    chunked_prefill_tokens: int | None
    """With chunked prefill, the most tokens a step prefills (a longer prompt is split over steps); None: never split."""
    recomputes_kv_cache: bool = False
    """It computes the running sequences' keys and values again after a weight update, so each token comes from one
    version's weights: tandem serve started with --recompute-kv-cache-after-weight-updates; vLLM always (0.32
    checked), its pause (mode keep) dropping the running sequences' caches (its `clear_cache`, true by default) and
    computing them again under the new weights when generation resumes."""

    @property
    def streams_weights(self) -> bool:
        """Its weight-transfer backend is one tandem drives (gloo, nccl): weights are streamed to it, each update
        labelled with its version; else they reach it as a folder it reloads."""
        return self.weight_transfer in ("gloo", "nccl")

    @property
    def stages_weights(self) -> bool:
        """A weight stream is staged and swapped in between two engine steps, generation going on meanwhile (tandem
        serve); else the server loads each tensor into the running model, and generation pauses (vLLM's plugin)."""
        return self.engine == "tandem"

    @property
    def labels_token_versions(self) -> bool:
        """Each generated token comes back with the label of the weights that sampled it (`return_weight_versions`).
        vLLM 0.32 labels none: under in_flight_weight_updates its tokens are streamed and labelled by when they arrived,
        else counted under the version their request started on."""
        return self.engine == "tandem"

    @property
    def loads_checkpoint_names(self) -> bool:
        """Streamed weights must carry the checkpoint's names and layouts (vLLM's loader), not the model's."""
        return self.engine == "vllm"

    @property
    def reload_refreshes_tied_head(self) -> bool:
        """A folder reload refreshes an LM head tied to the embedding. vLLM's CPU build keeps a packed copy of the
        first weights instead, so a tied model would drift off the trainer's at every sync."""
        return not (self.engine == "vllm" and self.device == "cpu")

    @property
    def scores_prompts(self) -> bool:
        """It returns a prompt's log-probs. vLLM started with LoRA support does not: its CPU build's engine dies
        scoring a prompt there (its LoRA logits kernel)."""
        return self.engine == "tandem" or self.adapters is None

    @property
    def release(self) -> tuple[int, int] | None:
        """(major, minor) of its version; None when unreadable."""
        return release(self.version)


def release(version: str) -> tuple[int, int] | None:
    """(major, minor) of a version string such as '0.32.0', '0.33.1rc2.dev3+cpu'; None when unreadable."""
    match = re.match(r"(\d+)\.(\d+)", version)
    return (int(match[1]), int(match[2])) if match else None


async def read_facts(control) -> ServerFacts:
    """The facts of the server `control` talks to. A vLLM without its development routes is refused, saying how."""
    try:
        version = await control.version()
        info = await control.server_info()
        models = await control.models()
    except ServerError as exc:
        if exc.status != 404:
            raise
        raise ServerProblem(
            f"{exc}: tandem drives the server through vLLM's development routes (/server_info, /pause, "
            "the weight updates). Start vllm serve with VLLM_SERVER_DEV_MODE=1 in its environment."
        ) from None
    return facts_of(version, info, models)


def facts_of(version: dict, info: dict, models: list[dict]) -> ServerFacts:
    """`read_facts` from the routes' answers: `/version`, `/server_info?config_format=json` and `/v1/models`' data."""
    config = _section(info, "vllm_config")
    env = _section(info, "vllm_env")
    model, scheduler = _section(config, "model_config"), _section(config, "scheduler_config")
    device = config.get("device_config") or {}
    lora = config.get("lora_config")
    transfer = config.get("weight_transfer_config")
    max_model_len = int(models[0].get("max_model_len") or model.get("max_model_len") or 0) if models else 0
    if max_model_len < 1:
        raise ServerProblem(
            "the server says no context length (max_model_len in /v1/models): tandem sizes its rows and turns by it. "
            "Serve the model with --max-model-len, or put a vLLM-protocol server there."
        )
    return ServerFacts(
        engine="tandem" if "tandem_version" in version else "vllm",
        version=str(version.get("version", "")),
        served_names=tuple(m["id"] for m in models),
        max_model_len=max_model_len,
        dtype=str(model.get("dtype", "")).removeprefix("torch."),
        device=str(device.get("device", device.get("device_type", "")) if isinstance(device, dict) else device),
        weight_transfer=transfer.get("backend", "nccl") if isinstance(transfer, dict) else None,
        adapters=AdapterSlots(lora.get("max_loras"), lora.get("max_lora_rank"))
        if isinstance(lora, dict) and lora
        else None,
        loads_adapters_at_runtime=bool(env.get("VLLM_ALLOW_RUNTIME_LORA_UPDATING", True)),
        data_parallel_size=int(_section(config, "parallel_config").get("data_parallel_size", 1) or 1),
        returns_sampling_masks=bool(model.get("return_sampling_mask")),
        max_num_seqs=int(scheduler.get("max_num_seqs") or 0),
        chunked_prefill_tokens=(
            int(scheduler.get("max_num_batched_tokens") or 0) if scheduler.get("enable_chunked_prefill") else None
        ),
        recomputes_kv_cache="tandem_version" not in version
        or bool(_section(config, "cache_config").get("recompute_kv_cache_after_weight_updates")),
    )


def _section(parent: dict, key: str) -> dict:
    """A nested config dict, empty where the server sent none (or not a dict)."""
    value = parent.get(key)
    return value if isinstance(value, dict) else {}
