"""Weight sync on a model large enough for the differences to show: full weights through the disk against the
network transfer, and adapter-only LoRA sync against the merged-weight fallback.

A random model of the tiny model's architecture, made wider and deeper, is served by one `tandem serve` with
`--enable-lora` and `--weight-transfer-config '{"backend":"gloo"}'`, and pushed `--syncs` times each way through
the trainer's own sync objects:
- full weights: `reload` (publish the model as safetensors, pause, reload, reset the prefix cache, resume) against
  `transfer` (stream every tensor over the gloo group while the server generates on, swap them in between two engine
  steps, reset the prefix cache: trainer/weight_transfer.py);
  seconds and bytes per sync, and the trainer's peak extra resident memory during a sync;
- LoRA: `lora` (publish the adapter, load it under a new name, unload the oldest) against the merged fallback.

    python benchmarks/weight_sync.py [--layers 12] [--hidden 1024] [--rank 16] [--syncs 3] [--markdown PATH]
"""

import argparse
import asyncio
import json
import os
import tempfile
import threading
import time
from pathlib import Path

import torch
from peft import LoraConfig, get_peft_model
from tables import add_markdown_flag, emit, markdown_table
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from tandem.contract.staleness import StalenessPolicy
from tandem.generation.client import ControlClient
from tandem.generation.launcher import EmbeddedServer
from tandem.runtime.weight_sync import LoraSync, ReloadSync, lora_server_flags
from tandem.runtime.weight_transfer import TransferSync
from tandem.tasks import TINY_MODEL_PATH


def folder_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def make_model(folder: Path, layers: int, hidden: int) -> int:
    config = AutoConfig.from_pretrained(TINY_MODEL_PATH)
    config.num_hidden_layers, config.layer_types = layers, ["full_attention"] * layers
    config.hidden_size, config.intermediate_size = hidden, 4 * hidden
    config.num_attention_heads, config.num_key_value_heads = hidden // 64, max(1, hidden // 256)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(folder)
    AutoTokenizer.from_pretrained(TINY_MODEL_PATH).save_pretrained(folder)
    return sum(p.numel() for p in model.parameters())


def resident_bytes() -> int:
    return int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class PeakResident:
    """The largest resident memory of this process above its level at entry, sampled every millisecond."""

    def __enter__(self):
        self.base, self.peak, self.running = resident_bytes(), 0, True
        self.thread = threading.Thread(target=self._sample, daemon=True)
        self.thread.start()
        return self

    def _sample(self):
        while self.running:
            self.peak = max(self.peak, resident_bytes() - self.base)
            time.sleep(0.001)

    def __exit__(self, *exc):
        self.running = False
        self.thread.join()


def full_syncs(sync, model, versions: range, written) -> tuple[float, int, int]:
    """Mean seconds, bytes moved and peak extra resident bytes per full-weight sync; every weight changes first."""
    seconds, moved, peaks = [], [], []
    for version in versions:
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1e-4 * torch.randn_like(p))
        with PeakResident() as peak:
            start = time.perf_counter()
            sync.push(model, version)
            seconds.append(time.perf_counter() - start)
        moved.append(written(version))
        peaks.append(peak.peak)
    return sum(seconds) / len(seconds), sum(moved) // len(moved), max(peaks)


def timed_syncs(sync, model, versions: range, folder_of) -> tuple[float, int]:
    """Mean seconds and bytes written per sync; the adapter changes before each one, as after an optimizer step."""
    seconds, written = [], []
    for version in versions:
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.add_(1e-3 * torch.randn_like(p))
        start = time.perf_counter()
        sync.push(model, version)
        seconds.append(time.perf_counter() - start)
        written.append(folder_bytes(folder_of(version)))
    return sum(seconds) / len(seconds), sum(written) // len(written)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--syncs", type=int, default=3)
    add_markdown_flag(parser)
    cli = parser.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        params = make_model(tmp / "model", cli.layers, cli.hidden)
        print(
            f"model: {cli.layers} layers, hidden {cli.hidden}, {params / 1e6:.0f}M parameters (fp32); "
            f"LoRA rank {cli.rank} on every linear layer",
            flush=True,
        )
        model = get_peft_model(
            AutoModelForCausalLM.from_pretrained(tmp / "model", dtype=torch.float32),
            LoraConfig(
                r=cli.rank,
                lora_alpha=2 * cli.rank,
                lora_dropout=0.0,
                target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
            ),
        )
        flags = [
            *lora_server_flags(StalenessPolicy(max_staleness=1), rank=cli.rank),
            "--weight-transfer-config",
            json.dumps({"backend": "gloo"}),
        ]
        with (
            EmbeddedServer(str(tmp / "model"), log_path=tmp / "server.log", extra_args=flags) as server,
            asyncio.Runner() as run,
        ):
            control = ControlClient(server.url, timeout_s=600)
            plain = AutoModelForCausalLM.from_pretrained(tmp / "model", dtype=torch.float32)
            reload = ReloadSync(control, tmp / "full_run", run, served_name=str(tmp / "model"))
            reload_s, reload_bytes, reload_peak = full_syncs(
                reload, plain, range(1, cli.syncs + 1), lambda v: folder_bytes(reload.folder / f"v{v}")
            )
            transfer = TransferSync(control, run, str(tmp / "model"))
            transfer.connect()
            sent = sum(p.numel() * p.element_size() for p in plain.parameters())
            transfer_s, transfer_bytes, transfer_peak = full_syncs(
                transfer, plain, range(1, cli.syncs + 1), lambda v: sent
            )
            largest = max(p.numel() * p.element_size() for p in plain.parameters())
            adapter = LoraSync(control, tmp / "lora_run", run, keep=2)
            merged = ReloadSync(control, tmp / "merged_run", run, served_name=str(tmp / "model"))
            lora_s, lora_bytes = timed_syncs(
                adapter, model, range(1, cli.syncs + 1), lambda v: adapter.folder / adapter.name_for(v)
            )
            merged_s, merged_bytes = timed_syncs(
                merged, model, range(1, cli.syncs + 1), lambda v: merged.folder / f"v{v}"
            )
            run.run(control.close())

    print(f"{cli.syncs} syncs each, against a running tandem serve; largest tensor {largest / 2**20:.1f} MiB")
    mib = lambda n: f"{n / 2**20:.1f} MiB"  # noqa: E731
    full = markdown_table(
        ["full-weight sync", "seconds per sync", "moved per sync", "trainer's peak extra memory"],
        "lrrr",
        [
            [
                "`reload`: publish to disk, pause, reload, reset cache, resume",
                f"{reload_s:.2f}",
                f"{mib(reload_bytes)} written",
                mib(reload_peak),
            ],
            [
                "`transfer`: stream over gloo while generating, swap between engine steps, reset cache",
                f"{transfer_s:.2f}",
                f"{mib(transfer_bytes)} sent",
                mib(transfer_peak),
            ],
            ["reload / transfer", f"{reload_s / transfer_s:.1f}x", "", ""],
        ],
    )
    emit(
        full
        + "\n"
        + markdown_table(
            ["sync", "seconds per sync", "written per sync"],
            "lrr",
            [
                [
                    "adapter only (`lora`: publish, load a new name, unload the oldest)",
                    f"{lora_s:.2f}",
                    f"{lora_bytes / 2**20:.1f} MiB",
                ],
                [
                    "merged weights (`reload`: merge, publish, pause, reload, reset cache, resume)",
                    f"{merged_s:.2f}",
                    f"{merged_bytes / 2**20:.1f} MiB",
                ],
                ["merged / adapter", f"{merged_s / lora_s:.1f}x", f"{merged_bytes / lora_bytes:.1f}x"],
            ],
        ),
        cli.markdown,
    )


if __name__ == "__main__":
    main()
