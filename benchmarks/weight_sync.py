"""Adapter-only sync against the merged-weight fallback, on a model large enough for the difference to show.

A random model of the tiny model's architecture, made wider and deeper, is served by `tandem serve
--enable-lora`; a LoRA-wrapped copy is pushed `--syncs` times each way through the trainer's own sync objects
(trainer/weight_sync.py): `lora` (publish the adapter, load it under a new name, unload the oldest) and the
merged fallback (add the adapter into the weights out of place, publish the whole model, pause, reload, reset
the prefix cache, resume). Prints seconds per sync and bytes written per sync, and their ratios.

    python benchmarks/weight_sync.py [--layers 12] [--hidden 1024] [--rank 16] [--syncs 3] [--markdown PATH]
"""

import argparse
import asyncio
import tempfile
import time
from pathlib import Path

import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from tandem.generation.client import ControlClient
from tandem.generation.launcher import EmbeddedServer
from tandem.tasks import TINY_MODEL_PATH
from tandem.trainer.weight_sync import LoraSync, ReloadSync, lora_server_flags

from tables import add_markdown_flag, emit, markdown_table


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
        print(f"model: {cli.layers} layers, hidden {cli.hidden}, {params / 1e6:.0f}M parameters (fp32); "
              f"LoRA rank {cli.rank} on every linear layer", flush=True)
        model = get_peft_model(AutoModelForCausalLM.from_pretrained(tmp / "model", dtype=torch.float32),
                               LoraConfig(r=cli.rank, lora_alpha=2 * cli.rank, lora_dropout=0.0,
                                          target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]))
        with EmbeddedServer(str(tmp / "model"), log_path=tmp / "server.log",
                            extra_args=lora_server_flags(max_staleness=1, rank=cli.rank)) as server, asyncio.Runner() as run:
            control = ControlClient(server.url, timeout_s=600)
            adapter = LoraSync(control, tmp / "lora_run", run, keep=2)
            merged = ReloadSync(control, tmp / "merged_run", run, served_name=str(tmp / "model"))
            lora_s, lora_bytes = timed_syncs(adapter, model, range(1, cli.syncs + 1),
                                             lambda v: adapter.folder / adapter.name_for(v))
            merged_s, merged_bytes = timed_syncs(merged, model, range(1, cli.syncs + 1), lambda v: merged.folder / f"v{v}")
            run.run(control.close())

    print(f"{cli.syncs} syncs each, against a running tandem serve")
    emit(markdown_table(["sync", "seconds per sync", "written per sync"], "lrr", [
        ["adapter only (`lora`: publish, load a new name, unload the oldest)", f"{lora_s:.2f}", f"{lora_bytes / 2**20:.1f} MiB"],
        ["merged weights (`reload`: merge, publish, pause, reload, reset cache, resume)", f"{merged_s:.2f}",
         f"{merged_bytes / 2**20:.1f} MiB"],
        ["merged / adapter", f"{merged_s / lora_s:.1f}x", f"{merged_bytes / lora_bytes:.1f}x"]]), cli.markdown)

if __name__ == "__main__":
    main()
