"""`tandem proxy` in front of two real vLLM replicas: prefix affinity, adapter loads on every replica or none, and a
replica killed with SIGKILL and brought back while the proxy keeps serving."""

import json
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM

from tandem.generation.client import parse_prometheus
from tandem.runtime.weight_transfer import free_port
from tandem.tasks import TINY_MODEL_PATH


def call(url: str, path: str, body: dict | None = None, timeout_s: float = 60) -> tuple[int, dict | str]:
    request = urllib.request.Request(
        url + path,
        data=json.dumps(body).encode() if body is not None else None,
        headers={"Content-Type": "application/json"},
        method="POST" if body is not None else "GET",
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as answer:
            status, text = answer.status, answer.read().decode()
    except urllib.error.HTTPError as error:
        status, text = error.code, error.read().decode()
    try:
        return status, json.loads(text)
    except json.JSONDecodeError:
        return status, text


def served(url: str) -> set[str]:
    return {card["id"] for card in call(url, "/v1/models")[1]["data"]}


def prefix_hits(url: str) -> float:
    _, text = call(url, "/metrics")
    return sum(value for name, _, value in parse_prometheus(text) if name == "vllm:prefix_cache_hits_total")


@pytest.fixture
def proxy(vllm_pair, tmp_path):
    port = free_port("127.0.0.1")
    upstreams = [arg for server in vllm_pair for arg in ("--upstream", server.url)]
    log = open(tmp_path / "proxy.log", "wb")
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tandem",
            "proxy",
            *upstreams,
            "--port",
            str(port),
            "--stats-interval-s",
            "0",
            "--block-size",
            "128",
            "--lora-load-timeout-s",
            "5",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}"
    for _ in range(100):
        try:
            if call(url, "/health", timeout_s=5)[0] == 200:
                break
        except OSError:
            time.sleep(0.2)
    yield url
    process.terminate()
    process.wait(10)
    log.close()


@pytest.fixture(scope="module")
def adapter(tmp_path_factory) -> str:
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(TINY_MODEL_PATH)
    peft = get_peft_model(
        model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    )
    folder = tmp_path_factory.mktemp("adapter") / "a"
    peft.save_pretrained(folder)
    return str(folder)


def routed(url: str) -> list[int]:
    return [u["routed"] for u in call(url, "/proxy/stats")[1]["upstreams"]]


def test_the_same_prefix_sticks_to_one_replica_and_distinct_ones_spread(proxy, vllm_pair):
    prompt = [3 + i % 380 for i in range(300)]  # two of vLLM's CPU blocks (128 tokens) and a partial one
    before, hits = routed(proxy), [prefix_hits(s.url) for s in vllm_pair]
    for seed in range(4):
        status, body = call(
            proxy, "/v1/completions", {"model": TINY_MODEL_PATH, "prompt": prompt, "max_tokens": 2, "seed": seed}
        )
        assert status == 200, body
    took = [after - b for after, b in zip(routed(proxy), before)]
    assert sorted(took) == [0, 4], f"one replica takes every request of a prefix: {took}"
    sticky = took.index(4)
    assert prefix_hits(vllm_pair[sticky].url) - hits[sticky] >= 3 * 256, "vLLM served the repeats from its prefix cache"
    before = routed(proxy)
    for start in range(8):
        call(
            proxy,
            "/v1/completions",
            {"model": TINY_MODEL_PATH, "prompt": [3 + (start * 41 + i) % 380 for i in range(140)], "max_tokens": 1},
        )
    spread = [after - b for after, b in zip(routed(proxy), before)]
    assert min(spread) >= 2, f"distinct prefixes spread over both replicas: {spread}"


def test_an_adapter_loads_on_every_replica_or_on_none(proxy, vllm_pair, adapter):
    status, body = call(proxy, "/v1/load_lora_adapter", {"lora_name": "good", "lora_path": adapter})
    assert status == 200, body
    assert all("good" in served(s.url) for s in vllm_pair)
    status, body = call(proxy, "/v1/load_lora_adapter", {"lora_name": "bad", "lora_path": adapter + "-missing"})
    # vLLM answers 404 "No adapter found"; the proxy retries that (a replica may see a shared folder late), then gives up
    assert status == 504 and "No adapter found" in body["error"]["message"], body
    assert not any("bad" in served(s.url) for s in vllm_pair)
    assert call(proxy, "/v1/unload_lora_adapter", {"lora_name": "good"})[0] == 200
    assert not any("good" in served(s.url) for s in vllm_pair)


def test_a_replica_killed_mid_run_is_left_out_then_caught_up_when_it_returns(proxy, vllm_pair, adapter):
    survivor, victim = vllm_pair
    victim.kill()
    for seed in range(6):  # every request is answered: the dead replica's share goes to the other
        status, body = call(
            proxy, "/v1/completions", {"model": TINY_MODEL_PATH, "prompt": list(range(3, 40 + seed)), "max_tokens": 2}
        )
        assert status == 200, body
    status, body = call(proxy, "/v1/load_lora_adapter", {"lora_name": "meanwhile", "lora_path": adapter})
    assert status == 200, body
    victim.launch().wait()
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and [u["state"] for u in call(proxy, "/proxy/stats")[1]["upstreams"]] != [
        "up",
        "up",
    ]:
        time.sleep(1)
    assert "meanwhile" in served(victim.url), (
        "the replica that came back was given the adapter loaded while it was down"
    )
    assert call(proxy, "/v1/unload_lora_adapter", {"lora_name": "meanwhile"})[0] == 200
