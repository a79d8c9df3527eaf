from __future__ import annotations

import pytest
from pydantic import ValidationError

from robustrl.core.config import EtcdSettings


def test_endpoints_parse() -> None:
    s = EtcdSettings(endpoints="a:1, http://b:2")
    assert s.endpoint_list() == [("a", 1), ("b", 2)]


def test_bad_endpoint_is_named() -> None:
    with pytest.raises(ValueError, match="'nope'"):
        EtcdSettings(endpoints="nope").endpoint_list()


def test_env_prefix_and_prefix_shape(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ROBUSTRL_ETCD_PREFIX", "/other")
    assert EtcdSettings().prefix == "/other"
    with pytest.raises(ValidationError):
        EtcdSettings(prefix="no-slash")
