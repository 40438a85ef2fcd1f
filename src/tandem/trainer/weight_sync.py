"""Pushing the policy to the generation server: the `reload` and `lora` strategies (DESIGN.md §2).

`reload` writes the whole model in checkpoint format to `<output_dir>/.weights/v{N}` (to a temporary
folder first, then renamed, so the server never reads half a checkpoint), then pauses the server
keeping in-flight requests, reloads, drops the prefix cache and resumes; older versions are deleted.
A LoRA model travels this way merged (W + scale·B·A) when the server cannot serve its adapter.
`lora` publishes only the adapter, under a new name per version.
"""

import asyncio
import shutil
import time
from contextlib import contextmanager
from pathlib import Path

import torch
from peft import PeftModel
from peft.tuners.lora import LoraLayer
from transformers.utils import logging as hf_logging

from tandem.generation.client import ControlClient


@contextmanager
def quiet_progress():
    """transformers draws a progress bar per save; a save every step would bury the training progress line."""
    enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if enabled:
            hf_logging.enable_progress_bar()


def publish(model: torch.nn.Module, folder: Path, name: str, state_dict: dict | None = None) -> Path:
    """Save `model` (a whole model, or a PEFT adapter) as `folder/name`: to a temporary folder first, then renamed,
    so the server never reads half of it. `state_dict` replaces the model's own weights in the files."""
    target, staging = folder / name, folder / f".{name}.tmp"
    shutil.rmtree(staging, ignore_errors=True)
    with quiet_progress():
        model.save_pretrained(staging, safe_serialization=True, **({"state_dict": state_dict} if state_dict else {}))
    shutil.rmtree(target, ignore_errors=True)
    staging.rename(target)
    return target


def merged_state_dict(model: PeftModel) -> dict[str, torch.Tensor]:
    """The base model's weights under its own names, each LoRA layer's W replaced by W + its adapter's delta.
    Computed out of place: merging into the trained weights and back would round them a little every sync."""
    base = model.get_base_model()
    layers = {name: m for name, m in base.named_modules() if isinstance(m, LoraLayer)}
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
    def __init__(self, control: ControlClient, output_dir: Path, run: "asyncio.Runner", served_name: str):
        self.control, self.folder, self.run, self.served_name = control, output_dir / ".weights", run, served_name
        self.folder.mkdir(parents=True, exist_ok=True)

    def name_for(self, version: int) -> str:
        """What rollouts of `version` ask the server for: always the base model's name."""
        return self.served_name

    def push(self, model: torch.nn.Module, version: int, announce=lambda version: None) -> dict[str, float]:
        """Publish `model` (merged, for a LoRA model) as `version`, then `announce(version)` to the rollouts; returns
        the timing breakdown for perf/weight_sync_*."""
        start = time.perf_counter()
        if isinstance(model, PeftModel):
            with torch.no_grad():
                target = publish(model.get_base_model(), self.folder, f"v{version}", merged_state_dict(model))
        else:
            target = publish(model, self.folder, f"v{version}")
        written = time.perf_counter()
        self.run.run(self.control.pause("keep"))
        paused = time.perf_counter()
        self.run.run(self.control.reload_weights(str(target.resolve())))
        self.run.run(self.control.reset_prefix_cache())
        self.run.run(self.control.resume())
        announce(version)
        done = time.perf_counter()
        for old in self.folder.glob("v*"):
            if old != target:
                shutil.rmtree(old, ignore_errors=True)
        return {"perf/weight_sync_s": done - start, "perf/weight_sync_pause_s": paused - written,
                "perf/weight_sync_barrier_s": 0.0, "perf/weight_sync_transfer_s": (written - start) + (done - paused)}


ADAPTER_NAME = "tandem-policy-v{version}"
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


def lora_server_flags(max_staleness: int, rank: int) -> list[str]:
    """The server flags a LoRA run needs: room for the max_staleness + 1 versions in use plus the one being loaded,
    and a --max-lora-rank vLLM accepts (only VLLM_LORA_RANKS are: the smallest one that holds `rank`)."""
    loras = str(max_staleness + 2)
    max_rank = next((r for r in VLLM_LORA_RANKS if r >= rank), rank)
    return ["--enable-lora", "--max-loras", loras, "--max-cpu-loras", loras, "--max-lora-rank", str(max_rank)]


class LoraSync:
    """The `lora` strategy (DESIGN.md §2): only the adapter travels. Each version is a new name
    (`tandem-policy-v{N}`), so a cached prefix can never mix two versions; the last `keep` versions stay
    loaded for the rollouts still sampling from them. The new one is loaded before the oldest is unloaded,
    and a version's folder is deleted one sync after its unload (vLLM may still read an adapter's files
    lazily while requests that named it finish)."""

    def __init__(self, control: ControlClient, output_dir: Path, run: "asyncio.Runner", keep: int):
        self.control, self.folder, self.run, self.keep = control, output_dir / ".vllm_lora", run, keep
        self.folder.mkdir(parents=True, exist_ok=True)
        self.loaded: list[int] = []
        self.unloaded: list[str] = []

    def name_for(self, version: int) -> str:
        return ADAPTER_NAME.format(version=version)

    def push(self, model: torch.nn.Module, version: int, announce=lambda version: None) -> dict[str, float]:
        """Load the adapter as a new name and `announce(version)` before the oldest is unloaded, so a rollout
        that names an unloaded version always started before the announcement (and is skipped as stale)."""
        start = time.perf_counter()
        name = self.name_for(version)
        target = publish(model, self.folder, name)
        self.run.run(self.control.load_lora(name, str(target.resolve())))
        announce(version)
        self.loaded.append(version)
        for old in self.unloaded:
            shutil.rmtree(self.folder / old, ignore_errors=True)
        self.unloaded = []
        while len(self.loaded) > self.keep:
            old = self.name_for(self.loaded.pop(0))
            self.run.run(self.control.unload_lora(old))
            self.unloaded.append(old)
        done = time.perf_counter()
        return {"perf/weight_sync_s": done - start, "perf/weight_sync_pause_s": 0.0, "perf/weight_sync_barrier_s": 0.0,
                "perf/weight_sync_transfer_s": done - start}
