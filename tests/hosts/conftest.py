"""Fixtures of the `hosts` tier: simulated hosts (network.py), and what runs on them as a user runs it."""

import json
import os
import sys
import time
from pathlib import Path

import pytest
import yaml

from tests.hosts.network import Network, available, sweep

PORT = 8100
"""Every host has its own ports: a fixed one is free on each."""


@pytest.fixture
def network():
    """`network(count)` -> the hosts, removed with everything left inside them when the test ends. Skipped where this
    machine refuses namespaces, except under CI (`.ci/run`), where that is a failure."""
    why = available()
    if why:
        if os.environ.get("CI"):
            pytest.fail(why)
        pytest.skip(why)
    sweep()
    made: list[Network] = []

    def make(count: int):
        made.append(Network(count))
        return made[-1].__enter__()

    yield make
    for net in made:
        net.remove()


def tandem(*args: str) -> list[str]:
    return [sys.executable, "-m", "tandem", *map(str, args)]


def serve(host, log: Path, *flags: str, port: int = PORT) -> str:
    """`tandem serve tiny` on `host`, bound to its address; returns its URL (the trainer waits for it to answer)."""
    host.popen(tandem("serve", "tiny", "--host", host.address, "--port", port, *flags), log)
    return f"http://{host.address}:{port}"


def recipe(path: Path, **fields) -> Path:
    """A short demo-task recipe at `path` (fields override it)."""
    values = {
        "model": "tiny",
        "reward_funcs": "tandem.rewards:accuracy_reward",
        "output_dir": str(path.parent / "run"),
        "max_steps": 4,
        "num_generations": 4,
        "max_completion_length": 6,
        "token_budget": 256,
        "learning_rate": 1.0e-4,
        "max_staleness": 0,
        "weight_sync_check_atol": 1.0e-5,
        "vllm_server_timeout": 120,
        "rollout_worker_timeout": 60,
        "save_strategy": "no",
    } | fields
    path.write_text(yaml.safe_dump(values))
    return path


def metrics(run: Path) -> list[dict]:
    """The run's step lines."""
    return [row for line in open(run / "metrics.jsonl") if "loss" in (row := json.loads(line))]


def check(done, what: str) -> None:
    assert done.returncode == 0, f"{what}: exit {done.returncode}\n{done.stdout[-3000:]}\n{done.stderr[-6000:]}"


def get_json(host, url: str, timeout_s: float = 10) -> dict:
    """GET `url` from `host` (this test's own process has no route into the namespaces)."""
    code = f"import urllib.request; print(urllib.request.urlopen({url!r}, timeout={timeout_s}).read().decode())"
    done = host.run([sys.executable, "-c", code], timeout=timeout_s + 30)
    check(done, f"GET {url} from {host.address}")
    return json.loads(done.stdout)


def wait_for(condition, timeout_s: float, what: str) -> None:
    end = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > end:
            raise TimeoutError(f"{what} within {timeout_s:.0f} s")
        time.sleep(0.2)


def wait_healthy(host, url: str, timeout_s: float) -> None:
    """Until `url`/health answers 200 from `host`."""
    code = (
        "import time, urllib.request\n"
        f"end = time.monotonic() + {timeout_s}\n"
        "while True:\n"
        "    try:\n"
        f"        if urllib.request.urlopen({url + '/health'!r}, timeout=2).status == 200: break\n"
        "    except OSError:\n"
        "        if time.monotonic() > end: raise\n"
        "        time.sleep(1)\n"
    )
    check(host.run([sys.executable, "-c", code], timeout=timeout_s + 30), f"{url} answering /health")
