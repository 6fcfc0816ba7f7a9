"""Slipstream telemetry: structured logs with trace ids, OpenTelemetry tracing, a metrics registry.

Names are loaded on first use (PEP 562), so importing `slipstream.telemetry.config` for a
service's `--help` does not pay for structlog and the OpenTelemetry SDK.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from slipstream.telemetry.config import TelemetryConfig
    from slipstream.telemetry.logs import add_trace_context, get_logger, reset_logging, setup_logging
    from slipstream.telemetry.spanfile import SpanFileExporter
    from slipstream.telemetry.tracing import memory_exporter, setup_tracing, shutdown_tracing, tracer

_EXPORTS = {
    "TelemetryConfig": "slipstream.telemetry.config",
    "add_trace_context": "slipstream.telemetry.logs",
    "get_logger": "slipstream.telemetry.logs",
    "reset_logging": "slipstream.telemetry.logs",
    "setup_logging": "slipstream.telemetry.logs",
    "SpanFileExporter": "slipstream.telemetry.spanfile",
    "memory_exporter": "slipstream.telemetry.tracing",
    "setup_tracing": "slipstream.telemetry.tracing",
    "shutdown_tracing": "slipstream.telemetry.tracing",
    "tracer": "slipstream.telemetry.tracing",
}

__all__ = [
    "SpanFileExporter",
    "TelemetryConfig",
    "add_trace_context",
    "get_logger",
    "memory_exporter",
    "reset_logging",
    "setup_logging",
    "setup_tracing",
    "shutdown_tracing",
    "tracer",
]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'slipstream.telemetry' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
