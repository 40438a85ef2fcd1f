"""The trained model written out: as a model folder (`save_model`, a LoRA adapter merged into its base on request),
restored from a checkpoint at the start of a run, and uploaded to the Hub (the uploader a run keeps)."""

import tempfile
import warnings
from pathlib import Path

from tandem.config import AsyncGRPOConfig
from tandem.model.distributed import Ranks
from tandem.model.model_folder import save_model_folder
from tandem.runtime.sample_source import ResumePoint
from tandem.trainer import checkpoint, export
from tandem.trainer.callbacks import Callbacks
from tandem.trainer.hub import HubUploader
from tandem.trainer.model import served_dtype


def save_model(model, tokenizer, target: Path, ranks: Ranks, merge_adapter: bool) -> None:
    """The model (or its LoRA adapter) and tokenizer as a folder transformers, vLLM and `tandem serve` load; with
    `merge_adapter`, the adapter merged into a fresh copy of the base read from its folder into host memory, so the
    trained model is left as it is. Every rank calls it; rank 0 writes (and merges)."""
    if not merge_adapter:
        save_model_folder(model, target, ranks)
        if ranks.main:
            tokenizer.save_pretrained(target)
        return
    with tempfile.TemporaryDirectory() as adapter:
        save_model_folder(model, Path(adapter), ranks)  # gathered whole, on rank 0
        if ranks.main:
            merged = export.merge_adapter(Path(adapter), checkpoint.base_model_name(model), served_dtype(model))
            export.write(merged, tokenizer, target)
    ranks.barrier()


def restore(
    resume: Path | None, model, optimizer, scheduler, callbacks: Callbacks, args: AsyncGRPOConfig
) -> ResumePoint:
    """Weights, optimizer, schedule and counters from the checkpoint `resume` (resharded to this run's ranks), into
    the callbacks' state; returns where its prompt stream goes on (the beginning without a checkpoint)."""
    if resume is None:
        return ResumePoint(0)
    checkpoint.load(resume, model, optimizer, scheduler, callbacks.state)
    if args.restore_callback_states_from_checkpoint:
        unmatched = callbacks.restore(callbacks.state.stateful_callbacks)
        if unmatched:
            warnings.warn(
                f"{resume} holds the state of callbacks this run does not have, left alone: {', '.join(unmatched)}",
                stacklevel=3,
            )
    return checkpoint.load_resume_point(resume)


def uploader(
    current: HubUploader | None, args: AsyncGRPOConfig, output_dir: Path, token: str | None, revision: str | None
) -> HubUploader:
    """The run's Hub uploader, started with its first upload; a push with its own token or revision gets one of its
    own, after what the run's uploader has queued."""
    if current is not None and not (token or revision):
        return current
    if current is not None:
        current.wait()
    return HubUploader(
        args.hub_model_id or output_dir.resolve().name,
        token or args.hub_token,
        args.hub_private_repo,
        revision or args.hub_revision,
        args.hub_always_push,
    )
