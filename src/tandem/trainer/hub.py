"""push_to_hub: the run's model uploaded to the Hugging Face Hub through huggingface_hub, in a background thread.

Each checkpoint's model folder goes to the repository's root (hub_strategy every_save); `checkpoint` also puts the
whole latest checkpoint in last-checkpoint/ and `all_checkpoints` each one in checkpoint-N/; `end` uploads only what
`push_to_hub()` sends. Uploads never hold up training: one that fails warns and waits in the queue to be tried again
(RETRY_S, doubling) while training goes on, and a newer upload to the same place replaces it. The token goes to
huggingface_hub and nowhere else: it is never written to disk or printed.
"""

import os
import threading
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

from tandem.trainer.checkpoint import checkpoints

CHECKPOINT_ONLY = ["distributed/*", "scheduler.pt", "rollout_state.json", "rollout_queue.pt", "trainer_state.json"]
"""What a checkpoint holds beyond the model folder: uploaded only to last-checkpoint/ or checkpoint-N/."""
RUN_FILES_KEPT = ["checkpoint-*", ".*", "*/.*", "*.log", "wandb/*"]
"""What `push_to_hub()` leaves out of the output folder: checkpoints (uploaded by their strategy), hidden folders (the
weight syncs' model copies, the rollout tokenizer, staged checkpoints), server logs, and wandb's offline run (`wandb
sync` uploads it)."""
RETRY_S = 30.0


@dataclass
class Upload:
    folder: Path
    path_in_repo: str
    """"" (the repository's root), "last-checkpoint" or "checkpoint-N"."""
    message: str
    ignore: list[str]
    attempts: int = 0
    not_before: float = 0.0


class HubUploader:
    """The uploads of one run, to `repo_id` (created on the first upload, private as asked, on `revision`)."""

    def __init__(self, repo_id: str, token: str | None, private: bool | None, revision: str | None, always_push: bool):
        from huggingface_hub import HfApi  # imported when a run pushes

        self.api = HfApi(endpoint=os.environ.get("HF_ENDPOINT") or None, token=token)
        """HF_ENDPOINT read now, not when huggingface_hub was imported: a mirror or a local stand-in set later counts."""
        self.repo_id, self.private, self.revision = repo_id, private, revision
        self.always_push = always_push
        self.created, self.ending = False, False
        self.queue: list[Upload] = []
        self.running: Upload | None = None
        self.changed = threading.Condition()
        self.thread = threading.Thread(target=self._run, name="tandem-hub-upload", daemon=True)
        self.thread.start()

    def checkpoint_saved(self, folder: Path, step: int, strategy: str) -> None:
        """The uploads hub_strategy asks for after checkpoint `folder` was written (none for 'end')."""
        message = f"Training in progress, step {step}"
        if strategy == "end":
            return
        with self.changed:
            if self.running is not None and not self.always_push:
                warnings.warn(
                    f"push_to_hub: the previous upload is still running, so step {step}'s is skipped "
                    "(hub_always_push=True queues every checkpoint)",
                    stacklevel=2,
                )
                return
        self._add(Upload(folder, "", message, CHECKPOINT_ONLY))
        if strategy == "checkpoint":
            self._add(Upload(folder, "last-checkpoint", message, []))
        elif strategy == "all_checkpoints":
            self._add(Upload(folder, folder.name, message, []))

    def push(self, folder: Path, message: str, blocking: bool) -> None:
        """`folder` (the output folder, its checkpoints left out) to the repository's root; with `blocking`, wait
        until everything queued is uploaded."""
        self._add(Upload(folder, "", message, RUN_FILES_KEPT))
        if blocking:
            self.wait()

    def wait(self) -> None:
        """Until everything queued is uploaded, each waiting upload tried at once; one that fails now is said and
        dropped (the run is ending: nothing would try it again)."""
        with self.changed:
            self.ending = True
            for upload in self.queue:
                upload.not_before = 0.0
            self.changed.notify_all()
            while self.queue or self.running:
                self.changed.wait()
            self.ending = False

    # ---- the thread -----------------------------------------------------------------------------
    def _add(self, upload: Upload) -> None:
        with self.changed:  # a newer upload to the same place replaces one still waiting
            self.queue = [u for u in self.queue if u.path_in_repo != upload.path_in_repo] + [upload]
            self.changed.notify_all()

    def _run(self) -> None:
        while True:
            with self.changed:
                now = time.monotonic()
                ready = [u for u in self.queue if u.not_before <= now]
                if not ready:
                    waits = [u.not_before - now for u in self.queue]
                    self.changed.wait(timeout=min(waits) if waits else None)
                    continue
                self.running = upload = ready[0]
                self.queue.remove(upload)
            failed = self._try(upload)
            with self.changed:
                self.running = None
                if failed and self.ending:
                    warnings.warn(
                        f"push_to_hub: gave up on {self._where(upload)}; upload it yourself: "
                        f"hf upload {self.repo_id} {upload.folder} {upload.path_in_repo or '.'}",
                        stacklevel=2,
                    )
                elif failed:
                    upload.attempts += 1
                    upload.not_before = time.monotonic() + RETRY_S * 2 ** min(upload.attempts - 1, 4)
                    if not any(u.path_in_repo == upload.path_in_repo for u in self.queue):  # none newer came meanwhile
                        self.queue.append(upload)
                self.changed.notify_all()

    def _try(self, upload: Upload) -> bool:
        """One attempt; True when it failed (said as a warning, the token never in it)."""
        if not upload.folder.is_dir():  # rotated out by save_total_limit while waiting: the newest stands in for it
            found = checkpoints(upload.folder.parent)
            if not found:
                return False
            newest = found[-1]
            warnings.warn(
                f"push_to_hub: {upload.folder.name} was removed (save_total_limit) before it was uploaded; "
                f"uploading {newest.name} instead",
                stacklevel=2,
            )
            upload.path_in_repo = newest.name if upload.path_in_repo == upload.folder.name else upload.path_in_repo
            upload.folder, upload.message = newest, f"Training in progress, {newest.name}"
        try:
            self._ensure_repo()
            self.api.upload_folder(
                repo_id=self.repo_id,
                folder_path=upload.folder,
                path_in_repo=upload.path_in_repo or None,
                commit_message=upload.message,
                revision=self.revision,
                ignore_patterns=list(upload.ignore),
            )  # huggingface_hub extends the list it gets
            return False
        except Exception as exc:  # the network, the Hub, a full disk: training goes on, the upload is tried again
            warnings.warn(
                f"push_to_hub: uploading {self._where(upload)} failed ({type(exc).__name__}: "
                f"{str(exc).splitlines()[0][:200]}); it is tried again while training goes on",
                stacklevel=2,
            )
            return True

    def _ensure_repo(self) -> None:
        if self.created:
            return
        url = self.api.create_repo(self.repo_id, private=self.private, exist_ok=True)
        self.repo_id = url.repo_id  # a bare name gets the token's user as its namespace
        if self.revision:
            self.api.create_branch(self.repo_id, branch=self.revision, exist_ok=True)
        self.created = True

    def _where(self, upload: Upload) -> str:
        return f"{upload.folder.name} to {self.repo_id}/{upload.path_in_repo}"
