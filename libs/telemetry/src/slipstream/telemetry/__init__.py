"""Slipstream telemetry: structured logs with trace ids, OpenTelemetry tracing, a metrics registry.

The registry's series are served on /metrics (Prometheus text) and, when an OTLP endpoint is
set, pushed with OpenTelemetry too (`setup_metrics`); `parse_prometheus` reads a scrape back.

Names are loaded on first use (PEP 562), so importing `slipstream.telemetry.config` for a
service's `--help` does not pay for structlog and the OpenTelemetry SDK.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from slipstream.telemetry.config import TelemetryConfig
    from slipstream.telemetry.exposition import Exposition, parse_prometheus
    from slipstream.telemetry.logs import add_trace_context, get_logger, reset_logging, setup_logging
    from slipstream.telemetry.metrics_export import setup_metrics, shutdown_metrics
    from slipstream.telemetry.spanfile import SpanFileExporter, read_spans
    from slipstream.telemetry.tracing import memory_exporter, setup_tracing, shutdown_tracing, tracer

_EXPORTS = {
    "TelemetryConfig": "slipstream.telemetry.config",
    "Exposition": "slipstream.telemetry.exposition",
    "parse_prometheus": "slipstream.telemetry.exposition",
    "setup_metrics": "slipstream.telemetry.metrics_export",
    "shutdown_metrics": "slipstream.telemetry.metrics_export",
    "read_spans": "slipstream.telemetry.spanfile",
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
    "Exposition",
    "SpanFileExporter",
    "TelemetryConfig",
    "add_trace_context",
    "get_logger",
    "memory_exporter",
    "parse_prometheus",
    "read_spans",
    "reset_logging",
    "setup_logging",
    "setup_metrics",
    "setup_tracing",
    "shutdown_metrics",
    "shutdown_tracing",
    "tracer",
]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'slipstream.telemetry' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
