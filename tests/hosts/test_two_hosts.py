"""The trainer on one host, `tandem serve` on another: each way of syncing the weights across the network."""

import time

import pytest

from tandem.contract.staleness import StalenessPolicy
from tandem.runtime.weight_sync import lora_server_flags
from tests.hosts.conftest import check, metrics, recipe, serve, tandem, wait_healthy

pytestmark = pytest.mark.hosts


LORA = {"r": 8, "lora_alpha": 16, "lora_dropout": 0.0, "target_modules": ["q_proj", "v_proj"]}
SYNCS = {  # server flags, recipe fields, and how far from 1 the importance ratio may be at staleness 0
    "transfer": (["--weight-transfer-config", '{"backend": "gloo"}'], {}, 0.0),  # the gloo stream
    "reload": ([], {}, 0.0),  # the trainer writes the weights into the shared folder, the server reloads them
    # LoRA on tandem serve rounds up to ~1e-5 apart from the trainer on one host too (the sampler side, batch-dependent)
    "lora": (lora_server_flags(StalenessPolicy(0), 8), {"lora": LORA}, 1e-4),
}


@pytest.mark.parametrize("sync", SYNCS)
def test_each_sync_crosses_hosts_with_nothing_but_the_server_url_set(network, tmp_path, sync):
    trainer, server = network(2)
    flags, fields, off = SYNCS[sync]
    url = serve(server, tmp_path / "serve.log", *flags)
    done = trainer.run(
        tandem("train", recipe(tmp_path / "recipe.yaml", vllm_server_base_url=url, **fields)), timeout=400
    )
    check(done, f"training against a server on another host, synced by {sync}")
    steps = metrics(tmp_path / "run")
    assert [r["step"] for r in steps] == [1, 2, 3, 4]
    for row in steps:  # staleness 0 on an fp32 server: every sample is the trainer's own policy's
        ratios = row["sampling/importance_sampling_ratio/min"], row["sampling/importance_sampling_ratio/max"]
        assert all(abs(ratio - 1.0) <= off for ratio in ratios), f"step {row['step']}: importance ratios {ratios}"
        assert row["weight_sync/served_logprob_gap"] <= 1e-5, "the new weights are served"


def test_a_server_that_cannot_reach_the_trainer_stops_the_run_in_one_line_within_30_s(network, tmp_path):
    trainer, server = network(2)
    trainer.add_address("10.231.8.1")  # a second address of the trainer's host...
    server.blackhole("10.231.8.1")  # ...that the server's host cannot reach, while HTTP to the server works
    url = serve(server, tmp_path / "serve.log", "--weight-transfer-config", '{"backend": "gloo"}')
    wait_healthy(trainer, url, 120)  # the run's 30 s start with the run, not with the server
    task = recipe(tmp_path / "recipe.yaml", vllm_server_base_url=url, weight_transfer_address="10.231.8.1")
    started = time.monotonic()
    done = trainer.run(tandem("train", task), timeout=120)
    took = time.monotonic() - started
    last = done.stderr.strip().splitlines()[-1]
    assert done.returncode != 0 and last.startswith(
        "tandem train: weight transfer: the server cannot reach 10.231.8.1:"
    ), done.stderr[-3000:]
    assert "weight_transfer_address" in last and "10.231.0.1" in last, "the fix names an address the server can reach"
    assert took < 30, f"the run took {took:.0f} s to say so"


def test_a_trainer_with_no_route_to_the_server_says_so_at_once(network, tmp_path):
    trainer, server = network(2)
    url = serve(server, tmp_path / "serve.log")
    wait_healthy(trainer, url, 120)
    trainer.blackhole(server.address)
    started = time.monotonic()
    done = trainer.run(tandem("train", recipe(tmp_path / "recipe.yaml", vllm_server_base_url=url)), timeout=120)
    last = done.stderr.strip().splitlines()[-1]
    assert done.returncode != 0 and last.startswith(
        f"tandem train: this machine cannot reach the generation server at {url}"
    ), done.stderr[-3000:]
    assert f"no route from this machine to {server.address}" in last
    assert time.monotonic() - started < 30, "said before any wait for the server"
