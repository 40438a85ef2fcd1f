"""Checkpoints on their own: a write killed half-way is never read, and what resumes is the last complete one."""

import json
import shutil
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from tandem import AsyncGRPOConfig, AsyncGRPOTrainer
from tandem.cli.user_input import lora_config
from tandem.model.distributed import Ranks
from tandem.recipe import load_recipe
from tandem.rewards import accuracy_reward
from tandem.runtime.sample_source import ResumePoint
from tandem.tasks import TINY_MODEL_PATH, datasets
from tandem.trainer import checkpoint
from tandem.trainer.checkpoint import TrainerState
from tandem.trainer.optimization import make_optimizer, make_scheduler

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"


def test_a_checkpoint_write_killed_half_way_is_never_read_and_the_last_complete_one_resumes(tmp_path, monkeypatch):
    model = AutoModelForCausalLM.from_pretrained(TINY_MODEL_PATH, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(TINY_MODEL_PATH)
    args = AsyncGRPOConfig(output_dir=str(tmp_path), max_steps=10)
    optimizer = make_optimizer(model, args)
    scheduler = make_scheduler(optimizer, args)

    def save(step: int):
        return checkpoint.save(
            tmp_path,
            model,
            tokenizer,
            optimizer,
            scheduler,
            TrainerState(global_step=step),
            None,
            Ranks(),
            ResumePoint(step * 3, finished=[step * 3 + 2]),
        )

    save(2)
    monkeypatch.setattr(tokenizer, "save_pretrained", lambda folder: (_ for _ in ()).throw(KeyboardInterrupt("killed")))
    with pytest.raises(KeyboardInterrupt):  # the process dies with the weights written and the rest not
        save(4)
    assert (tmp_path / ".checkpoint-4.tmp" / checkpoint.SHARDS).is_dir(), (
        "the half-written one is in its staging folder"
    )
    assert checkpoint.checkpoints(tmp_path) == [tmp_path / "checkpoint-2"]
    resumed = checkpoint.resolve(True, tmp_path)
    assert resumed == tmp_path / "checkpoint-2"
    state = TrainerState()
    checkpoint.load(resumed, model, optimizer, scheduler, state)
    assert state.step == 2 and checkpoint.load_resume_point(resumed).finished == [8]

    monkeypatch.undo()
    save(4)  # the next run writes step 4 again over the leftovers
    assert checkpoint.checkpoints(tmp_path)[-1].name == "checkpoint-4" and not (tmp_path / ".checkpoint-4.tmp").exists()


def test_a_checkpoint_written_before_the_runtime_reshaping_still_resumes_and_trains_its_saved_queue(tmp_path):
    """tests/fixtures/lora-checkpoint-4: written by commit 4855628 at step 4 of examples/lora.yaml, with 16 samples
    queued. Resumed for two steps, it goes on from step 4 and trains those samples, so their prompts are finished."""
    fixture = tmp_path / "checkpoint-4"
    shutil.copytree(FIXTURES / "lora-checkpoint-4", fixture)
    queued = {sample.prompt_index for sample in checkpoint.load_resume_point(fixture).samples}
    saved = checkpoint.load_resume_point(fixture).samples
    assert len(saved) == 16 and queued
    assert all(s.behavior_log_probs and len(s.behavior_log_probs) == len(s.input_ids) for s in saved), (
        "the queue's sampler log-probs come back under today's name (saved as 'logprobs')"
    )
    recipe = load_recipe(
        "examples/lora.yaml",
        ["--max_steps", "6", "--save_steps", "6", "--output_dir", str(tmp_path / "run"), "--disable_tqdm", "true"],
    )
    trainer = AsyncGRPOTrainer(
        recipe.model,
        accuracy_reward,
        args=recipe.config,
        train_dataset=datasets.load(recipe.dataset),
        peft_config=lora_config(recipe.lora),
    )
    trainer.train(resume_from_checkpoint=str(fixture))
    steps = [json.loads(line)["step"] for line in open(tmp_path / "run" / "metrics.jsonl")]
    assert steps[0] == 5 and steps[-1] == 6, steps
    after = checkpoint.load_resume_point(tmp_path / "run" / "checkpoint-6")
    assert all(p < after.dataset_start_index or p in after.finished for p in queued), (
        "the saved queue was trained first"
    )
