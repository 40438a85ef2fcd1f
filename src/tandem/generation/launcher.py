"""Start `tandem serve` (or `tandem proxy`) in a subprocess on a free loopback port and stop it reliably.

Used by the trainer's embedded default (no `vllm_server_base_url`), the examples and the benchmarks.
The server's output goes to a log file, whose tail is shown if the server dies.
"""

import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

class EmbeddedServer:
    """`tandem serve MODEL ...`; `url` is set once it listens."""

    ready = re.compile(r"tandem serve: .* on (http://\S+) ")

    def __init__(self, model: str, *, log_path: Path | None = None, startup_timeout_s: float = 300, extra_args: list[str] = (),
                 env: dict[str, str] | None = None):
        self._launch(["serve", model, "--port", "0", *extra_args], log_path, startup_timeout_s, env)

    def _launch(self, args: list[str], log_path: Path | None, startup_timeout_s: float, env: dict[str, str] | None) -> None:
        self.log_path = Path(log_path) if log_path else None
        env = {**os.environ, "OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY", "PASSIVE"), **(env or {})}  # see tandem/__init__.py
        self.process = subprocess.Popen([sys.executable, "-m", "tandem.cli", *args], stdout=subprocess.PIPE,
                                        stderr=subprocess.STDOUT, text=True, bufsize=1, env=env)
        self.lines: list[str] = []
        self.url = self._wait_ready(f"tandem {args[0]}", startup_timeout_s)
        threading.Thread(target=self._drain, daemon=True).start()

    def _wait_ready(self, what: str, timeout_s: float) -> str:
        deadline = time.monotonic() + timeout_s
        for line in self.process.stdout:
            self._keep(line)
            if match := self.ready.search(line):
                return match.group(1)
            if time.monotonic() > deadline:
                break
        self.stop()
        raise RuntimeError(f"{what} did not start (exit code {self.process.poll()}):\n{self.tail()}")

    def _keep(self, line: str) -> None:
        self.lines = (self.lines + [line])[-200:]
        if self.log_path:
            with open(self.log_path, "a") as log:
                log.write(line)

    def _drain(self) -> None:
        for line in self.process.stdout:
            self._keep(line)

    def tail(self, n: int = 30) -> str:
        return "".join(self.lines[-n:])

    def alive(self) -> bool:
        return self.process.poll() is None

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()

    def __enter__(self):
        return self

    def __exit__(self, *_):
        self.stop()


class EmbeddedProxy(EmbeddedServer):
    """`tandem proxy --upstream URL ...` in front of `upstreams`."""

    ready = re.compile(r"tandem proxy: (http://\S+) ")

    def __init__(self, upstreams: list[str], *, log_path: Path | None = None, startup_timeout_s: float = 120,
                 extra_args: list[str] = ()):
        flags = [arg for url in upstreams for arg in ("--upstream", url)]
        self._launch(["proxy", *flags, "--port", "0", *extra_args], log_path, startup_timeout_s, None)
