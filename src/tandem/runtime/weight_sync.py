"""Pushing the policy to the generation server: the `reload` and `lora` strategies.

`reload` writes the whole model in checkpoint format to `<output_dir>/.weights/v{N}` (to a temporary
folder first, then renamed, so the server never reads half a checkpoint), then pauses the server
keeping in-flight requests, reloads, drops the prefix cache and resumes; older versions are deleted.
A LoRA model travels this way merged (W + scale·B·A) when the server cannot serve its adapter.
`lora` publishes only the adapter, under a new name per version. `choose_sync` picks one from what the
server reports. Under torchrun every rank calls `push` (gathering sharded weights is collective); rank 0 alone
talks to the server.
"""

import shutil
import socket
import time
import urllib.parse
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Protocol, cast

import torch
from peft import LoraConfig, PeftConfig, PeftModel
from peft.tuners.lora import LoraLayer
from transformers import PreTrainedModel

from tandem.contract.staleness import StalenessPolicy
from tandem.errors import UsageError
from tandem.generation.client import ControlClient, ServerProblem
from tandem.generation.server_facts import ServerFacts
from tandem.model.distributed import Ranks
from tandem.model.model_folder import quiet_progress, save_model_folder
from tandem.network import address_toward, machine_addresses
from tandem.runtime.weight_transfer import (
    Announce,
    GlooPlane,
    LoopRunner,
    TransferSync,
    VllmNcclPlane,
    free_port,
    no_one,
)

if TYPE_CHECKING:
    from tandem.config import AsyncGRPOConfig


class DeltaWeightLayer(Protocol):
    """A LoRA layer that computes its adapter's weight delta (every kind PEFT's LoRA wraps a weight with does)."""

    def get_delta_weight(self, adapter: str) -> torch.Tensor: ...


def write_weights(
    model: torch.nn.Module, folder: Path, name: str, ranks: Ranks, state_dict: dict[str, torch.Tensor] | None = None
) -> Path:
    """Save `model` (a whole model, or a PEFT adapter) as `folder/name`: to a temporary folder first, then renamed,
    so the server never reads half of it. `state_dict` replaces the model's own weights in the files (one rank)."""
    target, staging = folder / name, folder / f".{name}.tmp"
    if ranks.main:
        shutil.rmtree(staging, ignore_errors=True)
    if state_dict is not None:
        assert isinstance(model, PreTrainedModel), "other weights are saved under a transformers model's names"
        with quiet_progress():
            model.save_pretrained(staging, safe_serialization=True, state_dict=state_dict)
    else:
        save_model_folder(model, staging, ranks)
    if ranks.main:
        shutil.rmtree(target, ignore_errors=True)
        staging.rename(target)
    return target


def merged_state_dict(model: PeftModel) -> dict[str, torch.Tensor]:
    """The base model's weights under its own names, each LoRA layer's W replaced by W + its adapter's delta.
    Computed out of place: merging into the trained weights and back would round them a little every sync."""
    base = model.get_base_model()
    layers = {name: cast(DeltaWeightLayer, m) for name, m in base.named_modules() if isinstance(m, LoraLayer)}
    merged = {}
    for key, value in base.state_dict().items():
        if "lora_" in key:
            continue
        owner, _, leaf = key.rpartition(".")
        if owner.endswith(".base_layer"):  # PEFT's wrapper: q_proj.base_layer.weight is the base q_proj.weight
            owner = owner.removesuffix(".base_layer")
            if leaf == "weight":
                value = value + layers[owner].get_delta_weight(model.active_adapter).to(value.dtype)
            key = f"{owner}.{leaf}"
        merged[key] = value
    return merged


class ReloadSync:
    def __init__(
        self,
        control: ControlClient | None,
        output_dir: Path,
        run: LoopRunner | None,
        served_name: str,
        ranks: Ranks = Ranks(),
    ):
        self.control, self.folder, self.run, self.served_name = control, output_dir / ".weights", run, served_name
        self.ranks = ranks
        self.folder.mkdir(parents=True, exist_ok=True)

    def name_for(self, version: int) -> str:
        """What rollouts of `version` ask the server for: always the base model's name."""
        return self.served_name

    def push(self, model: torch.nn.Module, version: int, announce: Announce = no_one) -> dict[str, float]:
        """Publish `model` (merged, for a LoRA model) as `version`, then announce it to the rollouts; returns the
        timing breakdown for perf/weight_sync_*."""
        start = time.perf_counter()
        if isinstance(model, PeftModel):
            with torch.no_grad():
                target = write_weights(
                    model.get_base_model(), self.folder, f"v{version}", self.ranks, merged_state_dict(model)
                )
        else:
            target = write_weights(model, self.folder, f"v{version}", self.ranks)
        if not self.ranks.main:
            return {}
        control, run = leader(self.control, self.run)
        written = time.perf_counter()
        run.run(control.pause("keep"))
        paused = time.perf_counter()
        run.run(control.reload_weights(str(target.resolve())))
        run.run(control.reset_prefix_cache())
        since = time.monotonic()
        announce(version, since)  # before the resume: a token sampled after it must find its version marked
        run.run(control.resume())
        done = time.perf_counter()
        for old in self.folder.glob("v*"):
            if old != target:
                shutil.rmtree(old, ignore_errors=True)
        return {
            "perf/weight_sync_s": done - start,
            "perf/weight_sync_pause_s": paused - written,
            "perf/weight_sync_transfer_s": (written - start) + (done - paused),
        }


def leader(control: ControlClient | None, run: LoopRunner | None) -> tuple[ControlClient, LoopRunner]:
    """Rank 0's control client and what runs its calls (the other ranks talk to no server and hold neither)."""
    assert control is not None and run is not None, "only rank 0 talks to the server"
    return control, run


GLOO_HINT = (
    "install tandem's vLLM plugin into vLLM's environment (pip install integrations/vllm_plugin, or "
    'scripts/vllm_env.sh) and start vllm serve with --weight-transfer-config \'{"backend": "gloo"}\'.'
)

ADAPTER_NAME = "tandem-policy-v{version}"
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


def lora_server_flags(staleness: StalenessPolicy, rank: int) -> list[str]:
    """The server flags a LoRA run needs: room for the policy's adapter slots (the versions in use plus the one being
    loaded), and a --max-lora-rank vLLM accepts (only VLLM_LORA_RANKS are: the smallest one that holds `rank`)."""
    loras = str(staleness.adapter_slots)
    max_rank = next((r for r in VLLM_LORA_RANKS if r >= rank), rank)
    return ["--enable-lora", "--max-loras", loras, "--max-cpu-loras", loras, "--max-lora-rank", str(max_rank)]


class LoraSync:
    """The `lora` strategy: only the adapter travels. Each version is a new name
    (`tandem-policy-v{N}`), so a cached prefix can never mix two versions; the last `keep` versions stay
    loaded for the rollouts still sampling from them. The new one is loaded before the oldest is unloaded,
    and a version's folder is deleted one sync after its unload (vLLM may still read an adapter's files
    lazily while requests that named it finish)."""

    def __init__(
        self,
        control: ControlClient | None,
        output_dir: Path,
        run: LoopRunner | None,
        keep: int,
        ranks: Ranks = Ranks(),
    ):
        self.control, self.folder, self.run, self.keep, self.ranks = (
            control,
            output_dir / ".vllm_lora",
            run,
            keep,
            ranks,
        )
        self.folder.mkdir(parents=True, exist_ok=True)
        self.loaded: list[int] = []
        self.unloaded: list[str] = []

    def name_for(self, version: int) -> str:
        return ADAPTER_NAME.format(version=version)

    def push(self, model: torch.nn.Module, version: int, announce: Announce = no_one) -> dict[str, float]:
        """Load the adapter as a new name and announce it before the oldest is unloaded, so a rollout that names an
        unloaded version always started before the announcement (and is skipped as stale)."""
        start = time.perf_counter()
        name = self.name_for(version)
        target = write_weights(model, self.folder, name, self.ranks)
        if not self.ranks.main:
            return {}
        control, run = leader(self.control, self.run)
        run.run(control.load_lora(name, str(target.resolve())))
        announce(version, time.monotonic())  # requests name the adapter: none could sample from it before
        self.loaded.append(version)
        for old in self.unloaded:
            shutil.rmtree(self.folder / old, ignore_errors=True)
        self.unloaded = []
        while len(self.loaded) > self.keep:
            old = self.name_for(self.loaded.pop(0))
            run.run(control.unload_lora(old))
            self.unloaded.append(old)
        done = time.perf_counter()
        return {"perf/weight_sync_s": done - start, "perf/weight_sync_transfer_s": done - start}  # nothing paused


WeightSync = ReloadSync | LoraSync | TransferSync
"""How the policy reaches the server: a folder it reloads, an adapter it loads, or a stream."""


def choose_sync(
    control: ControlClient,
    run: LoopRunner,
    facts: ServerFacts,
    served_name: str,
    model: torch.nn.Module,
    args: "AsyncGRPOConfig",
    lora: bool,
    ranks: Ranks = Ranks(),
) -> WeightSync:
    """How weights reach this server (what `facts` says it can do): adapter-only when training LoRA and the server can serve the adapter by name
    (else the merged model, with a warning that says why); for full weights, streamed over the server's weight-transfer
    group when it has one (`TransferSync`), else written to a folder it reloads. A server holding too few or too small
    adapters is an error naming its flags. Called on rank 0; the other ranks build the same kind with `follower_sync`."""
    if lora:
        assert isinstance(model, PeftModel), "a LoRA run trains a PEFT model"
        return adapter_sync(control, run, facts, served_name, model, args, ranks)
    return full_weights_sync(control, run, facts, served_name, model, args, ranks)


def transfer_address(chosen: str | None, control: ControlClient, run: LoopRunner) -> str:
    """Where the servers reach this trainer for the weight stream, as an IPv4 address: `chosen` (weight_transfer_address;
    a name is resolved once, so that both ends mean the same address) or this machine's address on the route to what
    joins the group, the server or, behind tandem proxy, its first replica (the replicas connect here, not the proxy)."""
    if chosen:
        try:
            address = socket.gethostbyname(chosen)
            free_port(address)  # one of this machine's: the trainer listens there
        except OSError as exc:
            raise UsageError(
                f"weight_transfer_address={chosen!r}: {exc}. Give an address of this machine that the servers can "
                f"reach (it has {', '.join(machine_addresses()) or 'none'} beside loopback), or leave it unset."
            ) from None
        return address
    replicas = run.run(control.replica_urls())
    return address_toward(urllib.parse.urlsplit(replicas[0] if replicas else control.base_url).hostname or "")


def full_weights_sync(
    control: ControlClient,
    run: LoopRunner,
    facts: ServerFacts,
    served_name: str,
    model: torch.nn.Module,
    args: "AsyncGRPOConfig",
    ranks: Ranks,
) -> TransferSync | ReloadSync:
    """Every weight: streamed when the server's weight-transfer backend is one tandem drives, else a folder reload."""
    backend = facts.weight_transfer
    if facts.streams_weights:
        plane = GlooPlane(stages=facts.stages_weights) if backend == "gloo" else nccl_plane(model)
        sync = TransferSync(
            control,
            run,
            served_name,
            ranks,
            transfer_address(args.weight_transfer_address, control, run),
            args.vllm_server_timeout,
            plane,
            checkpoint_names=facts.loads_checkpoint_names,
        )
        sync.connect()
        return sync
    if backend is not None:
        warnings.warn(
            f"the server transfers weights over {backend}, which tandem does not drive (it drives nccl "
            "and gloo: tandem serve's, or vllm serve's with tandem's plugin); syncing through a folder it "
            "reloads instead, which needs a filesystem it shares with this trainer.",
            stacklevel=6,  # the user's call of train()
        )
    return reload_sync(control, Path(args.output_dir), run, served_name, ranks, facts, model)


def adapter_sync(
    control: ControlClient,
    run: LoopRunner,
    facts: ServerFacts,
    served_name: str,
    model: PeftModel,
    args: "AsyncGRPOConfig",
    ranks: Ranks,
) -> LoraSync | ReloadSync:
    """A LoRA model: the adapter alone when the server can serve it by name, else the merged model through a folder
    (one rank only). A server with too little room for the run's adapters, or that cannot load them while it runs, is
    an error."""
    output_dir, staleness = Path(args.output_dir), args.staleness_policy
    config = model.peft_config["default"]
    assert isinstance(config, LoraConfig), "a LoRA run's adapter"
    rank, needed = config.r, staleness.adapter_slots
    flags = " ".join(lora_server_flags(staleness, rank))
    obstacle = adapter_sync_obstacle(model.peft_config, facts, flags)
    if obstacle and ranks.several:
        raise NotImplementedError(
            f"LoRA under several ranks syncs the adapter alone, and this server cannot serve it: {obstacle}"
        )
    if obstacle:
        warnings.warn(
            f"LoRA: syncing the merged model (every weight, every sync) instead of the adapter alone: {obstacle}",
            stacklevel=6,  # the user's call of train()
        )
        return reload_sync(control, output_dir, run, served_name, ranks, facts, model.get_base_model())
    slots = facts.adapters
    assert slots is not None, "a server without LoRA support is an obstacle"
    if (slots.max_loras or needed) < needed or (slots.max_lora_rank or rank) < rank:
        raise ServerProblem(
            f"the server holds max_loras={slots.max_loras} adapters of rank <= {slots.max_lora_rank}; "
            f"this run needs {needed} (max_staleness + 2) of rank {rank}. Restart it with {flags}"
        )
    if not facts.loads_adapters_at_runtime:
        raise ServerProblem(
            f"the server at {control.base_url} cannot load adapters while it runs, and a LoRA run loads "
            "one per sync: start vllm serve with VLLM_ALLOW_RUNTIME_LORA_UPDATING=1 in its environment."
        )
    return LoraSync(control, output_dir, run, keep=staleness.adapter_versions_kept, ranks=ranks)


def reload_sync(
    control: ControlClient,
    output_dir: Path,
    run: LoopRunner,
    served_name: str,
    ranks: Ranks,
    facts: ServerFacts,
    model: torch.nn.Module,
) -> ReloadSync:
    """The folder reload, unless the server is vLLM's CPU build and the model ties its LM head to its embedding."""
    assert isinstance(model, PreTrainedModel), "the server reloads a transformers model's folder"
    if not facts.reload_refreshes_tied_head and model.config.get_text_config().tie_word_embeddings:
        raise ServerProblem(
            f"vLLM's CPU build does not refresh a tied LM head when it reloads weights (it keeps a packed "
            f"copy of the first ones: the policy drifts off the trainer's at every sync), and this model "
            f"ties its embeddings. Stream the weights instead: {GLOO_HINT}"
        )
    return ReloadSync(control, output_dir, run, served_name, ranks)


def nccl_plane(model: torch.nn.Module) -> VllmNcclPlane:
    """The data plane into a vllm serve that receives over NCCL: tensors leave from the trainer's GPU."""
    device = next(model.parameters()).device
    if device.type != "cuda":
        raise ServerProblem(
            f"the server receives weights over NCCL, which needs the trainer on a GPU; this model is on "
            f"{device}. Start vllm serve without --weight-transfer-config to sync through a folder it "
            "reloads, or train on a GPU."
        )
    return VllmNcclPlane(device)


def follower_sync(
    kind: type, output_dir: Path, served_name: str, staleness: StalenessPolicy, ranks: Ranks
) -> WeightSync:
    """The sync of a rank other than 0: the same kind as rank 0's, taking part in the gathers and saving nothing."""
    if kind is LoraSync:
        return LoraSync(None, output_dir, None, keep=staleness.adapter_versions_kept, ranks=ranks)
    if kind is TransferSync:
        return TransferSync(None, None, served_name, ranks)
    return ReloadSync(None, output_dir, None, served_name, ranks)


def adapter_sync_obstacle(peft_config: dict[str, PeftConfig], facts: ServerFacts, flags: str) -> str | None:
    """Why the server cannot serve this adapter by name (the merged model then travels instead), or None.
    vLLM serves single plain LoRA adapters: no DoRA, bias, modules_to_save, parameter targets or embeddings."""
    if len(peft_config) != 1:
        return f"the model has {len(peft_config)} adapters and a request names one. Train a single adapter."
    config = next(iter(peft_config.values()))
    assert isinstance(config, LoraConfig), "a LoRA run's adapter"
    if facts.adapters is None:
        return f"the server was started without LoRA support. Restart it with {flags} to sync the adapter alone."
    data_parallel = facts.data_parallel_size
    if data_parallel > 1:
        return (
            f"the server runs data_parallel_size={data_parallel}, and /v1/load_lora_adapter reaches only the rank "
            "that answers it: the others would serve the base model under the new name. Run replicas with "
            "--data-parallel-size 1 behind `tandem proxy`, which loads each adapter on every replica."
        )
    targets = config.target_modules or []
    targets = [targets] if isinstance(targets, str) else list(targets)
    unsupported = [
        ("use_dora", getattr(config, "use_dora", False), "DoRA"),
        ("bias", getattr(config, "bias", "none") != "none", f"bias={getattr(config, 'bias', None)!r}"),
        ("modules_to_save", bool(config.modules_to_save), f"modules_to_save={config.modules_to_save}"),
        ("target_parameters", bool(getattr(config, "target_parameters", None)), "target_parameters"),
        ("target_modules", any("embed_tokens" in t for t in targets), "an adapter on embed_tokens"),
    ]
    for field_name, present, what in unsupported:
        if present:
            return f"vLLM does not serve {what} ({field_name} in the LoraConfig). Use a plain LoRA adapter to sync it alone."
    return None
