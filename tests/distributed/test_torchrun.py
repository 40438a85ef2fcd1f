"""Training across processes: `torchrun` with two CPU ranks (gloo, FSDP2) against one process."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from tandem.tasks import TINY_MODEL_PATH
from tandem.trainer.export import export

HERE = Path(__file__).parent
pytestmark = pytest.mark.slow


def run(nproc: int, *args, timeout: float = 400) -> subprocess.CompletedProcess:
    """`torchrun --nproc-per-node nproc ARGS` (plain `python ARGS` for one process); fails with the output."""
    launcher = (
        [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]
        if nproc > 1
        else [sys.executable]
    )
    done = subprocess.run([*launcher, *map(str, args)], capture_output=True, text=True, timeout=timeout)
    return done


def check(done: subprocess.CompletedProcess) -> None:
    assert done.returncode == 0, f"exit {done.returncode}:\n{done.stdout[-3000:]}\n{done.stderr[-6000:]}"


@pytest.mark.parametrize("algorithm", ["grpo", pytest.param("flash_reinforce", marks=pytest.mark.long)])
def test_two_ranks_take_the_same_steps_as_one_process_on_the_same_rows(tmp_path, algorithm):
    check(run(1, HERE / "fixed_rows.py", tmp_path / "one.pt", algorithm))
    check(run(2, HERE / "fixed_rows.py", tmp_path / "two.pt", algorithm))
    one, two = torch.load(tmp_path / "one.pt"), torch.load(tmp_path / "two.pt")
    assert one["losses"] == pytest.approx(two["losses"], rel=1e-5, abs=1e-6)
    initial = AutoModelForCausalLM.from_pretrained(TINY_MODEL_PATH).state_dict()
    assert max((one["weights"][name] - initial[name]).abs().max() for name in one["weights"]) > 1e-4, (
        "the steps trained"
    )
    for name, weight in one["weights"].items():
        torch.testing.assert_close(
            two["weights"][name], weight, atol=1e-5, rtol=0, msg=lambda m, name=name: f"{name}: {m}"
        )


@pytest.mark.long  # covered in parts by faster tests; python -m pytest -q -m long runs it
def test_torchrun_tandem_train_through_the_embedded_server(tmp_path):
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(f"""model: tiny
reward_funcs: tandem.rewards:accuracy_reward
output_dir: {tmp_path / "run"}
max_steps: 4
num_generations: 4
max_completion_length: 6
token_budget: 256
learning_rate: 1.0e-4
max_staleness: 0
weight_sync_check_atol: 1.0e-5
save_steps: 2
vllm_server_timeout: 120
rollout_worker_timeout: 60
""")
    done = run(2, "-m", "tandem", "train", recipe)
    check(done)
    assert done.stdout.count("trained 4 steps") == 1, "rank 0 alone reports"
    rows = [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl")]
    steps = [r for r in rows if "loss" in r]
    assert [r["step"] for r in steps] == [1, 2, 3, 4], "one metrics line per step, written once"
    for r in steps:
        assert abs(r["sampling/importance_sampling_ratio/mean"] - 1.0) < 1e-4
        assert r["weight_sync/served_logprob_gap"] <= 1e-5, "the sharded weights reached the server"
        assert (
            r["batch/row_imbalance"] >= 1.0
            and 0.0 <= r["batch/pad_frac"] < 1.0
            and r["perf/weight_sync_barrier_s"] >= 0.0
        )
    assert not (tmp_path / "run" / ".weights").exists(), "the embedded server takes the weights over gloo, not the disk"
    folder = tmp_path / "run" / "checkpoint-4"
    assert (folder / "distributed" / ".metadata").is_file(), "the training state through torch.distributed.checkpoint"
    weights = {}
    for shard in folder.glob("*.safetensors"):
        weights |= load_file(shard)
    initial = AutoModelForCausalLM.from_pretrained(TINY_MODEL_PATH).state_dict()
    reloaded = AutoModelForCausalLM.from_pretrained(folder).state_dict()
    assert set(weights) == set(initial) - {"lm_head.weight"}, "every weight, the head tied to the embeddings saved once"
    assert max((reloaded[name] - initial[name]).abs().max() for name in weights) > 0, (
        "the checkpoint holds trained weights"
    )


@pytest.mark.long  # covered in parts by faster tests; python -m pytest -q -m long runs it
def test_a_checkpoint_resumes_on_another_number_of_ranks_each_way(tmp_path):
    """Two ranks crash after step 2; one rank resumes from their checkpoint and crashes after step 4; two ranks resume
    from that one and finish the epoch. Each resume finishes exactly what its checkpoint had not."""
    prompts = 64  # enough that the epoch outlasts step 4 however many groups are dropped for equal rewards
    fields = [
        "--max_steps",
        -1,
        "--num_train_epochs",
        1,
        "--save_strategy",
        "steps",
        "--save_steps",
        2,
        "--max_staleness",
        1,
        "--token_budget",
        100,
        "--prompts",
        prompts,
    ]
    for ranks, tag, flags in [(2, "first", ["--crash-after", 2]), (1, "second", ["--resume", "--crash-after", 4])]:
        crashed = run(ranks, HERE / "run_trainer.py", tmp_path, tag, *flags, *fields)
        assert crashed.returncode != 0 and f"simulated crash after step {flags[-1]}" in crashed.stderr, crashed.stderr[
            -2000:
        ]
    check(run(2, HERE / "run_trainer.py", tmp_path, "third", "--resume", *fields))
    finished = {
        tag: json.loads((tmp_path / f"finished-{tag}.json").read_text()) for tag in ("first", "second", "third")
    }
    saved = {
        step: json.loads((tmp_path / "run" / f"checkpoint-{step}" / "rollout_state.json").read_text())
        for step in (2, 4)
    }
    assert 0 < saved[2]["dataset_start_index"] <= saved[4]["dataset_start_index"] < prompts, (
        "both crashes came mid-epoch"
    )
    assert sorted(finished["third"]) == sorted(
        set(range(saved[4]["dataset_start_index"], prompts)) - set(saved[4]["finished"])
    ), "the last resume finishes what its checkpoint had not, each prompt once"
    assert set().union(*finished.values()) == set(range(prompts)), "no prompt of the epoch is skipped"


@pytest.mark.long  # covered in parts by faster tests; python -m pytest -q -m long runs it
def test_lora_under_two_ranks_syncs_the_gathered_adapter(tmp_path):
    example = Path(__file__).parents[2] / "examples" / "lora.yaml"
    check(
        run(
            2,
            "-m",
            "tandem",
            "train",
            example,
            "--output_dir",
            tmp_path / "run",
            "--max_steps",
            2,
            "--weight_sync_check_atol",
            1e-5,
            "--vllm_server_timeout",
            120,
        )
    )
    steps = [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl")]
    gaps = [r["weight_sync/served_logprob_gap"] for r in steps if "loss" in r]
    assert len(gaps) == 2 and max(gaps) <= 1e-5, "the server samples from the adapter both ranks trained"
    assert (tmp_path / "run" / "checkpoint-2" / "adapter_model.safetensors").is_file(), "checkpoints keep the adapter"
    merged = AutoModelForCausalLM.from_pretrained(export(tmp_path / "run" / "checkpoint-2")).state_dict()
    base = AutoModelForCausalLM.from_pretrained(TINY_MODEL_PATH).state_dict()
    assert merged.keys() == base.keys() and any(not torch.equal(merged[k], base[k]) for k in base), (
        "the checkpoint exports as the base model with the adapter both ranks trained merged in"
    )
