"""The command `tandem train RECIPE --dry-run` prints for a CPU starts real vLLM, and the recipe trains against it;
when that server's engine dies mid-run, the run stops at once with one line (not vllm_server_timeout of waiting). The
second test kills the engine of the server the first trains against: they run in that order."""

import json
import shlex
import subprocess
import sys
import time

import pytest

from tandem.tasks import TINY_MODEL_PATH
from tests.vllm.conftest import ENV_DIR, REPO, VllmServer, assert_on_policy, require_environment, run_tandem


def cpu_command(recipe: str) -> tuple[dict, list[str]]:
    """The dry run's CPU command: its environment variables and its argv, `python` being vLLM's environment's."""
    done = run_tandem("train", recipe, "--dry-run")
    assert done.returncode == 0, done.stderr
    joined = done.stdout.replace(" \\\n    ", " ").splitlines()
    words = shlex.split(next(line for line in joined if line.startswith("VLLM_") and "-m vllm." in line))
    env = dict(word.split("=", 1) for word in words if "=" in word and not word.startswith("-"))
    argv = [word for word in words if word.split("=", 1)[0] not in env]
    assert argv[0] == "python", argv
    return env, [str(ENV_DIR / "bin" / "python"), *argv[1:]]


@pytest.fixture(scope="module")
def dry_run_server(tmp_path_factory):
    require_environment()
    env, command = cpu_command("examples/demo.yaml")
    assert TINY_MODEL_PATH in command, "the model is served under the name the trainer asks for"
    env["VLLM_CPU_KVCACHE_SPACE"] = "1"  # the tier's servers share 24 GB
    server = VllmServer(tmp_path_factory.mktemp("dry_run") / "server.log", command=command, env=env).launch()
    try:
        yield server.wait()
    finally:
        server.kill()


def test_the_demo_trains_against_the_vllm_its_dry_run_starts(tmp_path, dry_run_server):
    done = run_tandem(
        "train",
        "examples/demo.yaml",
        "--vllm_server_base_url",
        dry_run_server.url,
        "--max_steps",
        "20",
        "--max_staleness",
        "0",
        "--output_dir",
        str(tmp_path / "run"),
        "--save_strategy",
        "no",
        "--disable_tqdm",
        "true",
    )
    assert done.returncode == 0, f"{done.stderr[-3000:]}\nserver:\n{dry_run_server.tail()}"
    assert "UserWarning" not in done.stderr, f"the command tandem printed is the one it wants:\n{done.stderr[-2000:]}"
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert_on_policy(rows, 20, probed=False)  # no weight_sync_check_atol: only the first syncs are probed


def test_when_the_engine_of_that_server_dies_the_run_stops_at_once_in_one_line(tmp_path, dry_run_server):
    run = tmp_path / "killed"
    training = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tandem",
            "train",
            "examples/demo.yaml",
            "--vllm_server_base_url",
            dry_run_server.url,
            "--output_dir",
            str(run),
            "--disable_tqdm",
            "true",
        ],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 180
        while not (run / "metrics.jsonl").exists() or len((run / "metrics.jsonl").read_text().splitlines()) < 3:
            assert time.monotonic() < deadline and training.poll() is None, "the run trained three steps"
            time.sleep(0.5)
        dry_run_server.kill_engine()  # staleness 2: requests in flight when it dies
        killed = time.monotonic()
        _, stderr = training.communicate(timeout=120)
    finally:
        training.kill()
    assert training.returncode == 2, f"{stderr[-3000:]}\nserver:\n{dry_run_server.tail()}"
    last = stderr.strip().splitlines()[-1]
    assert "engine died" in last and "restart the server" in last and "Traceback" not in stderr, stderr[-3000:]
    assert time.monotonic() - killed < 60, "stopped at once, not after vllm_server_timeout"
