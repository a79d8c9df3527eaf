"""A real etcd process on free ports, for a test session or one test."""

from __future__ import annotations

import signal
import subprocess
import time
from pathlib import Path

from robustrl.cli.stack import etcd_argv, etcd_healthy, free_ports


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
    deadline = time.monotonic() + 30
    while not etcd_healthy(server.endpoints):
        assert server.proc.poll() is None, "etcd exited at start"
        assert time.monotonic() < deadline, "etcd did not become healthy within 30s"
        time.sleep(0.1)
    return server
