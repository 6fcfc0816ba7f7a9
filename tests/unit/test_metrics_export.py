"""The registry's series, read back two ways: as OpenTelemetry metrics data and from the Prometheus text."""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
from opentelemetry.exporter.otlp.proto.common.metrics_encoder import encode_metrics
from opentelemetry.sdk.metrics.export import (
    AggregationTemporality,
    Gauge,
    Histogram,
    MetricExporter,
    MetricExportResult,
    MetricsData,
    Sum,
)
from opentelemetry.sdk.resources import Resource

from slipstream.telemetry.config import TelemetryConfig
from slipstream.telemetry.exposition import parse_prometheus
from slipstream.telemetry.metrics import Registry
from slipstream.telemetry.metrics_export import MetricsPusher, effective_metrics_mode, metrics_data
from slipstream.telemetry.spanfile import read_spans

pytestmark = pytest.mark.unit

RESOURCE = Resource.create({"service.name": "svc-under-test"})


def filled_registry() -> Registry:
    reg = Registry()
    reg.counter("svc/publish/messages", "Messages.").add(3, stream="TASKS")
    reg.counter("svc/publish/messages").add(2.5, stream="DLQ")
    reg.counter("svc/publish/unused", "Never incremented.")
    reg.gauge("svc/engine/tokens_per_s", "Tokens per second.").set(1234.5)
    h = reg.histogram("svc/step/staleness", "Versions behind.", buckets=(0, 1, 2))
    for v in (0, 0, 1, 2, 5):
        h.observe(v)
    return reg


def by_name(data: MetricsData) -> dict[str, Any]:
    (rm,) = data.resource_metrics
    (sm,) = rm.scope_metrics
    return {m.name: m for m in sm.metrics}


def test_counters_gauges_and_histograms_become_otel_sums_gauges_and_histograms() -> None:
    data = metrics_data(filled_registry(), RESOURCE, start_ns=100, now_ns=200)
    metrics = by_name(data)
    assert set(metrics) == {"svc/publish/messages", "svc/engine/tokens_per_s", "svc/step/staleness"}

    counter = metrics["svc/publish/messages"]
    assert isinstance(counter.data, Sum) and counter.data.is_monotonic
    assert counter.data.aggregation_temporality is AggregationTemporality.CUMULATIVE
    points = {dict(p.attributes or {})["stream"]: p for p in counter.data.data_points}
    assert points["TASKS"].value == 3 and isinstance(points["TASKS"].value, int)
    assert points["DLQ"].value == 2.5
    assert (points["TASKS"].start_time_unix_nano, points["TASKS"].time_unix_nano) == (100, 200)

    gauge = metrics["svc/engine/tokens_per_s"]
    assert isinstance(gauge.data, Gauge)
    assert [p.value for p in gauge.data.data_points] == [1234.5]

    hist = metrics["svc/step/staleness"]
    assert isinstance(hist.data, Histogram)
    (p,) = hist.data.data_points
    # Buckets (le 0, le 1, le 2, +Inf) hold 2, 1, 1 and 1 observations; the sum is 0+0+1+2+5.
    assert list(p.explicit_bounds) == [0, 1, 2]
    assert list(p.bucket_counts) == [2, 1, 1, 1]
    assert (p.count, p.sum) == (5, 8.0)
    assert counter.description == "Messages." and counter.unit is None


def test_the_otel_data_encodes_as_an_otlp_request_with_the_same_values() -> None:
    request = encode_metrics(metrics_data(filled_registry(), RESOURCE, start_ns=1, now_ns=2))
    (rm,) = request.resource_metrics
    assert {kv.key: kv.value.string_value for kv in rm.resource.attributes}["service.name"] == "svc-under-test"
    metrics = {m.name: m for m in rm.scope_metrics[0].metrics}
    hist = metrics["svc/step/staleness"].histogram.data_points[0]
    assert list(hist.bucket_counts) == [2, 1, 1, 1] and hist.count == 5
    assert not hist.HasField("min") and not hist.HasField("max")
    sums = {dp.attributes[0].value.string_value: dp for dp in metrics["svc/publish/messages"].sum.data_points}
    assert sums["TASKS"].as_int == 3 and sums["DLQ"].as_double == 2.5
    assert metrics["svc/publish/messages"].sum.is_monotonic


def test_an_empty_registry_exports_no_metrics() -> None:
    assert by_name(metrics_data(Registry(), RESOURCE, start_ns=1)) == {}


class Collecting(MetricExporter):
    def __init__(self, results: Sequence[MetricExportResult] = ()) -> None:
        super().__init__()
        self.batches: list[MetricsData] = []
        self.results = list(results)
        self.closed = False

    def export(self, metrics_data: MetricsData, timeout_millis: float = 10_000, **kwargs: Any) -> MetricExportResult:
        self.batches.append(metrics_data)
        return self.results.pop(0) if self.results else MetricExportResult.SUCCESS

    def force_flush(self, timeout_millis: float = 10_000) -> bool:
        return True

    def shutdown(self, timeout_millis: float = 30_000, **kwargs: Any) -> None:
        self.closed = True


def test_the_pusher_exports_the_latest_values_on_shutdown_and_counts_failures() -> None:
    reg = filled_registry()
    exporter = Collecting(results=[MetricExportResult.FAILURE])
    pusher = MetricsPusher(exporter, RESOURCE, interval_s=3600, registry=reg)  # no periodic export in this test
    assert pusher.export_now() is False
    reg.counter("svc/publish/messages").add(10, stream="TASKS")
    pusher.start()
    pusher.shutdown(timeout_s=1)
    assert (pusher.exported, pusher.failed, exporter.closed) == (1, 1, True)
    last = by_name(exporter.batches[-1])["svc/publish/messages"]
    assert {p.attributes["stream"]: p.value for p in last.data.data_points}["TASKS"] == 13


class Hanging(Collecting):
    """An exporter stuck on a collector that does not answer (until released)."""

    def __init__(self) -> None:
        super().__init__()
        self.release = threading.Event()

    def export(self, metrics_data: MetricsData, timeout_millis: float = 10_000, **kwargs: Any) -> MetricExportResult:
        self.release.wait(10)
        return MetricExportResult.FAILURE


def test_shutdown_does_not_wait_past_its_budget_for_a_hung_collector() -> None:
    exporter = Hanging()
    pusher = MetricsPusher(exporter, RESOURCE, interval_s=3600, registry=filled_registry()).start()
    t0 = time.monotonic()
    pusher.shutdown(timeout_s=0.2)
    took = time.monotonic() - t0
    exporter.release.set()
    # Let the abandoned export finish inside this test, so its log line does not outlive it.
    for t in threading.enumerate():
        if t.name == "slipstream-metrics-last-export":
            t.join(5)
    assert 0.15 < took < 0.9, took
    assert not exporter.closed  # abandoned, not closed under a running export


def test_auto_mode_exports_only_when_an_otlp_endpoint_is_set() -> None:
    cfg = TelemetryConfig()
    assert effective_metrics_mode(cfg, {}) == "none"
    assert effective_metrics_mode(cfg, {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318"}) == "otlp"
    assert effective_metrics_mode(cfg, {"OTEL_EXPORTER_OTLP_METRICS_ENDPOINT": "http://c:4318/v1/m"}) == "otlp"
    assert effective_metrics_mode(TelemetryConfig(metrics="none"), {"OTEL_EXPORTER_OTLP_ENDPOINT": "x"}) == "none"
    with pytest.raises(ValueError, match="metrics_interval_s"):
        TelemetryConfig(metrics_interval_s=0)


def test_the_prometheus_text_parses_back_to_the_recorded_values() -> None:
    reg = filled_registry()
    reg.counter("svc/http/requests").add(1, path='/a"b\\c')
    exp = parse_prometheus(reg.render_prometheus())
    assert exp.types["svc_publish_messages"] == "counter"
    assert exp.value("svc_publish_messages_total", stream="TASKS") == 3
    assert exp.total("svc_publish_messages_total") == 5.5
    assert exp.value("svc_engine_tokens_per_s") == 1234.5
    assert exp.value("svc_http_requests_total", path='/a"b\\c') == 1
    assert {"svc_publish_unused", "svc_step_staleness", "svc_publish_messages"} <= exp.families()
    assert exp.family_of("svc_step_staleness_bucket") == "svc_step_staleness"
    buckets, total, count = exp.histogram("svc_step_staleness")
    assert buckets == [(0.0, 2.0), (1.0, 3.0), (2.0, 4.0), (math.inf, 5.0)]
    assert (total, count) == (8.0, 5.0)
    assert exp.histogram_mean("svc_step_staleness") == pytest.approx(1.6)
    assert exp.value("svc_missing") is None and exp.histogram_mean("svc_missing") is None


@pytest.mark.parametrize("line", ["bus publish 1", 'x{a="1" 2', "x{a=1} 2", "x NaNa"])
def test_a_line_outside_the_format_is_an_error_naming_it(line: str) -> None:
    with pytest.raises(ValueError, match="line"):
        parse_prometheus(f"ok_metric 1\n{line}\n")


def test_span_files_read_back_and_torn_lines_are_counted(tmp_path: Path) -> None:
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    a.write_text('{"trace_id": "t1", "span_id": "s1", "name": "x"}\n\n{"trace_id": "t1", "span_id": "s2"}\n')
    b.write_text('{"trace_id": "t2", "span_id": "s3"}\n{"trace_id": "t2", "spa')
    spans, bad = read_spans([a, b])
    assert [s["span_id"] for s in spans] == ["s1", "s2", "s3"]
    assert bad == 1
    with pytest.raises(FileNotFoundError):
        read_spans([tmp_path / "missing.jsonl"])
