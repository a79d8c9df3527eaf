"""Every YAML under examples/ and deploy/ (and the compose file) is valid for what reads it.

No Docker engine or cluster runs here, so these checks stand in for `docker compose config`
and `kubectl apply --dry-run`: shape, references between services, and that every
ROBUSTRL_* variable they set is one our settings actually read (a typo would be ignored).
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from pydantic_settings import BaseSettings

from robustrl.cli.stack import etcd_history_flags
from robustrl.contracts.jobspec import parse_spec
from robustrl.core.config import EtcdSettings
from services.coordinator.config import CoordinatorSettings
from services.monitor.config import MonitorSettings
from services.rollout.config import RolloutSettings
from services.trainer.config import TrainerSettings

REPO = Path(__file__).resolve().parents[2]
SETTINGS: list[type[BaseSettings]] = [
    EtcdSettings,
    CoordinatorSettings,
    MonitorSettings,
    TrainerSettings,
    RolloutSettings,
]


def known_env_vars() -> set[str]:
    names = {"ROBUSTRL_HOME"}
    for cls in SETTINGS:
        prefix = str(cls.model_config.get("env_prefix", ""))
        names |= {f"{prefix}{field}".upper() for field in cls.model_fields}
    return names


def dockerfile_targets() -> set[str]:
    text = (REPO / "deploy" / "Dockerfile").read_text()
    return set(re.findall(r"^FROM \S+ AS (\S+)$", text, flags=re.MULTILINE))


@pytest.mark.parametrize("path", sorted((REPO / "examples").glob("*.yaml")), ids=lambda p: p.name)
def test_example_job_specs_validate(path: Path) -> None:
    parse_spec(path.read_text())


def test_compose_file_is_consistent() -> None:
    compose = yaml.safe_load((REPO / "docker-compose.yml").read_text())
    services = compose["services"]
    assert {"etcd", "coordinator", "monitor", "trainer", "rollout"} <= services.keys()
    images_built = {s["image"] for s in services.values() if "build" in s}
    for name, service in services.items():
        for dep in service.get("depends_on", {}):
            assert dep in services, f"{name} depends on unknown service {dep}"
        if "build" in service:
            assert service["build"]["target"] in dockerfile_targets()
            assert (REPO / service["build"]["dockerfile"]).exists()
        elif name != "etcd":
            assert service["image"] in images_built, f"{name} uses an image nothing builds"
        for var in service.get("environment", {}):
            assert var in known_env_vars(), f"{name} sets {var}, which no setting reads"
        for volume in service.get("volumes", []):
            assert volume.split(":")[0] in compose.get("volumes", {})
            if name != "etcd":  # under the folder the image gives the services' user
                assert volume.split(":")[1].startswith("/app/.robustrl/")
        if name in ("coordinator", "monitor", "trainer", "rollout"):
            assert service.get("restart") == "unless-stopped", f"docker would not restart {name}"
        if name in ("trainer", "rollout"):  # a fenced one exits, and comes back as a new one
            assert service["environment"][f"ROBUSTRL_{name.upper()}_EXIT_WHEN_FENCED"] == "true"
        if name == "coordinator":
            # The control image has no model stack: it cannot start trainers or rollouts.
            assert service["environment"].get("ROBUSTRL_COORDINATOR_PROVISIONER") == "none"
        if name == "etcd":
            # The same history retention as the local stack: an uncompacted etcd fills its quota.
            assert set(etcd_history_flags()) <= set(service["command"])
        else:
            module = service["command"][0]
            assert (REPO / module.replace(".", "/") / "__main__.py").exists()


@pytest.mark.parametrize(
    "path", sorted((REPO / "deploy" / "k8s").glob("*.yaml")), ids=lambda p: p.name
)
def test_kubernetes_manifests_are_well_formed(path: Path) -> None:
    docs = [d for d in yaml.safe_load_all(path.read_text()) if d]
    assert docs
    claims = {d["metadata"]["name"] for d in docs if d["kind"] == "PersistentVolumeClaim"}
    for doc in docs:
        assert doc["apiVersion"] and doc["kind"] and doc["metadata"]["name"]
        spec = doc["spec"]
        if doc["kind"] == "PersistentVolumeClaim":
            assert spec["accessModes"] and spec["resources"]["requests"]["storage"]
            continue
        pod = spec["template"]["spec"]
        volumes = {v["name"] for v in pod.get("volumes", [])}
        volumes |= {t["metadata"]["name"] for t in spec.get("volumeClaimTemplates", [])}
        for volume in pod.get("volumes", []):
            if "persistentVolumeClaim" in volume:
                assert volume["persistentVolumeClaim"]["claimName"] in claims
        assert (
            spec["selector"]["matchLabels"].items()
            <= spec["template"]["metadata"]["labels"].items()
        )
        for container in spec["template"]["spec"]["containers"]:
            assert container["image"].split(":")[0] in {"robustrl-control", "robustrl-worker"}
            assert (REPO / container["args"][0].replace(".", "/") / "__main__.py").exists()
            for env in container.get("env", []):
                assert env["name"] in known_env_vars(), f"{env['name']} is read by no setting"
            for mount in container.get("volumeMounts", []):
                assert mount["name"] in volumes, f"{mount['name']} is no volume of the pod"


def test_every_trainer_pod_sees_the_same_checkpoints() -> None:
    # A standby, rescheduled or other trainer pod restores what the lost trainer wrote: one
    # ReadWriteMany claim for the runs, mounted where the trainer writes them.
    docs = [d for d in yaml.safe_load_all((REPO / "deploy/k8s/workers.yaml").read_text()) if d]
    claims = {d["metadata"]["name"]: d for d in docs if d["kind"] == "PersistentVolumeClaim"}
    trainers = [
        d
        for d in docs
        if d["kind"] != "PersistentVolumeClaim"
        and d["spec"]["template"]["spec"]["containers"][0]["args"] == ["services.trainer"]
    ]
    assert len(trainers) == 2  # the trainers and the standby trainers
    for doc in trainers:
        pod = doc["spec"]["template"]["spec"]
        assert "volumeClaimTemplates" not in doc["spec"], "a claim of its own per pod"
        volumes = {v["name"]: v for v in pod["volumes"]}
        [mount] = [m for m in pod["containers"][0]["volumeMounts"] if m["name"] == "runs"]
        assert mount["mountPath"] == "/app/.robustrl/runs" and not mount.get("readOnly")
        claim = volumes["runs"]["persistentVolumeClaim"]["claimName"]
        assert claims[claim]["spec"]["accessModes"] == ["ReadWriteMany"]


def test_dockerfile_passes_hadolint() -> None:
    hadolint = Path(sys.executable).with_name("hadolint")
    result = subprocess.run(
        [str(hadolint), "--no-color", str(REPO / "deploy" / "Dockerfile")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert dockerfile_targets() == {"base", "control", "worker"}
