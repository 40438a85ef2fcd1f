"""`torchrun` with one rank on each of two hosts, the embedded server beside rank 0; then the run resumed on one host."""

import sys

import pytest

from tests.hosts.conftest import check, metrics, recipe, serve, tandem

pytestmark = pytest.mark.hosts


def node(rank: int, master, task, *fields: str) -> list[str]:
    """torchrun's command for node `rank` of two, one rank each, meeting at `master`'s address."""
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes=2",
        "--nproc-per-node=1",
        f"--node-rank={rank}",
        f"--master-addr={master.address}",
        "--master-port=29500",
        "-m",
        "tandem",
        "train",
        str(task),
        *fields,
    ]


def train_on_two_hosts(first, second, task, tmp_path) -> list[dict]:
    other = second.popen(node(1, first, task), tmp_path / "rank1.log")
    check(first.run(node(0, first, task), timeout=400), "rank 0 of two hosts")
    assert other.wait(timeout=60) == 0, (tmp_path / "rank1.log").read_text()[-3000:]
    steps = metrics(tmp_path / "run")
    assert [r["step"] for r in steps] == [1, 2, 3, 4], "one metrics line per step, from rank 0"
    for row in steps:  # two ranks' sharded forward rounds apart from the server's by float32 noise only
        assert abs(row["sampling/importance_sampling_ratio/mean"] - 1.0) < 1e-4
        assert row["weight_sync/served_logprob_gap"] <= 1e-5, "the weights gathered from both hosts are served"
    return steps


def test_two_hosts_train_under_torchrun_with_nothing_set_and_the_run_resumes_on_one(network, tmp_path):
    first, second = network(2)
    task = recipe(tmp_path / "recipe.yaml", max_steps=4, save_strategy="steps", save_steps=2)
    train_on_two_hosts(first, second, task, tmp_path)
    resumed = first.run(tandem("train", task, "--max_steps", 6, "--resume_from_checkpoint", "true"), timeout=300)
    check(resumed, "the two-host run resumed on one host")
    assert [r["step"] for r in metrics(tmp_path / "run")][-2:] == [5, 6], "it went on from step 4's checkpoint"


def test_ranks_on_two_hosts_stream_their_weights_to_a_server_on_a_third(network, tmp_path):
    """torchrun binds its own groups by the route to --master-addr; the weight stream still binds by its own rule."""
    first, second, server = network(3)
    url = serve(server, tmp_path / "serve.log", "--weight-transfer-config", '{"backend": "gloo"}')
    train_on_two_hosts(first, second, recipe(tmp_path / "recipe.yaml", vllm_server_base_url=url), tmp_path)
