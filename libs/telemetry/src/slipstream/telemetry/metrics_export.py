"""OpenTelemetry export of the metrics registry: the series /metrics serves, pushed over OTLP too.

The registry in `metrics.py` stays the one place values are recorded. At each export the
registry is read and converted to the OpenTelemetry data model (counters -> cumulative monotonic
sums, gauges -> gauges, histograms -> cumulative explicit-bucket histograms with the registry's
own bounds), then handed to an OTel metric exporter: OTLP/HTTP when an endpoint is set, the
console exporter for people. Reading the registry, rather than recording every value twice
through the OTel API, keeps the hot path a dict add, and the OTel API has no observable
histogram (the SDK in use has no MetricProducer either) that could mirror ours.

Names stay paths (`bus/publish/messages`); OTel allows '/' in instrument names, and a collector
exporting to Prometheus turns them into the same `bus_publish_messages_total` that /metrics
serves. No unit is set, so no unit suffix is added on the way.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Mapping
from typing import Any

from opentelemetry.sdk.metrics.export import (
    AggregationTemporality,
    ConsoleMetricExporter,
    Gauge,
    Histogram,
    HistogramDataPoint,
    Metric,
    MetricExporter,
    MetricExportResult,
    MetricsData,
    NumberDataPoint,
    ResourceMetrics,
    ScopeMetrics,
    Sum,
)
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.util.instrumentation import InstrumentationScope

from slipstream.telemetry.config import TelemetryConfig
from slipstream.telemetry.metrics import REGISTRY, Counter, LabelKey, Registry
from slipstream.telemetry.metrics import Gauge as RegistryGauge

_log = logging.getLogger(__name__)
_SCOPE = InstrumentationScope("slipstream.telemetry")
OTLP_METRICS_VARS = ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_METRICS_ENDPOINT")

EXPORTS = REGISTRY.counter("telemetry/metrics/exports", "OpenTelemetry metric exports, by result.")

_lock = threading.Lock()
_pusher: MetricsPusher | None = None


def effective_metrics_mode(cfg: TelemetryConfig, environ: Mapping[str, str] | None = None) -> str:
    """What `metrics` resolves to: 'auto' becomes 'otlp' when an OTLP endpoint is set, else 'none'."""
    if cfg.metrics != "auto":
        return cfg.metrics
    env = os.environ if environ is None else environ
    return "otlp" if any(env.get(v) for v in OTLP_METRICS_VARS) else "none"


def _attributes(key: LabelKey) -> dict[str, str]:
    return dict(key)


def _number(value: float) -> int | float:
    # Counters of messages and bytes are whole numbers; OTLP then carries them as integers.
    return int(value) if value.is_integer() else value


def metrics_data(registry: Registry, resource: Resource, *, start_ns: int, now_ns: int | None = None) -> MetricsData:
    """The registry's current values as one OTel `MetricsData` (cumulative since `start_ns`).

    Instruments with no recorded value yet are left out, as /metrics renders no sample for them.
    """
    now = time.time_ns() if now_ns is None else now_ns
    out: list[Metric] = []
    for inst in registry.instruments():
        data: Sum | Gauge | Histogram
        if isinstance(inst, Counter):
            values = inst.snapshot()
            if not values:
                continue
            data = Sum(
                data_points=[
                    NumberDataPoint(_attributes(k), start_ns, now, _number(v)) for k, v in sorted(values.items())
                ],
                aggregation_temporality=AggregationTemporality.CUMULATIVE,
                is_monotonic=True,
            )
        elif isinstance(inst, RegistryGauge):
            values = inst.snapshot()
            if not values:
                continue
            data = Gauge(
                data_points=[NumberDataPoint(_attributes(k), start_ns, now, v) for k, v in sorted(values.items())]
            )
        else:
            series = inst.snapshot()
            if not series:
                continue
            points = []
            for key, s in sorted(series.items()):
                counts = [int(c) for c in s[:-1]]
                points.append(
                    HistogramDataPoint(
                        attributes=_attributes(key),
                        start_time_unix_nano=start_ns,
                        time_unix_nano=now,
                        count=sum(counts),
                        sum=s[-1],
                        bucket_counts=counts,
                        explicit_bounds=list(inst.buckets),
                        # The registry keeps no extremes; None leaves the optional OTLP fields unset.
                        min=None,  # type: ignore[arg-type]
                        max=None,  # type: ignore[arg-type]
                    )
                )
            data = Histogram(data_points=points, aggregation_temporality=AggregationTemporality.CUMULATIVE)
        out.append(Metric(name=inst.name, description=inst.description or None, unit=None, data=data))
    scope = ScopeMetrics(scope=_SCOPE, metrics=out, schema_url="")
    return MetricsData(resource_metrics=[ResourceMetrics(resource=resource, scope_metrics=[scope], schema_url="")])


class MetricsPusher:
    """A daemon thread that exports the registry every `interval_s`, and once more on shutdown."""

    def __init__(
        self,
        exporter: MetricExporter,
        resource: Resource,
        *,
        interval_s: float,
        registry: Registry = REGISTRY,
    ) -> None:
        if interval_s <= 0:
            raise ValueError(f"metrics export interval must be > 0 s, not {interval_s}")
        self.exporter = exporter
        self.resource = resource
        self.interval_s = interval_s
        self.registry = registry
        self.start_ns = time.time_ns()
        self.exported = 0
        self.failed = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> MetricsPusher:
        self._thread = threading.Thread(target=self._loop, name="slipstream-metrics-export", daemon=True)
        self._thread.start()
        return self

    def export_now(self) -> bool:
        """Export the current values once; False (counted and logged) when the exporter failed."""
        data = metrics_data(self.registry, self.resource, start_ns=self.start_ns)
        try:
            # The exporter's own timeout applies (OTEL_EXPORTER_OTLP_TIMEOUT for OTLP).
            result = self.exporter.export(data)
        except Exception as exc:  # an exporter bug must not end the loop: count, log, try next time
            result = MetricExportResult.FAILURE
            _log.warning("metrics export raised: %r", exc)
        if result is MetricExportResult.SUCCESS:
            self.exported += 1
            EXPORTS.add(1, result="ok")
            return True
        self.failed += 1
        EXPORTS.add(1, result="failed")
        _log.warning("metrics export failed (%d so far); these values go out with the next export", self.failed)
        return False

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.export_now()

    def shutdown(self, timeout_s: float = 5.0) -> None:
        """Stop the thread, export the last values, close the exporter.

        All within `timeout_s`: a collector that is down must not hold up the process's exit (the
        OTLP exporter retries for its own OTEL_EXPORTER_OTLP_TIMEOUT, whatever it is asked), so
        an export still running then is abandoned with its daemon thread, and logged.
        """
        deadline = time.monotonic() + timeout_s
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
            self._thread = None
        last = threading.Thread(target=self.export_now, name="slipstream-metrics-last-export", daemon=True)
        last.start()
        last.join(max(0.0, deadline - time.monotonic()))
        if last.is_alive():
            _log.warning("last metrics export still running after %.1f s; abandoned", timeout_s)
            return
        self.exporter.shutdown(timeout_millis=max(0.0, deadline - time.monotonic()) * 1000)


def _exporter(mode: str) -> MetricExporter:
    if mode == "console":
        return ConsoleMetricExporter()
    if mode == "otlp":
        # Lazy: protobuf and requests load only for runs that export. No arguments, so the
        # OTEL_EXPORTER_OTLP_* variables (endpoint, headers, timeout) apply.
        from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter

        return OTLPMetricExporter()
    raise ValueError(f"unknown telemetry.metrics mode {mode!r}")


def setup_metrics(
    service: str,
    cfg: TelemetryConfig,
    *,
    replica: str = "",
    environ: Mapping[str, str] | None = None,
    exporter: MetricExporter | None = None,
) -> MetricsPusher | None:
    """Start pushing the registry with OpenTelemetry (once per process); None when `metrics` is 'none'.

    `exporter` replaces the one the mode names (tests). /metrics is served either way.
    """
    global _pusher
    from slipstream.telemetry.tracing import service_resource

    mode = effective_metrics_mode(cfg, environ)
    with _lock:
        if _pusher is not None:
            return _pusher
        if mode == "none" and exporter is None:
            return None
        chosen = exporter or _exporter(mode)
        _pusher = MetricsPusher(chosen, service_resource(service, replica), interval_s=cfg.metrics_interval_s).start()
        _log.info("exporting metrics every %.0f s (%s)", cfg.metrics_interval_s, type(chosen).__name__)
        return _pusher


def shutdown_metrics(timeout_s: float = 5.0) -> None:
    """Export the last values and stop (at process exit); nothing when metrics export is off."""
    global _pusher
    with _lock:
        pusher, _pusher = _pusher, None
    if pusher is not None:
        pusher.shutdown(timeout_s)


def pusher_state() -> dict[str, Any]:
    """What the process-wide pusher did so far (for a status endpoint or a test)."""
    p = _pusher
    if p is None:
        return {"enabled": False}
    return {"enabled": True, "exported": p.exported, "failed": p.failed, "interval_s": p.interval_s}
