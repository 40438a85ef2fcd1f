"""Pushing the policy to the generation server: the `reload` strategy (DESIGN.md §2).

The trainer writes the weights in checkpoint format to `<output_dir>/.weights/v{N}` (to a temporary
folder first, then renamed, so the server never reads half a checkpoint), then pauses the server
keeping in-flight requests, reloads, drops the prefix cache and resumes. Older versions are deleted.
"""

import asyncio
import shutil
import time
from contextlib import contextmanager
from pathlib import Path

import torch
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


def publish(model: torch.nn.Module, folder: Path, name: str) -> Path:
    """Save `model` (a whole model, or a PEFT adapter) as `folder/name`: to a temporary folder first, then renamed,
    so the server never reads half of it."""
    target, staging = folder / name, folder / f".{name}.tmp"
    shutil.rmtree(staging, ignore_errors=True)
    with quiet_progress():
        model.save_pretrained(staging, safe_serialization=True)
    shutil.rmtree(target, ignore_errors=True)
    staging.rename(target)
    return target


class ReloadSync:
    def __init__(self, control: ControlClient, output_dir: Path, run: "asyncio.Runner"):
        self.control, self.folder, self.run = control, output_dir / ".weights", run
        self.folder.mkdir(parents=True, exist_ok=True)

    def push(self, model: torch.nn.Module, version: int) -> dict[str, float]:
        """Publish `model` as `version`; returns the timing breakdown for perf/weight_sync_*."""
        start = time.perf_counter()
        target = publish(model, self.folder, f"v{version}")
        written = time.perf_counter()
        self.run.run(self.control.pause("keep"))
        paused = time.perf_counter()
        self.run.run(self.control.reload_weights(str(target.resolve())))
        self.run.run(self.control.reset_prefix_cache())
        self.run.run(self.control.resume())
        done = time.perf_counter()
        for old in self.folder.glob("v*"):
            if old != target:
                shutil.rmtree(old, ignore_errors=True)
        return {"perf/weight_sync_s": done - start, "perf/weight_sync_pause_s": paused - written,
                "perf/weight_sync_barrier_s": 0.0, "perf/weight_sync_transfer_s": (written - start) + (done - paused)}


ADAPTER_NAME = "tandem-policy-v{version}"


class LoraSync:
    """The `lora` strategy (DESIGN.md §2): only the adapter travels. Each version is a new name
    (`tandem-policy-v{N}`), so a cached prefix can never mix two versions; the last `keep` versions stay
    loaded for the rollouts still sampling from them. The new one is loaded before the oldest is unloaded,
    and a version's folder is deleted only once it has left the server."""

    def __init__(self, control: ControlClient, output_dir: Path, run: "asyncio.Runner", keep: int):
        self.control, self.folder, self.run, self.keep = control, output_dir / ".vllm_lora", run, keep
        self.folder.mkdir(parents=True, exist_ok=True)
        self.loaded: list[int] = []

    def push(self, model: torch.nn.Module, version: int) -> dict[str, float]:
        start = time.perf_counter()
        name = ADAPTER_NAME.format(version=version)
        target = publish(model, self.folder, name)
        self.run.run(self.control.load_lora(name, str(target.resolve())))
        self.loaded.append(version)
        while len(self.loaded) > self.keep:
            old = ADAPTER_NAME.format(version=self.loaded.pop(0))
            self.run.run(self.control.unload_lora(old))
            shutil.rmtree(self.folder / old, ignore_errors=True)
        done = time.perf_counter()
        return {"perf/weight_sync_s": done - start, "perf/weight_sync_pause_s": 0.0, "perf/weight_sync_barrier_s": 0.0,
                "perf/weight_sync_transfer_s": done - start}
