"""This machine's end of a connection to another host: the address its route to a peer leaves from, the interface
that holds it, and gloo devices bound there.

Gloo, left to itself, advertises the address this machine's hostname resolves to. On many containers and VMs that is
127.0.0.1, and a peer on another host then fails with "Gloo connectFullMesh failed ... remote=[127.0.0.1]". So every
gloo group tandem makes binds to the address it means: the weight stream's groups to an explicit device, torchrun's
group (`init_process_group` takes no device) through GLOO_SOCKET_IFNAME. A GLOO_SOCKET_IFNAME the user set wins.
"""

import os
import socket
from datetime import timedelta
from typing import Any

import psutil
import torch.distributed as dist

GLOO_INTERFACE = "GLOO_SOCKET_IFNAME"


def address_toward(peer: str) -> str:
    """This machine's address that the route to `peer` leaves from (a connected UDP socket sends nothing)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect((peer, 9))
        except socket.gaierror as exc:
            raise OSError(f"cannot resolve {peer!r} ({exc})") from exc
        except OSError as exc:
            raise OSError(f"no route from this machine to {peer} ({exc})") from exc
        return probe.getsockname()[0]


def interface_of(address: str) -> str | None:
    """The network interface that holds `address` (None: no interface of this machine does)."""
    for name, entries in psutil.net_if_addrs().items():
        if any(entry.family == socket.AF_INET and entry.address == address for entry in entries):
            return name
    return None


def machine_addresses() -> list[str]:
    """This machine's IPv4 addresses, loopback last: what a user may give as an address others connect to."""
    found = [e.address for es in psutil.net_if_addrs().values() for e in es if e.family == socket.AF_INET]
    return sorted(found, key=lambda address: (address.startswith("127."), address))


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


def bind_torchrun_gloo(master_address: str) -> str | None:
    """Set GLOO_SOCKET_IFNAME, unless set already, to the interface of this machine's route to torchrun's rendezvous
    address (MASTER_ADDR), so that the ranks' gloo groups reach each other across hosts; returns the interface set."""
    if os.environ.get(GLOO_INTERFACE):
        return None
    interface = interface_of(address_toward(master_address))
    if interface is not None:
        os.environ[GLOO_INTERFACE] = interface
    return interface
