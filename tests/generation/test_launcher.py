"""The launcher's start deadline holds whatever the server does: print its address, exit, or hang in silence."""

import re
import sys
import time

import pytest

from tandem.generation.launcher import ServerProcess

READY = re.compile(r"listening on (\S+) ")


def python(code: str) -> list[str]:
    return [sys.executable, "-c", code]


def test_a_server_that_hangs_silently_fails_at_the_deadline_naming_it_and_the_log(tmp_path):
    log = tmp_path / "server.log"
    started = time.monotonic()
    with pytest.raises(RuntimeError, match=rf"within startup_timeout_s=1s \(log: {re.escape(str(log))}\)"):
        ServerProcess(python("import time; time.sleep(60)"), READY, log_path=log, startup_timeout_s=1)
    assert time.monotonic() - started < 20, "the deadline holds although the server prints nothing"


def test_a_server_that_exits_early_fails_at_once_with_its_output(tmp_path):
    code = "import sys; print('no model here', flush=True); sys.exit(3)"
    with pytest.raises(RuntimeError, match=r"exited with code 3 before reporting its address[\s\S]*no model here"):
        ServerProcess(python(code), READY, log_path=tmp_path / "server.log", startup_timeout_s=60)
    assert "no model here" in (tmp_path / "server.log").read_text()


def test_a_ready_server_has_its_url_and_waits_passively_for_openmp(monkeypatch):
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    code = "import os, time; print('listening on http://127.0.0.1:9/' + os.environ['OMP_WAIT_POLICY'] + ' ', flush=True); time.sleep(60)"
    with ServerProcess(python(code), READY, startup_timeout_s=60) as server:
        assert server.url == "http://127.0.0.1:9/PASSIVE" and server.alive()
    assert not server.alive(), "leaving the block stops the server"
