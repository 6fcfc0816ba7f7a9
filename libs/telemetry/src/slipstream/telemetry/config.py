"""Telemetry configuration section (`[telemetry]`).

Tracing exporters also honour the standard OTEL_* variables (OTEL_EXPORTER_OTLP_ENDPOINT,
OTEL_SERVICE_NAME, ...); these fields only choose what the SDK itself does not.
"""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

Doc = msgspec.Meta


class TelemetryConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    log_level: Annotated[str, Doc(description="debug, info, warning or error.")] = "info"
    log_format: Annotated[Literal["json", "console"], Doc(description="structlog renderer.")] = "json"
    traces: Annotated[
        Literal["auto", "otlp", "console", "memory", "file", "none"],
        Doc(description="Span exporter; 'auto' = OTLP when OTEL_EXPORTER_OTLP_ENDPOINT is set, else none."),
    ] = "auto"
    traces_file: Annotated[str, Doc(description="JSON-lines span file (traces='file').")] = ""
