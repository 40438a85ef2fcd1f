"""What a run saves and where: the best checkpoint (metric_for_best_model, save_strategy='best',
load_best_model_at_end, kept by save_total_limit), model-only checkpoints, callbacks' state through a resume, and
uploads to the Hugging Face Hub (a local stand-in of its routes)."""

import json
import shutil
import time
import warnings

import pytest
import torch
from datasets import Dataset
from safetensors.torch import load_file
from transformers import EarlyStoppingCallback

from tandem import AsyncGRPOTrainer, UsageError
from tandem.rewards import accuracy_reward
from tandem.tasks import arithmetic
from tests.trainer.hub_standin import HubStandIn
from tests.trainer.test_trainer import config

pytestmark = pytest.mark.slow

TOKEN = "hf_standin_secret_token_0123456789"
PROMPTS = Dataset.from_list(arithmetic.make_rows(8, split="train", seed=3))
HELD_OUT = Dataset.from_list(arithmetic.make_rows(2, split="test", seed=5))
BEST_IS_THE_FIRST = dict(
    eval_strategy="steps",
    eval_steps=1,
    metric_for_best_model="model_version",
    greater_is_better=False,
    learning_rate=1e-2,
    max_staleness=0,
)
"""Every step evaluates its freshly synced policy; ranked by the policy version with the smaller the better, the
first evaluation is the best one for the rest of the run: a best checkpoint known in advance."""


def weights(model) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in model.named_parameters()}


@pytest.mark.long  # save_strategy, save_only_model and checkpoints are tested in parts in test_checkpoint.py
def test_save_strategy_best_and_save_only_model_keep_the_best_model_and_load_best_model_at_end_loads_it(tmp_path):
    args = config(
        tmp_path,
        max_steps=3,
        save_strategy="best",
        save_only_model=True,
        load_best_model_at_end=True,
        **BEST_IS_THE_FIRST,
    )
    trainer = AsyncGRPOTrainer("tiny", accuracy_reward, args=args, train_dataset=PROMPTS, eval_dataset=HELD_OUT)
    trainer.train()
    run = tmp_path / "run"
    assert sorted(p.name for p in run.glob("checkpoint-*")) == ["checkpoint-1"], "saved only when an evaluation is best"
    best = run / "checkpoint-1"
    assert trainer.state.best_model_checkpoint == str(best) and trainer.state.best_metric == 1
    assert not (best / "scheduler.pt").exists() and not (best / "rollout_state.json").exists(), "save_only_model"
    saved = load_file(best / "model.safetensors")
    now = weights(trainer.model)
    assert all(torch.equal(now[name], saved[name]) for name in saved), "load_best_model_at_end: step 1's weights"
    assert json.loads((best / "trainer_state.json").read_text())["best_global_step"] == 1
    with pytest.raises(UsageError, match="save_only_model=True: it holds the model, not the optimizer"):
        AsyncGRPOTrainer("tiny", accuracy_reward, args=config(tmp_path, max_steps=4), train_dataset=PROMPTS).train(
            resume_from_checkpoint=str(best)
        )


@pytest.mark.long  # covered in parts by faster tests; python -m pytest -q -m long runs it
def test_push_to_hub_uploads_in_the_background_retries_never_writes_the_token_and_callbacks_resume_their_state(
    tmp_path, monkeypatch
):
    hub = HubStandIn()
    hub.fail_commits = 1  # the first upload fails: a warning, and the next try succeeds while training goes on
    monkeypatch.setenv("HF_ENDPOINT", hub.url)
    monkeypatch.setattr("tandem.trainer.hub.RETRY_S", 0.2)
    stopper = EarlyStoppingCallback(early_stopping_patience=5)
    args = config(
        tmp_path,
        max_steps=2,
        save_strategy="steps",
        save_steps=1,
        save_total_limit=1,
        load_best_model_at_end=True,
        push_to_hub=True,
        hub_model_id="me/tiny-grpo",
        hub_token=TOKEN,
        hub_private_repo=True,
        hub_revision="dev",
        hub_strategy="checkpoint",
        **BEST_IS_THE_FIRST,
    )
    trainer = AsyncGRPOTrainer(
        "tiny", accuracy_reward, args=args, train_dataset=PROMPTS, eval_dataset=HELD_OUT, callbacks=[stopper]
    )
    with pytest.warns(UserWarning, match="push_to_hub: uploading checkpoint-1 to me/tiny-grpo/ failed .*tried again"):
        trainer.train()
    run = tmp_path / "run"
    assert sorted(p.name for p in run.glob("checkpoint-*")) == ["checkpoint-1", "checkpoint-2"], (
        "save_total_limit=1 keeps the newest and the best"
    )
    assert stopper.early_stopping_patience_counter == 1, "EarlyStoppingCallback reads eval/* as transformers' eval_*"

    assert hub.repos["me/tiny-grpo"]["visibility"] == "private" and ("me/tiny-grpo", "dev") in hub.branches
    uploaded = hub.paths("me/tiny-grpo", "dev")
    assert {"model.safetensors", "config.json", "tokenizer.json"} <= uploaded, "each checkpoint's model at the root"
    assert not any(path.startswith("distributed/") for path in uploaded), "the training state only in last-checkpoint/"
    assert {"last-checkpoint/trainer_state.json", "last-checkpoint/scheduler.pt"} <= uploaded
    step_2 = json.loads(hub.files[("me/tiny-grpo", "dev", "last-checkpoint/trainer_state.json")])
    assert step_2["step"] == 2, "the latest checkpoint replaces the one whose upload failed"
    assert [message for *_, message in hub.commits][-2:] == ["Training in progress, step 2"] * 2

    resumed = AsyncGRPOTrainer(
        "tiny",
        accuracy_reward,
        train_dataset=PROMPTS,
        eval_dataset=HELD_OUT,
        args=config(
            tmp_path,
            **{**vars(args), "max_steps": 3, "output_dir": str(run), "restore_callback_states_from_checkpoint": True},
        ),
        callbacks=[EarlyStoppingCallback(early_stopping_patience=5)],
    )
    resumed.train(resume_from_checkpoint=True)
    restored = next(c for c in resumed.callback_handler.callbacks if isinstance(c, EarlyStoppingCallback))
    assert restored.early_stopping_patience_counter == 2, "restored at 1 from checkpoint-2, then step 3 did not improve"

    resumed.push_to_hub(commit_message="the end")
    assert hub.commits[-1] == ("me/tiny-grpo", "dev", "the end")
    final = hub.paths("me/tiny-grpo", "dev")
    assert {"run_config.json", "metrics.jsonl"} <= final and not any(p.startswith("checkpoint-") for p in final)
    assert json.loads(hub.files[("me/tiny-grpo", "dev", "config.json")])["model_type"], "the model's config at the root"
    assert hub.tokens == {TOKEN}, "every request carries the token"
    written = [p for p in run.rglob("*") if p.is_file() and TOKEN.encode() in p.read_bytes()]
    assert written == [], f"the token was written to {written}"
    assert json.loads((run / "run_config.json").read_text())["hub_token"] == "***"


def test_the_best_metric_is_named_as_transformers_users_name_it_and_a_missing_one_is_a_usage_error():
    from tandem.trainer.checkpoint import TrainerState, best_metric_name, record_if_best

    assert {best_metric_name(n) for n in ("reward", "eval_reward", "eval/reward")} == {"eval/reward"}
    state = TrainerState()
    state.global_step = 3
    assert record_if_best(state, {"eval/reward": 0.5}, "reward", greater_is_better=True)
    state.global_step = 4
    assert not record_if_best(state, {"eval/reward": 0.4}, "reward", greater_is_better=True)
    assert not record_if_best(state, {"eval/reward": float("nan")}, "reward", greater_is_better=True)
    assert (state.best_metric, state.best_global_step) == (0.5, 3)
    with pytest.raises(UsageError, match=r"metric_for_best_model='accuracy': the evaluation logged no eval/accuracy"):
        record_if_best(state, {"eval/reward": 0.5}, "accuracy", greater_is_better=True)


def test_hub_always_push_queues_a_checkpoint_while_an_upload_runs_and_hub_strategy_picks_the_folders(
    tmp_path, monkeypatch
):
    from tandem.trainer.hub import HubUploader

    hub = HubStandIn()
    hub.commit_delay_s = 0.5  # an upload still running when the next checkpoint is saved
    monkeypatch.setenv("HF_ENDPOINT", hub.url)
    folders = []
    for step in (1, 2):
        folder = tmp_path / f"checkpoint-{step}"
        (folder / "distributed").mkdir(parents=True)
        (folder / "model.safetensors").write_bytes(b"weights %d" % step)
        (folder / "distributed" / "shard").write_bytes(b"state")
        folders.append(folder)
    for always_push, expected in (
        (False, {"model.safetensors", "checkpoint-1/model.safetensors", "checkpoint-1/distributed/shard"}),
        (
            True,
            {
                "model.safetensors",
                "checkpoint-1/model.safetensors",
                "checkpoint-2/model.safetensors",
                "checkpoint-1/distributed/shard",
                "checkpoint-2/distributed/shard",
            },
        ),
    ):
        repo = f"me/always-{always_push}"
        uploader = HubUploader(repo, TOKEN, private=None, revision=None, always_push=always_push)
        uploader.checkpoint_saved(folders[0], 1, "all_checkpoints")
        deadline = time.monotonic() + 10
        while uploader.running is None and time.monotonic() < deadline:
            time.sleep(0.01)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            uploader.checkpoint_saved(folders[1], 2, "all_checkpoints")
            uploader.checkpoint_saved(folders[1], 2, "end")  # 'end': checkpoints are not uploaded
        uploader.wait()
        assert hub.paths(repo, "main") == expected, f"hub_always_push={always_push}"
        assert any("still running" in str(w.message) for w in caught) != always_push
        assert hub.files[(repo, "main", "model.safetensors")] == (b"weights 2" if always_push else b"weights 1")


def test_a_checkpoint_rotated_out_before_its_upload_is_uploaded_as_the_newest_one_instead(tmp_path, monkeypatch):
    from tandem.trainer.hub import HubUploader

    hub = HubStandIn()
    hub.fail_commits = 1
    monkeypatch.setenv("HF_ENDPOINT", hub.url)
    monkeypatch.setattr("tandem.trainer.hub.RETRY_S", 0.5)
    first, second = tmp_path / "checkpoint-1", tmp_path / "checkpoint-2"
    first.mkdir()
    (first / "model.safetensors").write_bytes(b"weights 1")
    uploader = HubUploader("me/rotated", TOKEN, private=None, revision=None, always_push=False)
    with pytest.warns(UserWarning) as caught:
        uploader.checkpoint_saved(first, 1, "every_save")
        deadline = time.monotonic() + 10
        while not any(u.attempts for u in uploader.queue) and time.monotonic() < deadline:
            time.sleep(0.01)  # the first try failed; the upload waits to be tried again
        shutil.rmtree(first)  # save_total_limit removed it meanwhile; checkpoint-2's own upload was skipped
        second.mkdir()
        (second / "model.safetensors").write_bytes(b"weights 2")
        uploader.wait()
    assert hub.files[("me/rotated", "main", "model.safetensors")] == b"weights 2"
    assert any(
        "checkpoint-1 was removed (save_total_limit) before it was uploaded; uploading checkpoint-2 instead"
        in str(w.message)
        for w in caught
    )
