"""structlog, configured once per process.

Events are stable dotted names (`coordinator.elected`, `monitor.incident`), never sentences;
context is bound as keys: service, instance, job, step, version.
"""

from __future__ import annotations

import logging
import sys
from typing import Any

import structlog

_configured = False


def configure_logging(
    *, service: str, instance: str, fmt: str = "console", level: str = "info"
) -> None:
    """Set up structlog for this process; later calls only rebind service/instance."""
    global _configured
    if not _configured:
        renderer: Any = (
            structlog.processors.JSONRenderer()
            if fmt == "json"
            else structlog.dev.ConsoleRenderer(colors=sys.stderr.isatty())
        )
        structlog.configure(
            processors=[
                structlog.contextvars.merge_contextvars,
                structlog.processors.add_log_level,
                structlog.processors.TimeStamper(fmt="iso", utc=True),
                structlog.processors.format_exc_info,
                renderer,
            ],
            wrapper_class=structlog.make_filtering_bound_logger(
                logging.getLevelNamesMapping().get(level.upper(), logging.INFO)
            ),
            logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
            cache_logger_on_first_use=True,
        )
        _configured = True
    structlog.contextvars.bind_contextvars(service=service, instance=instance)


def get_logger(name: str) -> Any:
    return structlog.get_logger(name)
