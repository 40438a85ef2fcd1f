"""What a training run talks to, owned in one place: the generation server (embedded or external), the
control client, the rollout worker, the metric sinks, the console and the run's report.

`Session` is a context manager: whatever was started is stopped when the run leaves it, on success, on
an error and on Ctrl-C, in the reverse order of starting. The trainer asks it for each part in turn.
"""

import asyncio
import json
import sys
import time
import urllib.parse
from collections.abc import Coroutine
from contextlib import ExitStack
from pathlib import Path
from typing import Any, TypeVar

import torch

from tandem.generation.client import ControlClient, GenerationClient, ServerProblem, server_gone
from tandem.generation.launcher import EmbeddedServer
from tandem.metrics import report
from tandem.metrics.console import RunConsole
from tandem.metrics.doctor import RUN_CONFIG
from tandem.metrics.sinks import completion_rows, make_sinks
from tandem.network import NoRoute, address_toward
from tandem.rollout.worker import RolloutWorker, WorkerSpec
from tandem.runtime import embedded_server

QUICK_S = 5.0
"""How long a server may take to answer /health before the run says it is waiting for it."""
DYING_S = 3.0
"""After a failed call, how long the embedded server gets to show it is exiting: a killed server resets its sockets a
moment before its exit can be seen."""
RECONNECT_POLL_S = 5.0
"""While waiting for an external server after a failed sync, how often the worker is asked whether it stopped."""

T = TypeVar("T")


class Session:
    def __init__(self, timeout_s: float, api_key: str | None = None):
        self.timeout_s, self.api_key = timeout_s, api_key
        self.stack = ExitStack()
        self.runner = asyncio.Runner()
        self.server: EmbeddedServer | None = None
        self.server_args: list[str] = []
        self.server_env: dict[str, str] = {}
        self.control: ControlClient | None = None
        self.worker: RolloutWorker | None = None
        self.sinks: list = []
        self.progress: RunConsole | None = None
        self.report_dir: Path | None = None
        """Where report.html is drawn when the session ends; set when the sinks open."""

    def __enter__(self) -> "Session":
        self.stack, self.runner = ExitStack(), asyncio.Runner()  # a new run of the same trainer starts afresh
        self.stack.callback(self.runner.close)
        self.stack.callback(self.write_report)  # runs after everything else has stopped
        return self

    def __exit__(self, *exc_info) -> None:
        self.stack.close()

    def run(self, coroutine: Coroutine[Any, Any, T]) -> T:
        """Run a client call to completion on the session's event loop. When it fails because the embedded
        server died, the error says so (with the server's log)."""
        try:
            return self.runner.run(coroutine)
        except Exception:
            self.check_server(wait_s=DYING_S)
            raise

    def start_server(self, model_path: str, log_path: Path, extra_args: list[str], threads: int | None = None) -> str:
        """The embedded `tandem serve` for `model_path` (its output in `log_path`); returns its URL. With `threads`,
        the server and this process (until the session ends) each compute with that many OpenMP threads."""
        embedded_server.warn_if_a_server_waits()
        if threads is not None:
            self.stack.callback(torch.set_num_threads, torch.get_num_threads())
            torch.set_num_threads(threads)
            self.server_env = {"OMP_NUM_THREADS": str(threads)}
        self.server = server = EmbeddedServer(model_path, log_path=log_path, extra_args=extra_args, env=self.server_env)
        self.server_args = extra_args
        self.stack.callback(self._stop_server)
        assert server.url is not None, "the server is started once it reports its URL"
        return server.url

    def _stop_server(self) -> None:
        """Stop the embedded server running at the session's end (it may have been restarted)."""
        if self.server is not None:
            self.server.stop()

    def restart_server(self, model_path: str) -> None:
        """A new embedded server in place of the one that died: the same flags and port (requests in flight retry
        until it answers), serving `model_path`."""
        dead, control = self.server, self.control
        assert dead is not None and control is not None, "a restart follows start_server and connect"
        dead.stop()  # reaps it and closes its output
        port = urllib.parse.urlsplit(dead.url).port
        self.server = EmbeddedServer(
            model_path, log_path=dead.log_path, extra_args=[*self.server_args, "--port", str(port)], env=self.server_env
        )
        self.run(control.wait_healthy(self.timeout_s))

    def connect(self, url: str) -> ControlClient:
        """The control-plane client, once the server at `url` answers /health."""
        self.control = control = ControlClient(url, api_key=self.api_key, timeout_s=self.timeout_s)
        self.stack.callback(lambda: self.run(control.close()))
        if self.server is not None:  # the embedded one: its start is ours to wait for
            self.run(control.wait_healthy(self.timeout_s))
            return control
        host = urllib.parse.urlsplit(url).hostname or ""
        try:  # no route at all is said at once, not waited out like a server still starting (or a name not yet known)
            address_toward(host)
        except NoRoute as exc:
            raise ServerProblem(
                f"this machine cannot reach the generation server at {url}: {exc}. Check vllm_server_base_url, and "
                f"that this machine has a route to {host}."
            ) from None
        try:
            self.run(control.wait_healthy(min(self.timeout_s, QUICK_S)))
        except TimeoutError:  # an external server that is starting, or none: say what we wait for
            print(
                f"tandem: waiting for the generation server at {url} to answer /health (up to "
                f"vllm_server_timeout={self.timeout_s:g}s)",
                file=sys.stderr,
            )
            try:
                self.run(control.wait_healthy(self.timeout_s))
            except TimeoutError as exc:
                raise ServerProblem(str(exc)) from None
        return control

    def generation_client(self) -> GenerationClient:
        """A generation client of the connected server, closed with the session."""
        assert self.control is not None, "connect() first"
        client = GenerationClient(self.control.base_url, api_key=self.api_key, timeout_s=self.timeout_s)
        self.stack.callback(lambda: self.run(client.close()))
        return client

    def open_sinks(
        self, report_to, output_dir: Path, config: dict, total_steps: int | None, dashboard: bool = True
    ) -> None:
        """`metrics.jsonl` and the `report_to` sinks, the console (dashboard or plain lines), and report.html drawn when the run leaves
        the session (after the sinks closed: at its end, on Ctrl-C, on a crash). `dashboard` False: plain lines even in a terminal."""
        (output_dir / RUN_CONFIG).write_text(json.dumps(config, indent=2, default=str))  # what tandem doctor reads
        self.report_dir = output_dir
        self.sinks = make_sinks(report_to, output_dir, config)
        for sink in self.sinks:
            self.stack.callback(sink.close)
        self.progress = RunConsole(total_steps, config, dashboard=dashboard)
        self.stack.callback(self.progress.close)

    def log(self, step: int, metrics: dict) -> None:
        """Write one record to every sink (metrics.jsonl and the report_to ones)."""
        for sink in self.sinks:
            sink.log(step, metrics)

    def say(self, line: str) -> None:
        """One line for the user, on the console (above the dashboard in a terminal)."""
        assert self.progress is not None, "open_sinks() first"
        self.progress.say(line)

    def update(self, step: int, metrics: dict) -> None:
        """The console's view of the run: its progress and the logged line's figures."""
        assert self.progress is not None, "open_sinks() first"
        self.progress.update(step, metrics)

    def log_completions(self, step: int, examples: list, printed: int | None) -> None:
        """log_completions: the window's (prompt, completion, reward) examples to every sink as a table, and the
        first `printed` of them to the console (None: all)."""
        rows = completion_rows(step, examples)
        for sink in self.sinks:
            sink.log_table(step, rows)
        assert self.progress is not None, "open_sinks() first"
        self.progress.print_completions(examples, printed)

    def write_report(self) -> None:
        """report.html from whatever metrics.jsonl holds, once the sinks were opened. A report that cannot be drawn
        is said on stderr: it never hides the run's own error."""
        if self.report_dir is None:
            return
        try:
            path = report.write(self.report_dir)
        except Exception as exc:  # noqa: BLE001 - the run's own outcome matters more than its pictures
            print(
                f"the run's report could not be drawn ({exc!r}); try again with: tandem report {self.report_dir}",
                file=sys.stderr,
            )
            return
        print(f"report: {path}", file=sys.stderr)

    def start_worker(self, spec: WorkerSpec, timeout_s: float, model_version: int) -> RolloutWorker:
        """The rollout worker process, sampling from `model_version` until the trainer announces another."""
        self.worker = RolloutWorker(spec, timeout_s)
        self.worker.channels.model_version.value = model_version  # a resumed run's first groups sample from its version
        self.stack.callback(self.worker.stop)
        self.worker.start()
        return self.worker

    def check_server(self, wait_s: float = 0.0) -> None:
        """Raise if the embedded server died (with its log's tail), waiting up to `wait_s` for one that may be dying; an
        external server is the worker's to report."""
        if self.server is not None and not self.server.alive(wait_s):
            raise RuntimeError(
                f"the embedded tandem serve exited (code {self.server.process.poll()}):\n{self.server.tail()}"
            )

    def wait_for_server(self, error: Exception) -> None:
        """After a failed sync to an external server: wait up to timeout_s (vllm_server_timeout) for it to answer again,
        saying so; past that, a ServerProblem names the failure. The worker is asked every RECONNECT_POLL_S whether it
        stopped: one that saw vLLM's engine die says so, and no server will come back."""
        assert self.control is not None and self.worker is not None, "a run in progress"
        self.say(
            f"the weight sync to {self.control.base_url} failed ({error}); syncing again once it "
            f"answers (waiting up to vllm_server_timeout={self.timeout_s:g}s)"
        )
        deadline = time.monotonic() + self.timeout_s
        while True:
            self.worker.raise_if_stopped()
            try:
                self.run(self.control.wait_healthy(min(RECONNECT_POLL_S, max(0.0, deadline - time.monotonic()))))
                return
            except TimeoutError:
                if time.monotonic() >= deadline:
                    raise ServerProblem(f"the weight sync failed: {server_gone(error, self.timeout_s)}") from None
