"""`tandem export` and `save_model(merged=True)`: a checkpoint as one plain model folder that loads without peft
and computes what the trained model computes."""

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from peft import LoraConfig, PeftModel
from transformers import AutoModelForCausalLM, AutoTokenizer

from tandem import AsyncGRPOConfig, AsyncGRPOTrainer
from tandem.cli import main
from tandem.model.distributed import Ranks
from tandem.runtime.sample_source import ResumePoint
from tandem.tasks import TINY_MODEL_PATH
from tandem.trainer import checkpoint
from tandem.trainer.checkpoint import TrainerState
from tandem.trainer.export import export
from tandem.trainer.optimization import make_optimizer, make_scheduler
from tests.conftest import ServerThread
from tests.runtime.test_weight_sync import lora_model, perturb
from tests.trainer.test_trainer import config, small_dataset

IDS = torch.tensor([[5, 17, 42, 99, 7, 3, 250, 11]])
TRAINING_STATE = {"distributed", "scheduler.pt", "trainer_state.json", "rollout_state.json", "rollout_queue.pt"}


def logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model.eval()(IDS).logits


def assert_same_logits(got: torch.Tensor, expected: torch.Tensor) -> None:
    """W + BA merged rounds apart from W x + B(A x): fp32 rounding relative to the logits' scale (up to ~13 here)."""
    torch.testing.assert_close(got, expected, atol=1e-5 * float(expected.abs().max()), rtol=0)


def save_checkpoint(run_dir: Path, model) -> Path:
    """`model` as a run's checkpoint-3, written the way the trainer writes its checkpoints."""
    args = AsyncGRPOConfig(output_dir=str(run_dir))
    optimizer = make_optimizer(model, args)
    return checkpoint.save(
        run_dir,
        model,
        AutoTokenizer.from_pretrained(TINY_MODEL_PATH),
        optimizer,
        make_scheduler(optimizer, args),
        TrainerState(global_step=3),
        None,
        Ranks(),
        ResumePoint(0),
    )


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory):
    """A LoRA run's checkpoint on the tiny model, its adapter moved away from zero, and the peft model it holds."""
    model = lora_model(seed=1)
    perturb(model, seed=2)
    return save_checkpoint(tmp_path_factory.mktemp("lora") / "run", model), model


def test_a_lora_checkpoint_exports_as_one_plain_model_that_computes_what_the_adapter_does(lora_run):
    folder, trained = lora_run
    assert json.loads((folder / "trainer_state.json").read_text())["base_model"] == "tiny", "the base is recorded"

    merged = export(folder)

    assert merged == folder.parent / "checkpoint-3-merged"
    files = {p.name for p in merged.iterdir()}
    assert {
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
        "chat_template.jinja",
    } <= files
    assert not {f for f in files if f.startswith("adapter")} and not files & TRAINING_STATE, files
    model = AutoModelForCausalLM.from_pretrained(merged, dtype=torch.float32)
    assert not isinstance(model, PeftModel)
    expected = logits(trained)
    assert_same_logits(logits(model), expected)
    base = AutoModelForCausalLM.from_pretrained(TINY_MODEL_PATH, dtype=torch.float32)
    assert (logits(base) - expected).abs().max() > 0.1 * expected.abs().max(), "the adapter changes the logits"


def test_a_full_weight_checkpoint_exports_its_model_and_tokenizer_without_the_training_state(tmp_path):
    model = AutoModelForCausalLM.from_pretrained(TINY_MODEL_PATH, dtype=torch.float32)
    with torch.no_grad():  # trained weights, not the base's: the export must read the checkpoint's
        model.model.layers[0].mlp.up_proj.weight.mul_(2.0)
    folder = save_checkpoint(tmp_path / "run", model)

    exported = export(folder, tmp_path / "model")

    assert not {p.name for p in exported.iterdir()} & TRAINING_STATE
    reloaded = AutoModelForCausalLM.from_pretrained(exported, dtype=torch.float32)
    assert torch.equal(logits(reloaded), logits(model))


def test_save_model_merged_writes_the_export_and_leaves_the_trained_adapter_as_it_is(tmp_path):
    trainer = AsyncGRPOTrainer(
        "tiny",
        lambda completions, **kw: [0.0] * len(completions),
        args=config(tmp_path),
        train_dataset=small_dataset(4),
        peft_config=LoraConfig(r=4, target_modules=["q_proj", "v_proj"]),
    )
    perturb(trainer.model, seed=4)
    before = {name: p.clone() for name, p in trainer.model.named_parameters()}

    trainer.save_model(str(tmp_path / "merged"), merged=True)
    trainer.save_model(str(tmp_path / "as_transformers"), _internal_call=True)  # transformers' Trainer's signature
    assert (tmp_path / "as_transformers" / "adapter_config.json").exists()

    after = dict(trainer.model.named_parameters())
    assert after.keys() == before.keys() and all(torch.equal(after[n], before[n]) for n in before), (
        "the live model is untouched"
    )
    assert not (tmp_path / "merged" / "adapter_config.json").exists()
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32)
    assert_same_logits(logits(merged), logits(trainer.model))


def test_tandem_export_writes_a_folder_that_tandem_serve_serves_the_trained_weights_from(lora_run, tmp_path):
    folder, trained = lora_run
    output = tmp_path / "served"
    output.mkdir()
    (output / "stale.txt").write_text("an earlier export")

    done = subprocess.run(
        [sys.executable, "-m", "tandem", "export", str(folder), "--output", str(output), "--force"],
        capture_output=True,
        text=True,
        timeout=300,
    )

    assert done.returncode == 0 and done.stdout.strip() == f"tandem export: wrote {output}", done.stderr
    assert not (output / "stale.txt").exists(), "--force replaces the folder"
    server = ServerThread(str(output))
    try:
        status, body = server.post(
            "/v1/completions",
            {
                "prompt": IDS[0].tolist(),
                "max_tokens": 6,
                "temperature": 0.0,
                "ignore_eos": True,
                "logprobs": 0,
                "return_token_ids": True,
            },
        )
    finally:
        server.close()
    assert status == 200, body
    choice = body["choices"][0]
    completion = choice["token_ids"]
    with torch.no_grad():  # the trained peft model's log-probs of the served tokens, teacher-forced
        scores = (
            trained.eval()(torch.tensor([IDS[0].tolist() + completion]))
            .logits[0, IDS.shape[1] - 1 : -1]
            .log_softmax(-1)
        )
    expected = scores[torch.arange(len(completion)), completion]
    torch.testing.assert_close(torch.tensor(choice["logprobs"]["token_logprobs"]), expected, atol=1e-4, rtol=0)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["{run}/checkpoint-9"], r"{run}/checkpoint-9 is not a tandem checkpoint \(no trainer_state.json\)\. Give a"),
        (["{run}"], r"{run} is not a tandem checkpoint .*did you mean {run}/checkpoint-3\?"),
        (["{run}/checkpoint-3", "--output", "{run}"], r"--output {run} would replace the checkpoint"),
        (["{run}/checkpoint-3", "--output", "{tmp}"], r"--output {tmp} exists and is not empty\. .*--force"),
        (
            ["{run}/checkpoint-3", "--output", "{tmp}/new", "--base-model", "/nowhere/base"],
            r"cannot load the base model '/nowhere/base' .*\(no such folder\)",
        ),
    ],
)
def test_an_export_mistake_is_one_line_naming_the_path_and_the_fix(lora_run, argv, message, tmp_path, capsys):
    run = lora_run[0].parent
    (tmp_path / "an earlier export").write_text("")
    with pytest.raises(SystemExit) as stop:
        main(["export", *(a.format(run=run, tmp=tmp_path) for a in argv)])
    error = capsys.readouterr().err
    assert stop.value.code == 2 and len(error.splitlines()) == 1, error
    assert re.match("tandem export: " + message.format(run=re.escape(str(run)), tmp=re.escape(str(tmp_path))), error), (
        error
    )
