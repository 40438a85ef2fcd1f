"""`torchrun` with one rank on each of two hosts, the embedded server beside rank 0; then the run resumed on one host."""

import sys

import pytest

from tests.hosts.conftest import check, metrics, recipe, tandem

pytestmark = pytest.mark.hosts


def test_two_hosts_train_under_torchrun_with_nothing_set_and_the_run_resumes_on_one(network, tmp_path):
    first, second = network(2)
    task = recipe(tmp_path / "recipe.yaml", max_steps=4, save_strategy="steps", save_steps=2)

    def node(rank: int) -> list[str]:
        return [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nnodes=2",
            "--nproc-per-node=1",
            f"--node-rank={rank}",
            f"--master-addr={first.address}",
            "--master-port=29500",
            "-m",
            "tandem",
            "train",
            str(task),
        ]

    other = second.popen(node(1), tmp_path / "rank1.log")
    done = first.run(node(0), timeout=400)
    check(done, "rank 0 of two hosts")
    assert other.wait(timeout=60) == 0, (tmp_path / "rank1.log").read_text()[-3000:]
    steps = metrics(tmp_path / "run")
    assert [r["step"] for r in steps] == [1, 2, 3, 4], "one metrics line per step, from rank 0"
    for row in steps:  # two ranks' sharded forward rounds apart from the server's by float32 noise only
        assert abs(row["sampling/importance_sampling_ratio/mean"] - 1.0) < 1e-4
        assert row["weight_sync/served_logprob_gap"] <= 1e-5, "the weights gathered from both hosts are served"
    resumed = first.run(tandem("train", task, "--max_steps", 6, "--resume_from_checkpoint", "true"), timeout=300)
    check(resumed, "the two-host run resumed on one host")
    assert [r["step"] for r in metrics(tmp_path / "run")][-2:] == [5, 6], "it went on from step 4's checkpoint"
