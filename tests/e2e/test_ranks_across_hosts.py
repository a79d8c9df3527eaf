"""Two FSDP2 trainer ranks as two hosts see each other: each in its own network namespace,
joined by a veth pair, so the rendezvous, the collectives, the sharded checkpoint, the gather
of the whole weights and their publishing over UCX all cross a real network path, and nothing
can go through a loopback the two share (each namespace has its own)."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from robustrl.cli.stack import etcd_argv, free_ports
from services.trainer.grpo import GRPOConfig, GRPOTrainer
from services.trainer.ranks.sharding import load_sharded
from tests.support.netns import two_hosts
from tests.support.paths import REPO

pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(240),
]


def test_fsdp_ranks_on_two_hosts_train_checkpoint_and_publish_over_the_network(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    etcd_port, etcd_peer, master_port = free_ports(3)
    with two_hosts() as (a, b):
        # etcd lives on rank 0's host, reachable from the other only at a's address.
        etcd = subprocess.Popen(
            a.argv(
                *etcd_argv("hosts", tmp_path / "etcd", etcd_port, etcd_peer),
                f"--listen-client-urls=http://{a.address}:{etcd_port}",
                f"--advertise-client-urls=http://{a.address}:{etcd_port}",
                "--log-level=error",
            ),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        ranks: list[subprocess.Popen[bytes]] = []
        outputs = []
        try:
            for rank, host in enumerate((a, b)):
                output = (tmp_path / f"rank{rank}.log").open("w")
                outputs.append(output)
                ranks.append(
                    subprocess.Popen(
                        host.argv(
                            sys.executable,
                            "-m",
                            "tests.support.netns_rank",
                            f"--rank={rank}",
                            f"--master={a.address}:{master_port}",
                            f"--host={host.address}",
                            f"--etcd={a.address}:{etcd_port}",
                            f"--model={tiny_model_dir}",
                            f"--dir={tmp_path}",
                        ),
                        cwd=REPO,
                        stdout=output,
                        stderr=subprocess.STDOUT,
                    )
                )
            deadline = time.monotonic() + 180
            for rank, proc in enumerate(ranks):
                code = proc.wait(max(1.0, deadline - time.monotonic()))
                assert code == 0, (tmp_path / f"rank{rank}.log").read_text()[-4000:]
        finally:
            for proc in [*ranks, etcd]:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
            for output in outputs:
                output.close()

    # Rank 1 reached rank 0 only over the veth pair: 127.0.0.1 in b is b's own.
    assert "rank_joined" in (tmp_path / "rank1.log").read_text()
    full = torch.load(tmp_path / "full.pt")
    pulled = torch.load(tmp_path / "pulled.pt")
    assert full.keys() == pulled.keys()
    for name, value in full.items():
        assert torch.equal(pulled[name], value), name
    # Each host wrote its own shards into the folder both see; one whole model reads them all.
    checkpoint = tmp_path / "checkpoint"
    assert sorted(p.name for p in checkpoint.iterdir()) == [
        ".metadata",
        "__0_0.distcp",
        "__1_0.distcp",
    ]
    from transformers import AutoModelForCausalLM

    alone = GRPOTrainer(
        AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32),
        GRPOConfig(lr=1e-2),
        pad_id=0,
    )
    load_sharded(alone.model, alone.optimizer, checkpoint, alone=True)
    for name, value in alone.model.state_dict().items():
        assert torch.equal(value, full[name]), name
    assert alone.steps_taken == 2
