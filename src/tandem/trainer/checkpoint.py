"""Checkpoints: model, tokenizer, optimizer, scheduler, trainer state and `rollout_state.json`.

A checkpoint is written to a temporary folder and renamed into place, so a crash never leaves a
half-written `checkpoint-N`. `rollout_state.json` holds the first prompt position not yet trained:
resuming starts the worker there, so no prompt is skipped (a few may be trained twice).
"""

import json
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch

from tandem.trainer.weight_sync import quiet_progress

PATTERN = re.compile(r"^checkpoint-(\d+)$")


@dataclass
class TrainerState:
    step: int
    model_version: int
    dataset_start_index: int
    num_tokens: int


def save(folder: Path, model, tokenizer, optimizer, scheduler, state: TrainerState, save_total_limit: int | None) -> Path:
    target = folder / f"checkpoint-{state.step}"
    staging = folder / f".checkpoint-{state.step}.tmp"
    shutil.rmtree(staging, ignore_errors=True)
    with quiet_progress():
        model.save_pretrained(staging, safe_serialization=True)
    tokenizer.save_pretrained(staging)
    torch.save(optimizer.state_dict(), staging / "optimizer.pt")
    torch.save(scheduler.state_dict(), staging / "scheduler.pt")
    (staging / "trainer_state.json").write_text(json.dumps({"step": state.step, "model_version": state.model_version,
                                                            "num_tokens": state.num_tokens}, indent=2))
    (staging / "rollout_state.json").write_text(json.dumps({"dataset_start_index": state.dataset_start_index}, indent=2))
    shutil.rmtree(target, ignore_errors=True)
    staging.rename(target)
    if save_total_limit:
        for old in checkpoints(folder)[:-save_total_limit]:
            shutil.rmtree(old, ignore_errors=True)
    return target


def checkpoints(folder: Path) -> list[Path]:
    found = [p for p in folder.glob("checkpoint-*") if p.is_dir() and PATTERN.match(p.name)]
    return sorted(found, key=lambda p: int(PATTERN.match(p.name).group(1)))


def resolve(resume_from_checkpoint, output_dir: Path) -> Path | None:
    if resume_from_checkpoint in (None, False):
        return None
    if resume_from_checkpoint is True:
        found = checkpoints(output_dir)
        if not found:
            raise FileNotFoundError(f"resume_from_checkpoint=True but {output_dir} has no checkpoint-N folder")
        return found[-1]
    path = Path(resume_from_checkpoint)
    if not (path / "rollout_state.json").is_file():
        raise FileNotFoundError(f"{path} is not a tandem checkpoint (no rollout_state.json)")
    return path


def load_state(path: Path, optimizer, scheduler) -> TrainerState:
    optimizer.load_state_dict(torch.load(path / "optimizer.pt", weights_only=True))
    scheduler.load_state_dict(torch.load(path / "scheduler.pt", weights_only=True))
    trainer = json.loads((path / "trainer_state.json").read_text())
    rollout = json.loads((path / "rollout_state.json").read_text())
    return TrainerState(step=trainer["step"], model_version=trainer["model_version"],
                        dataset_start_index=rollout["dataset_start_index"], num_tokens=trainer.get("num_tokens", 0))
