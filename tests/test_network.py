"""This machine's end of a connection: which address and interface a route uses, and how gloo is told."""

from tandem import network


def test_the_route_to_loopback_leaves_from_loopback_on_its_interface():
    assert network.address_toward("127.0.0.1") == "127.0.0.1"
    assert network.interface_of("127.0.0.1") == "lo"
    assert network.interface_of("192.0.2.1") is None, "an address no interface of this machine holds"
    assert network.machine_addresses()[-1].startswith("127."), "loopback last: the others are what peers can reach"


def test_torchrun_binds_gloo_to_the_interface_of_its_route_unless_the_user_chose_one(monkeypatch):
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "")  # recorded, so that what the call sets is undone after the test
    monkeypatch.delenv("GLOO_SOCKET_IFNAME")
    assert network.bind_torchrun_gloo("127.0.0.1") == "lo"
    assert network.os.environ["GLOO_SOCKET_IFNAME"] == "lo"
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "eth7")
    assert network.bind_torchrun_gloo("127.0.0.1") is None
    assert network.os.environ["GLOO_SOCKET_IFNAME"] == "eth7", "the user's choice wins"
