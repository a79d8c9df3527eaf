"""When the monitor starts itself again on jemalloc, and with what environment."""

from __future__ import annotations

from services.monitor.memory import JEMALLOC_CONF, jemalloc_env

LIB = "/usr/lib/x86_64-linux-gnu/libjemalloc.so.2"


def test_the_monitor_moves_to_jemalloc_once_keeping_the_rest_of_its_environment() -> None:
    env = jemalloc_env({"PATH": "/bin", "LD_PRELOAD": "/opt/libx.so"}, "jemalloc", LIB)
    assert env == {
        "PATH": "/bin",
        "LD_PRELOAD": f"{LIB} /opt/libx.so",
        "PYTHONMALLOC": "malloc",
        "MALLOC_CONF": JEMALLOC_CONF,
    }
    # Started again with that environment, it goes on as it is: no second start.
    assert jemalloc_env(env, "jemalloc", LIB) is None


def test_an_operators_jemalloc_settings_are_kept() -> None:
    env = jemalloc_env({"MALLOC_CONF": "narenas:2"}, "jemalloc", LIB)
    assert env is not None and env["MALLOC_CONF"] == "narenas:2"


def test_no_jemalloc_on_the_host_or_the_python_allocator_asked_for_changes_nothing() -> None:
    assert jemalloc_env({}, "jemalloc", None) is None
    assert jemalloc_env({}, "python", LIB) is None
