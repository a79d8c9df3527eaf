"""Two hosts on one machine: two network namespaces joined by a veth pair (iproute2), each
with its own loopback, so what one process serves on 127.0.0.1 the other cannot reach. Only
the namespaces made here are touched, and each is deleted (with its end of the pair) after."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass


@dataclass(frozen=True)
class Host:
    namespace: str
    address: str

    def argv(self, *command: str) -> list[str]:
        """`command` run inside this host's namespace."""
        return ["ip", "netns", "exec", self.namespace, *command]


def can_make_hosts() -> str:
    """Why namespaces cannot be made here ("" if they can): they need root and iproute2."""
    if shutil.which("ip") is None:
        return "iproute2's `ip` is not installed"
    if os.geteuid() != 0:
        return "network namespaces need root"
    return ""


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True, timeout=30)


@contextlib.contextmanager
def two_hosts(subnet: int = 213) -> Iterator[tuple[Host, Host]]:
    """Hosts at 10.<subnet>.0.1 and 10.<subnet>.0.2 (/24), named after this process."""
    tag = f"rr{os.getpid()}"
    hosts = (Host(f"{tag}-a", f"10.{subnet}.0.1"), Host(f"{tag}-b", f"10.{subnet}.0.2"))
    made: list[str] = []
    try:
        for host in hosts:
            _ip("netns", "add", host.namespace)
            made.append(host.namespace)
            _ip("-n", host.namespace, "link", "set", "lo", "up")
        _ip("link", "add", f"{tag}a", "type", "veth", "peer", "name", f"{tag}b")
        for host, end in zip(hosts, ("a", "b"), strict=True):
            _ip("link", "set", f"{tag}{end}", "netns", host.namespace)
            _ip("-n", host.namespace, "addr", "add", f"{host.address}/24", "dev", f"{tag}{end}")
            _ip("-n", host.namespace, "link", "set", f"{tag}{end}", "up")
        yield hosts
    finally:
        for namespace in made:  # its end of the veth pair goes with it, and the other end too
            subprocess.run(["ip", "netns", "delete", namespace], capture_output=True, timeout=30)
