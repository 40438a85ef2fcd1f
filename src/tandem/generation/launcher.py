"""Start `tandem serve` (or `tandem proxy`) in a subprocess on a free loopback port and stop it reliably.

Used by the trainer's embedded default (no `vllm_server_base_url`), the examples and the benchmarks.
The server's output goes to a log file, whose tail is shown if the server dies or does not start in time.
"""

import os
import re
import shlex
import subprocess
import sys
import threading
from collections.abc import Sequence
from pathlib import Path


def core_share() -> int:
    """OpenMP threads for each of the two processes computing on this machine's cores, a trainer and its embedded
    server: half the cores each. One matmul spread over every core stalls whenever the other process runs: on 2 cores
    the demo trained 1.2-1.4x the samples a second with one thread each (benchmarks/vs_trl.py)."""
    return max(1, len(os.sched_getaffinity(0)) // 2)


def server_threads(trainer_device: str) -> int | None:
    """OpenMP threads for an embedded server beside a trainer on `trainer_device` ("cpu", "cuda"...): the core share
    where both compute on this machine's cores; None (the server's own default) beside a GPU trainer, or when the
    user's OMP_NUM_THREADS already says how many."""
    if "OMP_NUM_THREADS" in os.environ or trainer_device != "cpu":
        return None
    return core_share()


class ServerProcess:
    """A server subprocess that is ready once it prints a line `ready` matches (its group 1 is the URL).

    A thread reads its output from the start, so the start deadline holds even for a server that hangs silently.
    """

    def __init__(
        self,
        command: list[str],
        ready: re.Pattern,
        *,
        log_path: Path | None = None,
        startup_timeout_s: float = 300,
        env: dict[str, str] | None = None,
        shares_cores: bool = True,
    ):
        self.ready, self.log_path = ready, Path(log_path) if log_path else None
        self.lines: list[str] = []
        self.url: str | None = None
        self._settled = threading.Event()  # set once the URL is known or the output has ended
        # Passive OpenMP waiting when the server shares the cores with the trainer and the worker (see tandem.cli.main);
        # a server with the machine to itself keeps OpenMP's default, twice as fast on a CPU.
        env = {**os.environ, **(env or {})}
        if shares_cores:
            env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
        else:
            env.pop("OMP_WAIT_POLICY", None)
        self.process = subprocess.Popen(
            command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1, env=env
        )
        self.reader = threading.Thread(target=self._read_output, daemon=True)
        self.reader.start()
        self._wait_ready(shlex.join(command), startup_timeout_s)

    def _read_output(self) -> None:
        assert self.process.stdout is not None  # stdout=PIPE
        for line in self.process.stdout:
            self._keep(line)
            if self.url is None and (match := self.ready.search(line)):
                self.url = match.group(1)
                self._settled.set()
        self._settled.set()

    def _wait_ready(self, what: str, timeout_s: float) -> None:
        settled = self._settled.wait(timeout_s)
        if settled and self.url:
            return
        if settled:  # its output ended: it is exiting, let it finish so that its exit code can be read
            try:
                self.process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass
        timed_out = not settled
        self.stop()
        log = f"log: {self.log_path}" if self.log_path else "no log_path given"
        reason = (
            f"did not report its address within startup_timeout_s={timeout_s:g}s"
            if timed_out
            else f"exited with code {self.process.poll()} before reporting its address"
        )
        raise RuntimeError(f"`{what}` {reason} ({log}); its last output:\n{self.tail()}")

    def _keep(self, line: str) -> None:
        self.lines = (self.lines + [line])[-200:]
        if self.log_path:
            with open(self.log_path, "a") as log:
                log.write(line)

    def tail(self, n: int = 30) -> str:
        return "".join(self.lines[-n:])

    def alive(self, wait_s: float = 0.0) -> bool:
        """Whether the process runs, after waiting up to `wait_s` for it to end (one that just failed a request may be
        in the middle of dying: its sockets reset before its exit is seen)."""
        if wait_s:
            try:
                self.process.wait(timeout=wait_s)
            except subprocess.TimeoutExpired:
                pass
        return self.process.poll() is None

    def stop(self) -> None:
        """End the process (SIGTERM, SIGKILL after 30 s) and close its output pipe once all of it was read."""
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.reader.join(timeout=5)
        if not self.reader.is_alive():
            assert self.process.stdout is not None  # stdout=PIPE
            self.process.stdout.close()

    def __enter__(self):
        return self

    def __exit__(self, *_):
        self.stop()


class EmbeddedServer(ServerProcess):
    """`tandem serve MODEL ...`; `url` is set once it listens."""

    def __init__(
        self,
        model: str,
        *,
        log_path: Path | None = None,
        startup_timeout_s: float = 300,
        extra_args: Sequence[str] = (),
        env: dict[str, str] | None = None,
        shares_cores: bool = True,
    ):
        super().__init__(
            [sys.executable, "-m", "tandem.cli", "serve", model, "--port", "0", *extra_args],
            re.compile(r"tandem serve: .* on (http://\S+) "),
            log_path=log_path,
            startup_timeout_s=startup_timeout_s,
            env=env,
            shares_cores=shares_cores,
        )


class EmbeddedProxy(ServerProcess):
    """`tandem proxy --upstream URL ...` in front of `upstreams`."""

    def __init__(
        self,
        upstreams: list[str],
        *,
        log_path: Path | None = None,
        startup_timeout_s: float = 120,
        extra_args: Sequence[str] = (),
    ):
        flags = [arg for url in upstreams for arg in ("--upstream", url)]
        super().__init__(
            [sys.executable, "-m", "tandem.cli", "proxy", *flags, "--port", "0", *extra_args],
            re.compile(r"tandem proxy: (http://\S+) "),
            log_path=log_path,
            startup_timeout_s=startup_timeout_s,
        )
