"""The README's configuration section names every setting a service reads."""

from __future__ import annotations

import re
from pathlib import Path

from robustrl.core.config import EtcdSettings, ServiceSettings
from services.coordinator.config import CoordinatorSettings
from services.monitor.config import MonitorSettings
from services.rollout.config import RolloutSettings
from services.trainer.config import TrainerSettings

REPO = Path(__file__).resolve().parents[2]


def configuration_section() -> str:
    readme = (REPO / "README.md").read_text()
    found = re.search(r"^## Configuration\n(.*?)^## ", readme, flags=re.MULTILINE | re.DOTALL)
    assert found, "README.md has no Configuration section"
    return found.group(1)


def test_the_readme_names_every_setting() -> None:
    named = set(re.findall(r"`([A-Z0-9_]+)`", configuration_section()))
    expected = {f"ROBUSTRL_ETCD_{field.upper()}" for field in EtcdSettings.model_fields}
    for cls in (
        ServiceSettings,
        CoordinatorSettings,
        MonitorSettings,
        TrainerSettings,
        RolloutSettings,
    ):
        expected |= {field.upper() for field in cls.model_fields}
    missing = sorted(expected - named)
    assert not missing, f"README.md's Configuration section does not name {missing}"
