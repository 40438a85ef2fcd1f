"""This machine's end of a connection: which address and interface a route uses, and how gloo is told."""

import os
from pathlib import Path
from types import SimpleNamespace

import pytest

from tandem import network
from tandem.errors import UsageError
from tandem.runtime.weight_sync import transfer_address
from tandem.runtime.weight_transfer import unjoined
from tandem.serve.weight_receiver import UNREACHABLE


def test_the_route_to_loopback_leaves_from_loopback_on_its_interface():
    assert network.address_toward("127.0.0.1") == "127.0.0.1"
    assert network.interface_of("127.0.0.1") == "lo"
    assert network.interface_of("192.0.2.1") is None, "an address no interface of this machine holds"
    assert not any(a.startswith("127.") for a in network.machine_addresses()), "only what peers elsewhere can reach"


def test_torchrun_binds_gloo_while_its_groups_form_unless_the_user_chose_an_interface(monkeypatch):
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "")  # recorded, so that the test leaves the variable as it found it
    monkeypatch.delenv("GLOO_SOCKET_IFNAME")
    with network.gloo_bound_toward("127.0.0.1") as interface:
        assert interface == "lo" and os.environ["GLOO_SOCKET_IFNAME"] == "lo"
    assert "GLOO_SOCKET_IFNAME" not in os.environ, (
        "gone once the groups formed: the weight stream binds by its own rule"
    )
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "eth7")
    with network.gloo_bound_toward("127.0.0.1") as interface:
        assert interface is None and os.environ["GLOO_SOCKET_IFNAME"] == "eth7", "the user's choice wins"
    assert os.environ["GLOO_SOCKET_IFNAME"] == "eth7"


def call(error: str | None) -> SimpleNamespace:
    """What `unjoined` reads of a finished call (an InThread)."""
    return SimpleNamespace(error=RuntimeError(error) if error else None, done=True)


def test_a_group_that_did_not_form_is_said_by_the_side_that_could_not_reach_the_other():
    url, group = "http://10.0.0.2:8000", "10.0.0.1:41000"
    server = f"weight transfer failed: this server {UNREACHABLE} {group} within 15 s: connection timed out"
    said = unjoined(url, group, call(server), call("wait timeout after 15000ms"))
    assert said.startswith(f"weight transfer: the server cannot reach {group}, this trainer's weight_transfer_address")
    mesh = "Gloo connectFullMesh failed with [pair.cc:152] timed out connecting: remote=[10.0.0.2]:7570"
    said = unjoined(url, group, call(None), call(mesh))
    assert said.startswith("weight transfer: this trainer cannot reach 10.0.0.2:7570, a gloo port of the group")
    said = unjoined(url, group, call("500: Weight transfer not configured"), call(None))
    assert said.startswith(f"weight transfer: the server at {url} did not join the group at {group} (the server: 500")


def test_the_vllm_plugin_says_an_unreachable_trainer_in_the_words_the_trainer_reads():
    plugin = Path(__file__).parents[1] / "integrations" / "vllm_plugin" / "tandem_vllm_plugin" / "gloo_engine.py"
    assert UNREACHABLE in plugin.read_text(), "the plugin runs without tandem: its message must carry the phrase itself"


def test_a_weight_transfer_address_that_is_not_this_machines_is_a_usage_error_naming_it():
    with pytest.raises(UsageError, match=r"weight_transfer_address='192\.0\.2\.1': .*Give an address of this machine"):
        transfer_address("192.0.2.1", control=None, run=None)  # a documentation address: no machine holds it
    assert transfer_address("localhost", control=None, run=None) == "127.0.0.1", "a name, resolved once"
