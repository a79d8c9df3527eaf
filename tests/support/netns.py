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

import pytest


@dataclass(frozen=True)
class Host:
    namespace: str
    address: str

    def argv(self, *command: str) -> list[str]:
        """`command` run inside this host's namespace."""
        return ["ip", "netns", "exec", self.namespace, *command]


def can_make_hosts() -> str:
    """Why namespaces cannot be made here ("" if they can): they need root and iproute2."""
    missing = []
    if os.geteuid() != 0:
        missing.append(f"root (network namespaces need it; running as uid {os.geteuid()})")
    if shutil.which("ip") is None:
        missing.append("the `ip` command (Debian package iproute2: apt-get install iproute2)")
    return " and ".join(missing)


def require_hosts() -> None:
    """Fail, naming what is missing, where two hosts cannot be made. Skipped instead, the
    multi-host tests would vanish from a CI run that still reads green."""
    missing = can_make_hosts()
    if missing:
        pytest.fail(f"two hosts on one machine need {missing}; this test fails without them")


def _ip(*args: str) -> None:
    done = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if done.returncode:  # root without CAP_SYS_ADMIN (a container) gets here: say what ip said
        raise RuntimeError(f"`ip {' '.join(args)}` failed: {done.stderr.strip()}")


@contextlib.contextmanager
def two_hosts(subnet: int = 213) -> Iterator[tuple[Host, Host]]:
    """Hosts at 10.<subnet>.0.1 and 10.<subnet>.0.2 (/24), named after this process. Fails
    at once where they cannot be made (require_hosts)."""
    require_hosts()
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
