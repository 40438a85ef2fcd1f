"""Checkpoints: the training state through `torch.distributed.checkpoint`, a plain model folder beside it, and the
counters of the run.

    checkpoint-N/
      config.json, *.safetensors, tokenizer files   the model as transformers, vLLM and `tandem serve` load it
                                                    (the adapter alone for a LoRA run)
      distributed/                                  DCP: trainable weights and optimizer state, sharded by rank,
                                                    loadable on any number of ranks
      scheduler.pt, trainer_state.json              trainer_state.json also names the model the run started from
                                                    (`base_model`: what a LoRA checkpoint's adapter merges into)
      rollout_state.json, rollout_queue.pt          where the prompt stream resumes (sample_source.ResumePoint)

With save_only_model a checkpoint holds the model folder, the model's shards and trainer_state.json only: no run
resumes from it. trainer_state.json also keeps transformers' best-checkpoint fields and `stateful_callbacks`.

Every rank calls `save` and `load` (DCP is collective); rank 0 alone writes the small files. A checkpoint is
written to a temporary folder and renamed into place, so a crash never leaves a half-written `checkpoint-N`.
`rollout_state.json` holds the first prompt index not yet finished, the prompt indices past it that are, and the
groups partly trained; `rollout_queue.pt` the samples received and not yet trained. A resumed run starts its worker at
that prompt index, leaving out what the checkpoint holds, and trains the saved queue first: stopped and resumed, a run
finishes every prompt index exactly once, as an uninterrupted one does.
"""

import json
import math
import os
import re
import shutil
import warnings
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
import transformers
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)

from tandem.contract.records import Sample
from tandem.errors import UsageError
from tandem.model.distributed import Ranks
from tandem.model.model_folder import save_model_folder
from tandem.runtime.sample_source import ResumePoint
from tandem.tasks import TINY_MODEL_PATH

PATTERN = re.compile(r"^checkpoint-(\d+)$")
SHARDS = "distributed"
ONLY_TRAINABLE = StateDictOptions(ignore_frozen_params=True)
"""The frozen weights (a LoRA run's base model) come back from the model folder the run starts from."""


@dataclass
class TrainerState(transformers.TrainerState):
    """transformers' TrainerState (`global_step`, `max_steps`, `log_history`, ... as callbacks and scripts written for
    transformers and TRL read them) plus what resuming an async run needs."""

    model_version: int = 0
    """Weight syncs done: the policy version the server samples from."""
    dataset_start_index: int = 0
    """The first prompt index not yet fully trained (where a resumed worker starts)."""
    num_tokens: int = 0

    @property
    def step(self) -> int:
        """Optimizer steps taken: `global_step`."""
        return self.global_step

    @step.setter
    def step(self, value: int) -> None:
        self.global_step = value


@contextmanager
def one_process_is_intended():
    """DCP warns on every call without a process group that it assumes one process: here that is the intent."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        yield


def save(
    folder: Path,
    model,
    tokenizer,
    optimizer,
    scheduler,
    state: TrainerState,
    save_total_limit: int | None,
    ranks: Ranks,
    resume: ResumePoint | None = None,
    model_only: bool = False,
) -> Path:
    """The checkpoint of `state.step`; `resume` (rank 0's) is where its prompt stream goes on. `model_only`
    (save_only_model): the model's folder and shards alone, nothing a run resumes from. The best checkpoint
    (`state.best_global_step`) outlives save_total_limit."""
    target = folder / f"checkpoint-{state.step}"
    if state.best_global_step == state.step:
        state.best_model_checkpoint = str(target)
    staging = folder / f".checkpoint-{state.step}.tmp"
    if ranks.main:
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
    ranks.barrier()
    model_state, optimizer_state = get_state_dict(model, optimizer, options=ONLY_TRAINABLE)
    with one_process_is_intended():  # the model's shards even with model_only: load_best_model_at_end reads them
        dcp.save(
            {"model": model_state} if model_only else {"model": model_state, "optimizer": optimizer_state},
            checkpoint_id=str(staging / SHARDS),
        )
    save_model_folder(model, staging, ranks)
    if ranks.main:
        tokenizer.save_pretrained(staging)
        (staging / "trainer_state.json").write_text(
            json.dumps(trainer_state_json(state, base_model_name(model), ranks.world_size, model_only), indent=2)
        )
        if not model_only:
            torch.save(scheduler.state_dict(), staging / "scheduler.pt")
            save_resume_point(staging, resume or ResumePoint(state.dataset_start_index))
        shutil.rmtree(target, ignore_errors=True)
        staging.rename(target)
        rotate(folder, save_total_limit, state.best_model_checkpoint)
    ranks.barrier()
    return target


def trainer_state_json(state: TrainerState, base_model: str, world_size: int, model_only: bool) -> dict:
    """What trainer_state.json holds: the counters a run resumes from, the best checkpoint, the callbacks' state and
    the log history."""
    return {
        "step": state.step,
        "model_version": state.model_version,
        "num_tokens": state.num_tokens,
        "num_input_tokens_seen": state.num_input_tokens_seen,
        "world_size": world_size,
        "base_model": base_model,
        "save_only_model": model_only,
        "best_metric": state.best_metric,
        "best_global_step": state.best_global_step,
        "best_model_checkpoint": state.best_model_checkpoint,
        "stateful_callbacks": state.stateful_callbacks,
        "log_history": state.log_history,
    }


def rotate(folder: Path, save_total_limit: int | None, best: str | None) -> None:
    """Keep the newest `save_total_limit` checkpoints, and the best one whatever its age (as transformers does)."""
    if save_total_limit:
        for old in checkpoints(folder)[:-save_total_limit]:
            if best is None or old.resolve() != Path(best).resolve():
                shutil.rmtree(old, ignore_errors=True)


def base_model_name(model) -> str:
    """The model a run started from, as its checkpoints record it: "tiny" (the shipped model, wherever tandem is
    installed), a local folder's absolute path (the run may have named it relative to another directory) or a hub id."""
    name = model.name_or_path  # a PEFT model answers with its base model's; "" for one built in memory
    if name and Path(name).is_dir():
        return "tiny" if Path(name).resolve() == Path(TINY_MODEL_PATH).resolve() else str(Path(name).resolve())
    return name


def save_resume_point(folder: Path, point: ResumePoint) -> None:
    (folder / "rollout_state.json").write_text(
        json.dumps(
            {
                "dataset_start_index": point.dataset_start_index,
                "finished": point.finished,
                "remaining": {str(prompt_index): left for prompt_index, left in point.remaining.items()},
            },
            indent=2,
        )
    )
    torch.save([asdict(sample) for sample in point.samples], folder / "rollout_queue.pt")


RENAMED_SAMPLE_FIELDS = {
    "logprobs": "behavior_log_probs",
    "sampler_top": "sampler_logprobs",
    "position": "prompt_index",
}
"""Sample fields as a queue saved before one name per concept spelled them (tandem 0.x checkpoints up to the reshaping,
and `position` up to its naming as the prompt index)."""


def load_resume_point(folder: Path) -> ResumePoint:
    """Where the checkpoint's prompt stream goes on (a checkpoint written before the queue was saved: its watermark)."""
    rollout = json.loads((folder / "rollout_state.json").read_text())
    queue = folder / "rollout_queue.pt"
    saved = torch.load(queue, weights_only=True) if queue.is_file() else []
    samples = [
        Sample(**{RENAMED_SAMPLE_FIELDS.get(name, name): value for name, value in fields.items()}) for fields in saved
    ]
    return ResumePoint(
        rollout["dataset_start_index"],
        rollout.get("finished", []),
        {int(prompt_index): left for prompt_index, left in rollout.get("remaining", {}).items()},
        samples,
    )


def checkpoints(folder: Path) -> list[Path]:
    """The checkpoint-N folders in `folder`, oldest (smallest N) first."""
    numbered = [
        (int(m.group(1)), p) for p in folder.glob("checkpoint-*") if p.is_dir() and (m := PATTERN.match(p.name))
    ]
    return [p for _, p in sorted(numbered, key=lambda pair: pair[0])]


class CheckpointNotFound(UsageError, FileNotFoundError):
    """resume_from_checkpoint names no checkpoint tandem can resume: the user's mistake (one line from tandem train), and
    a FileNotFoundError for code that catches those."""


def check_save_on_each_node(save_on_each_node: bool, world_size: int) -> None:
    """save_on_each_node=True holds on one machine, where its first process is rank 0, which writes the checkpoint's
    files either way; on several machines tandem has not run yet, so it stops rather than write where no one asked."""
    machines = world_size // int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    if save_on_each_node and machines > 1:
        raise NotImplementedError(
            f"save_on_each_node=True on {machines} machines: tandem trains on one machine so far, where rank 0 writes "
            "every checkpoint. Run on one machine, or leave save_on_each_node at False."
        )


def resolve(resume_from_checkpoint, output_dir: Path) -> Path | None:
    if resume_from_checkpoint in (None, False):
        return None
    if resume_from_checkpoint is True:
        found = checkpoints(output_dir)
        if not found:
            raise CheckpointNotFound(f"resume_from_checkpoint=True but {output_dir} has no checkpoint-N folder")
        resume_from_checkpoint = found[-1]
    path = Path(resume_from_checkpoint)
    saved = path / "trainer_state.json"
    if saved.is_file() and json.loads(saved.read_text()).get("save_only_model"):
        raise CheckpointNotFound(
            f"{path} was saved with save_only_model=True: it holds the model, not the optimizer and "
            f"the prompt stream a run resumes from. Start a new run from it (model: {path})."
        )
    if not (path / "rollout_state.json").is_file():
        raise CheckpointNotFound(f"{path} is not a tandem checkpoint (no rollout_state.json)")
    if not (path / SHARDS).is_dir():
        raise CheckpointNotFound(
            f"{path} has no {SHARDS}/ folder: it was written before tandem saved training state "
            "through torch.distributed.checkpoint. Start from its model folder instead (model: "
            f"{path}) or from a newer checkpoint."
        )
    return path


def load(path: Path, model, optimizer, scheduler, state: TrainerState) -> None:
    """Weights, optimizer and schedule from checkpoint `path`, resharded to this run's ranks, and its counters into
    `state`; every rank calls it."""
    model_state, optimizer_state = get_state_dict(model, optimizer, options=ONLY_TRAINABLE)
    loaded: dict[str, Any] = {"model": model_state, "optimizer": optimizer_state}  # DCP fills them in place
    with one_process_is_intended():
        dcp.load(loaded, checkpoint_id=str(path / SHARDS))
    # strict=False: the frozen weights are absent by design; DCP has already failed on any trainable one missing
    set_state_dict(
        model,
        optimizer,
        model_state_dict=loaded["model"],
        optim_state_dict=loaded["optimizer"],
        options=StateDictOptions(ignore_frozen_params=True, strict=False),
    )
    scheduler.load_state_dict(torch.load(path / "scheduler.pt", weights_only=True))
    trainer = json.loads((path / "trainer_state.json").read_text())
    rollout = json.loads((path / "rollout_state.json").read_text())
    state.global_step, state.model_version = trainer["step"], trainer["model_version"]
    state.dataset_start_index, state.num_tokens = rollout["dataset_start_index"], trainer.get("num_tokens", 0)
    state.num_input_tokens_seen = trainer.get("num_input_tokens_seen", 0)
    state.log_history = trainer.get("log_history", [])
    state.best_metric, state.best_global_step = trainer.get("best_metric"), trainer.get("best_global_step")
    state.best_model_checkpoint = trainer.get("best_model_checkpoint")
    state.stateful_callbacks = trainer.get("stateful_callbacks", {})


def load_weights(path: Path, model) -> None:
    """The trainable weights of checkpoint `path` into `model`, resharded to this run's ranks (load_best_model_at_end);
    the optimizer and the counters stay as they are. Every rank calls it."""
    model_state = get_model_state_dict(model, options=ONLY_TRAINABLE)
    with one_process_is_intended():
        dcp.load({"model": model_state}, checkpoint_id=str(path / SHARDS))
    set_model_state_dict(model, model_state, options=StateDictOptions(ignore_frozen_params=True, strict=False))


def best_metric_name(name: str) -> str:
    """metric_for_best_model as tandem logs it: 'reward', transformers' 'eval_reward' and 'eval/reward' all name
    eval/reward."""
    return "eval/" + name.removeprefix("eval/").removeprefix("eval_")


def record_if_best(state: TrainerState, metrics: dict, name: str, greater_is_better: bool) -> bool:
    """Whether this evaluation's `name` beats the best so far (then `state` records it and its step, which the
    step's checkpoint will hold); a metric the evaluation lacks is a mistake named with the ones it has."""
    key = best_metric_name(name)
    if key not in metrics:
        raise UsageError(
            f"metric_for_best_model={name!r}: the evaluation logged no {key}; it logged {', '.join(sorted(metrics))}"
        )
    value = metrics[key]
    if math.isnan(value):
        return False
    if state.best_metric is not None and not (
        value > state.best_metric if greater_is_better else value < state.best_metric
    ):
        return False
    state.best_metric, state.best_global_step = value, state.step
    return True


def share_rank0_state(state: TrainerState, ranks: Ranks) -> None:
    """Rank 0's counters into every rank's state before a checkpoint, which every rank writes: where the prompt stream
    goes on (rank 0 reads it) and the best evaluation (rank 0 evaluates)."""
    for name in ("dataset_start_index", "best_metric", "best_global_step"):
        setattr(state, name, ranks.broadcast(getattr(state, name)))
