"""`tandem proxy` on its own host in front of two `tandem serve` replicas on another, the trainer on a third: training
through it while one replica is killed and comes back."""

import os
import signal

import pytest

from tandem.tasks import TINY_MODEL_PATH
from tests.conftest import STREAMED_REPLICA
from tests.hosts.conftest import get_json, metrics, recipe, tandem, wait_for

pytestmark = pytest.mark.hosts


def test_training_through_a_proxy_on_another_host_outlives_a_replica_killed_and_brought_back(network, tmp_path):
    trainer, proxy, replicas = network(3)
    urls = [f"http://{replicas.address}:{port}" for port in (8101, 8102)]

    def replica(index: int):
        port = urls[index].rsplit(":", 1)[1]
        flags = ["--host", replicas.address, "--port", port, *STREAMED_REPLICA]
        log = tmp_path / f"replica{index}.log"
        return replicas.popen(tandem("serve", TINY_MODEL_PATH, *flags), log, env={"OMP_NUM_THREADS": "1"})

    started = [replica(0), replica(1)]
    upstreams = [flag for url in urls for flag in ("--upstream", url)]
    proxy.popen(
        tandem("proxy", *upstreams, "--host", proxy.address, "--port", 8100, "--tokenizer", TINY_MODEL_PATH),
        tmp_path / "proxy.log",
    )
    task = recipe(
        tmp_path / "recipe.yaml",
        model=TINY_MODEL_PATH,
        vllm_server_base_url=f"http://{proxy.address}:8100",
        max_steps=60,
        token_budget=100,
    )
    run = trainer.popen(tandem("train", task), tmp_path / "train.log")
    logged = tmp_path / "run" / "metrics.jsonl"
    wait_for(
        lambda: run.poll() is not None or logged.exists() and len(metrics(tmp_path / "run")) >= 2, 300, "two steps"
    )
    assert run.poll() is None, (tmp_path / "train.log").read_text()[-4000:]
    os.killpg(started[1].pid, signal.SIGKILL)  # kill -9 of replica 1, mid-run
    started[1].wait()
    replica(1)  # back on its port a moment later
    assert run.wait(timeout=400) == 0, (tmp_path / "train.log").read_text()[-4000:]
    steps = metrics(tmp_path / "run")
    assert len(steps) == 60
    assert sum(r.get("rollout/server_reconnect_count", 0) for r in steps) == 2, (
        "the transfer group formed without replica 1, then with it again"
    )
    stats = get_json(trainer, f"http://{proxy.address}:8100/proxy/stats")
    assert [u["state"] for u in stats["upstreams"]] == ["up", "up"], stats
    for row in steps:
        assert abs(row["sampling/importance_sampling_ratio/mean"] - 1.0) < 1e-4, "exactly on-policy throughout"
        assert row.get("weight_sync/served_logprob_gap", 0.0) <= 1e-5
