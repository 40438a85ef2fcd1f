"""The model as a folder transformers, vLLM and `tandem serve` load (`save_pretrained`'s layout), written from one
process or from FSDP2 shards: what checkpoints, folder weight syncs and `tandem export` write."""

import shutil
from contextlib import contextmanager
from pathlib import Path

import torch.distributed.checkpoint as dcp
from transformers.utils import logging as hf_logging

from tandem.model.distributed import Ranks, full_tensor


@contextmanager
def quiet_progress():
    """transformers draws a progress bar per save; a save every step would bury the training console."""
    enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if enabled:
            hf_logging.enable_progress_bar()


def save_model_folder(model, folder: Path, ranks: Ranks) -> None:
    """`model` as a folder transformers loads (`save_pretrained`'s layout), from one rank or from FSDP2 shards.
    Sharded weights go through DCP's Hugging Face writer: every rank writes its shards, then rank 0 joins them into
    whole safetensors files tensor by tensor, so no rank ever holds the whole model. Every rank calls this."""
    if not ranks.several:
        with quiet_progress():
            model.save_pretrained(folder, safe_serialization=True)
        return
    if hasattr(model, "peft_config"):  # an adapter is small: gathered whole, saved by rank 0
        from peft import get_peft_model_state_dict

        adapter = {name: full_tensor(value).cpu() for name, value in get_peft_model_state_dict(model).items()}
        if ranks.main:
            with quiet_progress():
                model.save_pretrained(folder, safe_serialization=True, state_dict=adapter)
        ranks.barrier()
        return
    if ranks.main:
        folder.mkdir(parents=True, exist_ok=True)
        model.config.save_pretrained(folder)
        if getattr(model, "generation_config", None) is not None:
            model.generation_config.save_pretrained(folder)
    weights = dict(model.named_parameters())  # tied weights once, under their first name (as save_pretrained does)
    weights |= {
        name: b for name, b in model.named_buffers() if name.rsplit(".", 1)[-1] not in _non_persistent(model, name)
    }
    dcp.save(
        weights,
        storage_writer=dcp.HuggingFaceStorageWriter(str(folder), save_distributed=True, enable_consolidation=True),
    )
    ranks.barrier()
    if ranks.main:
        shutil.rmtree(folder / "sharded", ignore_errors=True)  # the writer's per-rank files, joined above


def _non_persistent(model, buffer_name: str) -> set[str]:
    owner = model.get_submodule(buffer_name.rpartition(".")[0])
    return set(getattr(owner, "_non_persistent_buffers_set", ()))
