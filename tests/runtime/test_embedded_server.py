"""A run without vllm_server_base_url starts its own server, and says so when one already waits where vLLM's quick
start puts it."""

import warnings
from types import SimpleNamespace

import pytest

from tandem.runtime import embedded_server
from tests.conftest import ServerThread


def test_a_server_at_vllms_default_address_is_named_with_the_setting_that_uses_it(monkeypatch):
    waiting = ServerThread()
    try:
        monkeypatch.setattr(embedded_server, "VLLM_DEFAULT_URL", waiting.url)
        with pytest.warns(UserWarning, match=f"answers at {waiting.url}.*vllm_server_base_url={waiting.url}"):
            embedded_server.warn_if_a_server_waits()
    finally:
        waiting.close()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nobody answers now: not a word
        embedded_server.warn_if_a_server_waits()


def test_the_embedded_servers_start_looks_for_one_first(monkeypatch, tmp_path):
    from tandem.runtime.session import Session

    looked = []
    monkeypatch.setattr(embedded_server, "warn_if_a_server_waits", lambda: looked.append(True))
    started = SimpleNamespace(url="http://127.0.0.1:1", stop=lambda: None)  # no process: only the order matters
    monkeypatch.setattr("tandem.runtime.session.EmbeddedServer", lambda *args, **kwargs: started)
    with Session(timeout_s=5) as session:
        session.start_server("tiny", tmp_path / "server.log", [])
    assert looked == [True]
