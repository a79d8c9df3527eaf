"""The whole stack on two hosts, each a network namespace joined to the other by a veth pair:
etcd, a coordinator, a monitor, trainer-0 and rollout-0 on host a; trainer-1 and rollout-1 on
host b. Each service listens only on its host's address, and each host has a loopback of its
own, so all that passes between the hosts crosses the link: the leader binds the two trainers
as the ranks of one FSDP2 group, they meet through the rendezvous in etcd and train over gloo,
each writes its shards into the checkpoint folder both see, each serves its share of every
version it publishes (rank 0 the first bucket, rank 1 the second) and rollout-1 pulls the
first one across the link over UCX, and rollout-1 streams its trajectories to rank 0."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from robustrl.cli.stack import etcd_argv, free_ports
from robustrl.core.config import member_argv, member_env
from services.trainer import checkpoint
from tests.support.netns import Host, two_hosts
from tests.support.paths import EXAMPLE, REPO

pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(420),
]

PREFIX = "/hosts"
STEPS = 6


def test_a_job_of_two_fsdp_ranks_on_two_hosts_runs_through_the_stack(
    model_dir: Path, tmp_path: Path
) -> None:
    etcd_port, etcd_peer = free_ports(2)
    runs = tmp_path / "runs"
    logs = tmp_path / "logs"
    logs.mkdir()
    procs: list[subprocess.Popen[bytes]] = []
    with two_hosts(subnet=214) as (a, b):
        endpoints = f"{a.address}:{etcd_port}"

        def start(host: Host, argv: list[str], name: str, env: dict[str, str]) -> None:
            with (logs / f"{name}.log").open("wb") as out:
                procs.append(
                    subprocess.Popen(
                        host.argv(*argv),
                        cwd=REPO,
                        env={**os.environ, **env},
                        stdout=out,
                        stderr=subprocess.STDOUT,
                    )
                )

        def service(host: Host, role: str, name: str, **extra: str) -> None:
            upper = f"ROBUSTRL_{role.upper()}_"
            env = {
                **member_env(endpoints, PREFIX, role, name),
                f"{upper}BIND_HOST": host.address,
                **{upper + k: v for k, v in extra.items()},
            }
            start(host, member_argv(role), name, env)

        def cli(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
            env = {
                **os.environ,
                "ROBUSTRL_ETCD_ENDPOINTS": endpoints,
                "ROBUSTRL_ETCD_PREFIX": PREFIX,
            }
            return subprocess.run(
                a.argv(sys.executable, "-m", "robustrl.cli.main", *args),
                cwd=REPO,
                env=env,
                capture_output=True,
                text=True,
                timeout=timeout,
            )

        try:
            start(
                a,
                [
                    *etcd_argv("hosts", tmp_path / "etcd", etcd_port, etcd_peer),
                    f"--listen-client-urls=http://{a.address}:{etcd_port}",
                    f"--advertise-client-urls=http://{a.address}:{etcd_port}",
                    "--log-level=error",
                ],
                "etcd",
                {},
            )
            service(a, "coordinator", "coordinator-0", PROVISIONER="none")
            service(a, "monitor", "monitor-0")
            trainer = {"RUNS_DIR": str(runs), "TORCH_THREADS": "1"}
            service(a, "trainer", "trainer-0", **trainer)
            service(b, "trainer", "trainer-1", **trainer)
            service(a, "rollout", "rollout-0", TORCH_THREADS="1")
            service(b, "rollout", "rollout-1", TORCH_THREADS="1")
            deadline = time.monotonic() + 120
            while True:
                listed = cli("members", "--json")
                if listed.returncode == 0 and len(json.loads(listed.stdout)) >= 6:
                    break
                assert time.monotonic() < deadline, listed.stdout + listed.stderr
                time.sleep(1)
            submitted = cli(
                "submit",
                str(EXAMPLE),
                "--id",
                "hosts",
                f"model.path={model_dir}",
                f"trainer.steps={STEPS}",
                "trainer.checkpoint_every=3",
                "trainer.eval_every=1000",
                "trainer.groups_per_step=4",
                "trainer.strategy=fsdp",
                "trainer.world_size=2",
                "trainer.weight_bucket_mib=1",  # the model's 1.1 MiB: a bucket for each rank
                "rollout.replicas=2",
            )
            assert submitted.returncode == 0, submitted.stdout + submitted.stderr
            members: list[dict[str, object]] = []
            watched = cli("watch", "hosts", timeout=300)
            assert watched.returncode == 0, watched.stdout + watched.stderr + _tails(logs)
            members = json.loads(cli("members", "--json").stdout)
        finally:
            for proc in reversed(procs):
                if proc.poll() is None:
                    proc.terminate()
            for proc in reversed(procs):
                try:
                    proc.wait(20)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()

    trainer_1 = (logs / "trainer-1.log").read_text()
    # Rank 1 on host b found rank 0's store on host a through etcd, and trained to the end.
    assert f"master={a.address}:" in trainer_1 and "trainer.rank_finished" in trainer_1
    assert "rank_joined" in trainer_1
    # Both ranks wrote their shards of the last checkpoint into the folder both hosts see.
    latest = checkpoint.load_latest(runs / "hosts" / "checkpoints")
    assert latest is not None and latest.sharded and latest.step == STEPS
    assert sorted(p.name for p in latest.path.glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]
    # Each rank served its share of the versions: the second bucket, rank 1's, is held by
    # nobody else until a rollout has pulled it; rollout-1 on host b pulled the first one
    # across the link (from rank 0, or from rollout-0 relaying it), and its trajectory stream
    # reached rank 0. (`sources` counts buckets by holder since the rollout started.)
    rollout_1 = (logs / "rollout-1.log").read_text()
    rollout_0 = (logs / "rollout-0.log").read_text()
    last = {}
    for name, text in (("rollout-0", rollout_0), ("rollout-1", rollout_1)):
        pulls = [line for line in text.splitlines() if "weights.pulled" in line]
        assert pulls, text[-3000:]
        last[name] = pulls[-1]
    assert "'trainer-1'" in last["rollout-0"] + last["rollout-1"], last
    assert "'trainer-0'" in last["rollout-1"] or "'rollout-0'" in last["rollout-1"], last
    # Its trajectory stream to rank 0 was open until rank 0 left the job at the end.
    assert "this trainer no longer works on job hosts" in rollout_1, rollout_1[-3000:]
    assert {m["instance_id"] for m in members} >= {"trainer-0", "trainer-1"}


def _tails(logs: Path) -> str:
    return "".join(f"\n--- {p.name}\n{p.read_text()[-2000:]}" for p in sorted(logs.iterdir()))
