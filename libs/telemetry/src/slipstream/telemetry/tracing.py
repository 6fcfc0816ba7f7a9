"""Tracing: one OpenTelemetry TracerProvider per process, its exporter chosen by `[telemetry].traces`.

`setup_tracing` installs the provider once (OpenTelemetry allows `set_tracer_provider` only once
per process); later calls return the same provider. The SDK itself reads the standard OTEL_*
variables (OTEL_SERVICE_NAME, OTEL_RESOURCE_ATTRIBUTES, OTEL_TRACES_SAMPLER, OTEL_BSP_*,
OTEL_EXPORTER_OTLP_*, OTEL_SDK_DISABLED); the only one read here is whether an OTLP endpoint is
set, which is what `traces = "auto"` means. The OTLP exporter is imported only when used.

`traces = "none"` installs no provider at all: the API's no-op default stays, so
`slipstream.bus.tracing.tracing_active()` is False and no span object is made anywhere (an SDK
provider without an exporter would still build, time and drop every span). Spans may carry many
links (a learner step links every trajectory it trained on): the provider keeps up to
`MAX_LINKS` per span unless OTEL_SPAN_LINK_COUNT_LIMIT says otherwise.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Mapping

from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import SpanLimits, SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import (
    BatchSpanProcessor,
    ConsoleSpanExporter,
    SimpleSpanProcessor,
)
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from slipstream.telemetry.config import TelemetryConfig
from slipstream.telemetry.spanfile import SpanFileExporter

_log = logging.getLogger(__name__)
_lock = threading.Lock()
_provider: TracerProvider | None = None
_mode: str = ""
_memory: InMemorySpanExporter | None = None

OTLP_ENDPOINT_VARS = ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
LINK_LIMIT_VAR = "OTEL_SPAN_LINK_COUNT_LIMIT"
MAX_LINKS = 4096
"""Links kept per span: a step of 64 groups x 64 samples still links every trajectory (the SDK's default is 128)."""


def effective_mode(cfg: TelemetryConfig, environ: Mapping[str, str] | None = None) -> str:
    """What `traces` resolves to: 'auto' becomes 'otlp' when an OTLP endpoint is set, else 'none'."""
    if cfg.traces != "auto":
        return cfg.traces
    env = os.environ if environ is None else environ
    return "otlp" if any(env.get(v) for v in OTLP_ENDPOINT_VARS) else "none"


def service_resource(service: str, replica: str = "") -> Resource:
    """The OTel resource of this process: service.name (unless OTEL_SERVICE_NAME says) and instance id."""
    # OTEL_SERVICE_NAME / OTEL_RESOURCE_ATTRIBUTES win over our name, as the OTel spec expects.
    base = Resource.create()
    extra: dict[str, str] = {}
    if str(base.attributes.get("service.name", "")).startswith("unknown_service"):
        extra["service.name"] = service
    if replica:
        extra["service.instance.id"] = replica
    return base.merge(Resource(extra)) if extra else base


def span_limits(environ: Mapping[str, str] | None = None) -> SpanLimits:
    """The provider's limits: `MAX_LINKS` links per span unless OTEL_SPAN_LINK_COUNT_LIMIT is set."""
    env = os.environ if environ is None else environ
    value = env.get(LINK_LIMIT_VAR, "").strip()
    if not value:
        return SpanLimits(max_links=MAX_LINKS)
    try:
        return SpanLimits(max_links=int(value))
    except ValueError as exc:
        raise ValueError(f"{LINK_LIMIT_VAR} must be a non-negative integer, got {value!r}") from exc


def _processor(mode: str, cfg: TelemetryConfig) -> SpanProcessor | None:
    global _memory
    if mode == "none":
        return None
    if mode == "memory":
        _memory = InMemorySpanExporter()
        return SimpleSpanProcessor(_memory)
    if mode == "console":
        return SimpleSpanProcessor(ConsoleSpanExporter())
    if mode == "file":
        if not cfg.traces_file:
            raise ValueError("telemetry.traces='file' needs telemetry.traces_file")
        return BatchSpanProcessor(SpanFileExporter(cfg.traces_file))
    if mode == "otlp":
        # Lazy: the exporter pulls in protobuf and requests, which most runs never need.
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        # No arguments, so OTEL_EXPORTER_OTLP_* (endpoint, headers, timeout) apply.
        return BatchSpanProcessor(OTLPSpanExporter())
    raise ValueError(f"unknown telemetry.traces mode {mode!r}")


def setup_tracing(
    service: str, cfg: TelemetryConfig, *, replica: str = "", environ: Mapping[str, str] | None = None
) -> TracerProvider | None:
    """Install the process's TracerProvider (once) with the exporter `cfg.traces` asks for.

    Returns it, or None when traces are off ("none": no provider is installed, see the module
    docstring). The first call decides; later ones return what it set up.
    """
    global _provider, _mode
    mode = effective_mode(cfg, environ)
    with _lock:
        if _mode:
            if mode != _mode:
                _log.warning("tracing already set up with traces=%s; ignoring traces=%s", _mode, mode)
            return _provider
        current = trace.get_tracer_provider()
        if isinstance(current, TracerProvider):
            # Someone (a test harness, auto-instrumentation) got there first: use theirs.
            _log.warning("a TracerProvider is already installed; slipstream traces=%s not applied", mode)
            _provider, _mode = current, "external"
            return current
        if mode == "none":
            _mode = mode
            return None
        provider = TracerProvider(resource=service_resource(service, replica), span_limits=span_limits(environ))
        processor = _processor(mode, cfg)
        if processor is not None:
            provider.add_span_processor(processor)
        trace.set_tracer_provider(provider)
        _provider, _mode = provider, mode
        return provider


def tracer(name: str) -> trace.Tracer:
    """A tracer from the process's provider (a no-op one until `setup_tracing` ran)."""
    return trace.get_tracer(name)


def memory_exporter() -> InMemorySpanExporter | None:
    """The in-memory exporter installed by `traces = "memory"`, else None."""
    return _memory


def tracing_mode() -> str:
    """The exporter mode in effect ('' before `setup_tracing`)."""
    return _mode


def shutdown_tracing(timeout_s: float = 5.0) -> None:
    """Flush pending spans and stop the exporters (at process exit)."""
    if _provider is None:
        return
    if not _provider.force_flush(int(timeout_s * 1000)):
        _log.warning("span flush did not finish within %.1fs; pending spans dropped", timeout_s)
    _provider.shutdown()
