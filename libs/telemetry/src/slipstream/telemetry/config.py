"""Telemetry configuration section (`[telemetry]`).

Tracing and metrics exporters also honour the standard OTEL_* variables
(OTEL_EXPORTER_OTLP_ENDPOINT, OTEL_SERVICE_NAME, OTEL_TRACES_SAMPLER, OTEL_BSP_*, ...); these
fields only choose what the SDK itself does not.
"""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

Doc = msgspec.Meta


class TelemetryConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    log_level: Annotated[
        Literal["debug", "info", "warning", "error"], Doc(description="debug, info, warning or error.")
    ] = "info"
    log_format: Annotated[
        Literal["json", "console"], Doc(description="structlog renderer: 'json' lines or 'console' for people.")
    ] = "json"
    traces: Annotated[
        Literal["auto", "otlp", "console", "memory", "file", "none"],
        Doc(
            description="Span exporter; 'auto' = OTLP when OTEL_EXPORTER_OTLP_(TRACES_)ENDPOINT is set, else none; "
            "'file' = JSON lines in traces_file; 'memory' = in-process (tests)."
        ),
    ] = "auto"
    traces_file: Annotated[str, Doc(description="JSON-lines span file (traces='file'); appended to.")] = ""
    metrics: Annotated[
        Literal["auto", "otlp", "console", "none"],
        Doc(
            description="Push the /metrics series with OpenTelemetry too; 'auto' = OTLP when "
            "OTEL_EXPORTER_OTLP_(METRICS_)ENDPOINT is set, else none (/metrics is always served)."
        ),
    ] = "auto"
    metrics_interval_s: Annotated[
        float, Doc(description="Seconds between two OpenTelemetry metric exports (when metrics is not 'none').")
    ] = 30.0

    def __post_init__(self) -> None:
        # msgspec turns this ValueError into a ValidationError, so the config loader reports it by name.
        if self.traces == "file" and not self.traces_file:
            raise ValueError("telemetry.traces='file' needs telemetry.traces_file (a path)")
        if not self.metrics_interval_s > 0:
            raise ValueError(f"telemetry.metrics_interval_s must be > 0, not {self.metrics_interval_s}")
