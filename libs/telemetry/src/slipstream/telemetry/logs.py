"""Structured logs: structlog JSON lines on stderr, stamped with service, replica and trace ids.

Every service calls `setup_logging` once at start. structlog loggers and plain stdlib loggers
(nats, botocore, asyncio ...) both end in one stderr handler, so every line has the same shape:
`{"event": ..., "level": ..., "timestamp": ..., "service": ..., "replica": ..., "trace_id": ...}`.
Trace and span ids come from the current OpenTelemetry span, which ties a log line to its trace.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import MutableMapping
from typing import Any, TextIO

import structlog
from opentelemetry import trace

from slipstream.telemetry.config import TelemetryConfig

EventDict = MutableMapping[str, Any]

# The handler we installed on the root logger, so a second setup (or reset) replaces it
# instead of stacking duplicates.
_handler: logging.Handler | None = None
_root_level: int | None = None


def add_trace_context(logger: Any, method: str, event_dict: EventDict) -> EventDict:
    """structlog processor: `trace_id` (32 hex) and `span_id` (16 hex) of the current span, if any."""
    ctx = trace.get_current_span().get_span_context()
    if ctx.is_valid:
        event_dict.setdefault("trace_id", format(ctx.trace_id, "032x"))
        event_dict.setdefault("span_id", format(ctx.span_id, "016x"))
    return event_dict


class StaticFields:
    """structlog processor adding fixed fields (service, replica, run id) to every line."""

    def __init__(self, fields: dict[str, Any]) -> None:
        self.fields = fields

    def __call__(self, logger: Any, method: str, event_dict: EventDict) -> EventDict:
        for k, v in self.fields.items():
            event_dict.setdefault(k, v)
        return event_dict


def setup_logging(service: str, cfg: TelemetryConfig, *, stream: TextIO | None = None, **static: Any) -> None:
    """Route structlog and stdlib logging to one stderr handler (JSON or console renderer).

    `static` fields (replica=..., run_id=...) appear on every line next to `service`. Calling it
    again reconfigures; `stream` defaults to sys.stderr at call time.
    """
    global _handler, _root_level
    level = logging.getLevelNamesMapping()[cfg.log_level.upper()]
    shared: list[Any] = [
        structlog.contextvars.merge_contextvars,
        structlog.stdlib.add_log_level,
        structlog.stdlib.add_logger_name,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
        StaticFields({"service": service, **{k: v for k, v in static.items() if v not in (None, "")}}),
        add_trace_context,
    ]
    renderer: Any
    if cfg.log_format == "console":
        out = stream or sys.stderr
        renderer = structlog.dev.ConsoleRenderer(colors=bool(getattr(out, "isatty", lambda: False)()))
        final: list[Any] = [structlog.stdlib.ProcessorFormatter.remove_processors_meta, renderer]
    else:
        final = [
            structlog.stdlib.ProcessorFormatter.remove_processors_meta,
            structlog.processors.format_exc_info,
            structlog.processors.JSONRenderer(),
        ]
    structlog.configure(
        processors=[
            structlog.stdlib.filter_by_level,
            *shared,
            structlog.processors.StackInfoRenderer(),
            structlog.stdlib.PositionalArgumentsFormatter(),
            structlog.stdlib.ProcessorFormatter.wrap_for_formatter,
        ],
        logger_factory=structlog.stdlib.LoggerFactory(),
        wrapper_class=structlog.stdlib.BoundLogger,
        cache_logger_on_first_use=False,
    )
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.setFormatter(structlog.stdlib.ProcessorFormatter(processors=final, foreign_pre_chain=shared))
    root = logging.getLogger()
    if _handler is not None:
        root.removeHandler(_handler)
    if _root_level is None:
        _root_level = root.level
    root.addHandler(handler)
    root.setLevel(level)
    _handler = handler


def reset_logging() -> None:
    """Undo `setup_logging` (tests): structlog defaults, our root handler removed, root level restored."""
    global _handler, _root_level
    structlog.reset_defaults()
    structlog.contextvars.clear_contextvars()
    root = logging.getLogger()
    if _handler is not None:
        root.removeHandler(_handler)
        _handler = None
    if _root_level is not None:
        root.setLevel(_root_level)
        _root_level = None


def get_logger(name: str | None = None, **initial: Any) -> Any:
    """A structlog logger (a lazy proxy, so it follows a later `setup_logging`)."""
    return structlog.get_logger(name, **initial)
