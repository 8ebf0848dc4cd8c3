"""Logging setup: structlog to stderr, one logger per role with the role bound.
Bottom layer: imports nothing of sgl."""

from __future__ import annotations

import logging
import sys

import structlog

_LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING, "error": logging.ERROR}


def configure(level: str = "warning") -> None:
    structlog.configure(
        processors=[
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="%H:%M:%S", utc=False),
            structlog.processors.format_exc_info,
            structlog.dev.ConsoleRenderer(colors=False),
        ],
        wrapper_class=structlog.make_filtering_bound_logger(_LEVELS.get(level, logging.WARNING)),
        logger_factory=structlog.PrintLoggerFactory(sys.stderr),
        cache_logger_on_first_use=False,
    )


def get_logger(role: str, **bound: object) -> structlog.typing.FilteringBoundLogger:
    return structlog.get_logger(f"sgl.{role}").bind(role=role, **bound)
