"""A real etcd process on free ports, for a test session or one test."""

from __future__ import annotations

import signal
import subprocess
from pathlib import Path

from robustrl.cli.stack import etcd_argv, etcd_healthy, free_ports
from tests.support.waiting import eventually_sync


class EtcdProcess:
    def __init__(self, data_dir: Path) -> None:
        self.client_port, self.peer_port = free_ports(2)
        self.endpoints = f"127.0.0.1:{self.client_port}"
        self.proc = subprocess.Popen(
            [*etcd_argv("test", data_dir, self.client_port, self.peer_port), "--log-level=error"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def started_etcd(data_dir: Path) -> EtcdProcess:
    server = EtcdProcess(data_dir)

    def healthy() -> bool:
        if etcd_healthy(server.endpoints):
            return True
        assert server.proc.poll() is None, "etcd exited at start"
        return False

    eventually_sync(healthy, 30, unmet=lambda: "etcd did not become healthy within 30s")
    return server
