"""Logging: one structlog logger per role with the role (and a request's rid, where
there is one) bound, on top of the standard library's `logging`.

Library code never configures logging: `get_logger` wraps `logging.getLogger("sgl.
<role>")` with its own processors, touching neither structlog's global configuration
nor the root logger, so an app that embeds an engine keeps its own handlers, levels
and format. `configure_logging(level)` is for sgl's own processes (the CLI, `sgl
serve`, the child roles) and for users who want sgl's console format: it gives the
"sgl" logger one stderr handler and a level, and nothing else. Bottom layer: imports
nothing of sgl."""

from __future__ import annotations

import logging
import sys

import structlog

LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING, "error": logging.ERROR}
ROOT = "sgl"


def _to_stdlib(logger: object, method: str, event: structlog.typing.EventDict) -> dict[str, object]:
    """The event and its fields as one message line; a traceback is left to the stdlib
    handler (exc_info), which formats it once."""
    exc_info = event.pop("exc_info", None)
    text = str(event.pop("event", ""))
    fields = " ".join(f"{k}={v}" for k, v in sorted(event.items()))
    return {"msg": f"{text} {fields}" if fields else text, "exc_info": exc_info}


# Filtered first by the stdlib logger's level: a disabled line costs one check.
_PROCESSORS: list[structlog.typing.Processor] = [structlog.stdlib.filter_by_level, _to_stdlib]


def get_logger(role: str, **bound: object) -> structlog.stdlib.BoundLogger:
    """A logger named sgl.<role> with `role` (and `bound`) in every line."""
    logger = structlog.wrap_logger(logging.getLogger(f"{ROOT}.{role}"), processors=_PROCESSORS,
                                   wrapper_class=structlog.stdlib.BoundLogger, cache_logger_on_first_use=True)
    return logger.bind(role=role, **bound)


def configure_logging(level: str = "warning") -> None:
    """sgl's console format on stderr for the "sgl" loggers, at `level`; calling it
    again replaces the handler it added before. It leaves the root logger alone."""
    log = logging.getLogger(ROOT)
    for h in [h for h in log.handlers if getattr(h, "_sgl", False)]:
        log.removeHandler(h)
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(asctime)s [%(levelname)-7s] %(message)s", "%H:%M:%S"))
    handler._sgl = True  # type: ignore[attr-defined]
    log.addHandler(handler)
    log.setLevel(LEVELS.get(level, logging.WARNING))
    log.propagate = False
