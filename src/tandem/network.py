"""This machine's end of a connection to another host: the address its route to a peer leaves from, the interface
that holds it, and gloo devices bound there.

Gloo, left to itself, advertises the address this machine's hostname resolves to. On many containers and VMs that is
127.0.0.1, and a peer on another host then fails with "Gloo connectFullMesh failed ... remote=[127.0.0.1]". So every
gloo group tandem makes binds to the address it means: the weight stream's groups to an explicit device, torchrun's
groups (`init_process_group` takes no device) through GLOO_SOCKET_IFNAME while they form. A GLOO_SOCKET_IFNAME the user
set wins in both.
"""

import os
import socket
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

import psutil
import torch.distributed as dist

GLOO_INTERFACE = "GLOO_SOCKET_IFNAME"


class NoRoute(OSError):
    """This machine has no route to a peer (an unreachable network, a blackhole): waiting will not help."""


def address_toward(peer: str) -> str:
    """This machine's address that the route to `peer` leaves from (a connected UDP socket sends nothing). A name that
    does not resolve raises socket.gaierror (it may yet: a service whose name appears once it is up); no route, NoRoute."""
    family, _, _, _, where = socket.getaddrinfo(peer, 9, type=socket.SOCK_DGRAM)[0]
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect(where)
        except OSError as exc:
            raise NoRoute(f"no route from this machine to {peer} ({exc})") from exc
        return probe.getsockname()[0]


def interface_of(address: str) -> str | None:
    """The network interface that holds `address` (None: no interface of this machine does)."""
    for name, entries in psutil.net_if_addrs().items():
        if any(entry.address.split("%")[0] == address for entry in entries):  # an IPv6 address may carry its scope
            return name
    return None


def machine_addresses() -> list[str]:
    """This machine's IPv4 addresses beyond loopback: what a peer on another machine may connect to."""
    found = [e.address for es in psutil.net_if_addrs().values() for e in es if e.family == socket.AF_INET]
    return sorted(address for address in found if not address.startswith("127."))


def gloo_options(local_address: str, timeout: timedelta) -> Any:
    """Options for a gloo group whose device is bound to `local_address`, or to GLOO_SOCKET_IFNAME's first interface
    when the user set it (ProcessGroupGloo._Options, which torch's stubs leave out)."""
    options = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]
    chosen = os.environ.get(GLOO_INTERFACE, "").split(",")[0]
    device = (
        dist.ProcessGroupGloo.create_device(interface=chosen)
        if chosen
        else dist.ProcessGroupGloo.create_device(hostname=local_address)
    )
    options._devices = [device]
    options._timeout = timeout
    return options


@contextmanager
def gloo_bound_toward(master_address: str) -> Iterator[str | None]:
    """While torchrun's process groups form: GLOO_SOCKET_IFNAME set to the interface of this machine's route to the
    rendezvous address (MASTER_ADDR), unless the user set it; yields the interface set. Removed again after, so that
    the weight stream's group and the processes this one starts bind by their own rule."""
    if os.environ.get(GLOO_INTERFACE):
        yield None
        return
    interface = interface_of(address_toward(master_address))
    if interface is None:
        yield None
        return
    os.environ[GLOO_INTERFACE] = interface
    try:
        yield interface
    finally:
        del os.environ[GLOO_INTERFACE]
