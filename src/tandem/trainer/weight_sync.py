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


class ReloadSync:
    def __init__(self, control: ControlClient, output_dir: Path, run: "asyncio.Runner"):
        self.control, self.folder, self.run = control, output_dir / ".weights", run
        self.folder.mkdir(parents=True, exist_ok=True)

    def push(self, model: torch.nn.Module, version: int) -> dict[str, float]:
        """Publish `model` as `version`; returns the timing breakdown for perf/weight_sync_*."""
        start = time.perf_counter()
        target = self.folder / f"v{version}"
        staging = self.folder / f".v{version}.tmp"
        shutil.rmtree(staging, ignore_errors=True)
        with quiet_progress():
            model.save_pretrained(staging, safe_serialization=True)
        staging.rename(target)
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
