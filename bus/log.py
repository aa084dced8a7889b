"""Logging: structlog, JSON lines in services, console for people."""

from __future__ import annotations

import logging
import os
import sys
from typing import Any

import structlog


def configure_logging(fmt: str | None = None, level: str | None = None) -> None:
    """JSON lines for services, console for people. Safe to call twice."""
    fmt = fmt or os.environ.get("GEARSHIFT_LOG_FORMAT") or ("console" if sys.stderr.isatty() else "json")
    lvl = getattr(logging, (level or os.environ.get("GEARSHIFT_LOG_LEVEL") or "INFO").upper(), logging.INFO)
    renderer: Any = (
        structlog.dev.ConsoleRenderer(colors=False)
        if fmt == "console"
        else structlog.processors.JSONRenderer()
    )
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.dict_tracebacks if fmt != "console" else structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(lvl),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=False,
    )


def get_logger(**bind: Any) -> Any:
    # get_logger(**initial) stays lazy: binding now would freeze the
    # configuration in force at import time.
    return structlog.get_logger(**bind)
