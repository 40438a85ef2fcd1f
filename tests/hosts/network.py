"""Hosts simulated on this machine: each a network namespace with its own network stack and address, the filesystem
shared. Two hosts are joined by a veth pair; more meet at a bridge in a "switch" namespace. No host has a default
route, so nothing inside can reach beyond the namespaces' own addresses (10.231.0.0/16) and its loopback.

    with Network(2) as (trainer, server):
        server.popen(["tandem", "serve", "tiny", "--host", server.address], log)
        trainer.run(["tandem", "train", recipe])

Leaving the block kills whatever still runs inside the namespaces and removes them, however it is left. Needs root
and iproute2 (`ip netns`); `available()` says why not.
"""

import itertools
import os
import re
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

PREFIX = "10.231"


def ip(*args: str) -> None:
    """`ip ARGS`; fails with its own message."""
    done = subprocess.run(["ip", *args], capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"ip {' '.join(args)}: {done.stderr.strip()}")


def available() -> str | None:
    """None when this machine lets a test make namespaces, else why not."""
    name = f"tandem-probe-{os.getpid()}"
    try:
        ip("netns", "add", name)
    except (OSError, RuntimeError) as exc:
        return f"network namespaces are not available here ({exc}): run as root with iproute2"
    ip("netns", "del", name)
    return None


def sweep() -> None:
    """Remove the namespaces a test process killed before its clean-up left behind (their tag names its process)."""
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split("\n")
    for name in (line.split()[0] for line in listed if line.strip()):
        tag = re.fullmatch(r"t(\d+)n\d+-(host\d+|switch)|tandem-probe-(\d+)", name)
        owner = tag and int(tag.group(1) or tag.group(3))
        if owner and not any(int(pid) % 100000 == owner % 100000 for pid in os.listdir("/proc") if pid.isdigit()):
            remove_namespace(name)


def remove_namespace(name: str, wait_s: float = 10) -> None:
    """Kill whatever runs inside namespace `name`, then remove it."""
    for pid in subprocess.run(["ip", "netns", "pids", name], capture_output=True, text=True).stdout.split():
        try:
            os.kill(int(pid), signal.SIGKILL)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + wait_s
    while subprocess.run(["ip", "netns", "del", name], capture_output=True).returncode and time.monotonic() < deadline:
        time.sleep(0.2)


LEFT_OUT = ("GLOO_SOCKET_IFNAME", "http_proxy", "https_proxy", "HTTP_PROXY", "HTTPS_PROXY", "all_proxy", "ALL_PROXY")
"""Variables of this process that would change what a host does: a user's gloo interface, proxies for HTTP."""


def environment(extra: dict[str, str] | None) -> dict[str, str]:
    """A host's processes' environment: this process's without LEFT_OUT, plus `extra`."""
    return {name: value for name, value in os.environ.items() if name not in LEFT_OUT} | (extra or {})


@dataclass
class Host:
    namespace: str
    address: str
    interface: str
    processes: list[subprocess.Popen] = field(default_factory=list)

    def command(self, argv: list[str]) -> list[str]:
        return ["ip", "netns", "exec", self.namespace, *argv]

    def popen(self, argv: list[str], log: Path, env: dict[str, str] | None = None) -> subprocess.Popen:
        """`argv` started on this host, its output to `log`."""
        with open(log, "wb") as out:
            process = subprocess.Popen(
                self.command(argv), stdout=out, stderr=subprocess.STDOUT, env=environment(env), start_new_session=True
            )
        self.processes.append(process)
        return process

    def run(self, argv: list[str], timeout: float, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
        """`argv` run to its end on this host, its output captured."""
        return subprocess.run(self.command(argv), capture_output=True, text=True, timeout=timeout, env=environment(env))

    def add_address(self, address: str) -> None:
        """A second address on this host's interface."""
        ip("-n", self.namespace, "addr", "add", f"{address}/16", "dev", self.interface)

    def blackhole(self, address: str) -> None:
        """Packets from this host to `address` go nowhere (a connect fails; the other addresses still answer)."""
        ip("-n", self.namespace, "route", "add", "blackhole", address)


NETWORKS = itertools.count()


class Network:
    def __init__(self, count: int):
        # unique on this machine: a process's networks are numbered (names stay within 15 characters up to 99)
        self.count, self.tag = count, f"t{os.getpid() % 100000}n{next(NETWORKS) % 100}"
        self.hosts: list[Host] = []
        self.namespaces: list[str] = []

    def __enter__(self) -> list[Host]:
        try:
            self._build()
        except BaseException:
            self.remove()
            raise
        return self.hosts

    def __exit__(self, *exc) -> None:
        self.remove()

    def _namespace(self, name: str) -> str:
        ip("netns", "add", name)
        self.namespaces.append(name)
        ip("-n", name, "link", "set", "lo", "up")
        return name

    def _build(self) -> None:
        namespaces = [self._namespace(f"{self.tag}-host{index}") for index in range(self.count)]
        interfaces = [f"{self.tag}h{index}" for index in range(self.count)]  # at most 15 characters
        if self.count == 2:  # one veth pair, an end on each host
            ip("link", "add", interfaces[0], "type", "veth", "peer", "name", interfaces[1])
            for namespace, interface in zip(namespaces, interfaces):
                ip("link", "set", interface, "netns", namespace)
        else:  # a pair per host, its other end a port of the switch's bridge
            switch = self._namespace(f"{self.tag}-switch")
            ip("-n", switch, "link", "add", "br0", "type", "bridge")
            ip("-n", switch, "link", "set", "br0", "up")
            for index, (namespace, interface) in enumerate(zip(namespaces, interfaces)):
                port = f"{self.tag}s{index}"
                ip("link", "add", interface, "type", "veth", "peer", "name", port)
                ip("link", "set", interface, "netns", namespace)
                ip("link", "set", port, "netns", switch)
                ip("-n", switch, "link", "set", port, "master", "br0")
                ip("-n", switch, "link", "set", port, "up")
        for index, (namespace, interface) in enumerate(zip(namespaces, interfaces)):
            address = f"{PREFIX}.0.{index + 1}"
            ip("-n", namespace, "addr", "add", f"{address}/16", "dev", interface)
            ip("-n", namespace, "link", "set", interface, "up")
            self.hosts.append(Host(namespace, address, interface))

    def remove(self) -> None:
        """Kill what runs in the namespaces (the processes started here first, with their groups), then remove them."""
        for host in self.hosts:
            for process in host.processes:
                if process.poll() is None:
                    try:
                        os.killpg(process.pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
        for host in self.hosts:
            for process in host.processes:
                try:
                    process.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    pass
        for name in self.namespaces:
            remove_namespace(name)
        self.namespaces.clear()
        for index in range(self.count):  # an end left outside by a build that failed halfway
            subprocess.run(["ip", "link", "del", f"{self.tag}h{index}"], capture_output=True)
            subprocess.run(["ip", "link", "del", f"{self.tag}s{index}"], capture_output=True)
