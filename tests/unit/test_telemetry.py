"""Telemetry: log lines carry service, replica and trace ids; the span file holds whole traces."""

from __future__ import annotations

import io
import json
import logging
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
import structlog
from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.trace import Link

from slipstream.telemetry.config import TelemetryConfig
from slipstream.telemetry.logs import add_trace_context, reset_logging, setup_logging
from slipstream.telemetry.spanfile import SpanFileExporter
from slipstream.telemetry.tracing import effective_mode

pytestmark = pytest.mark.unit


@pytest.fixture
def provider() -> TracerProvider:
    # A local provider: the process-wide one can be set only once, and other suites may need it.
    return TracerProvider(resource=Resource.create({"service.name": "svc-under-test"}))


@pytest.fixture
def log_stream() -> Iterator[io.StringIO]:
    stream = io.StringIO()
    setup_logging("svc-under-test", TelemetryConfig(), stream=stream, replica="r-7", run_id="run-1")
    yield stream
    reset_logging()


def lines(stream: io.StringIO) -> list[dict[str, Any]]:
    return [json.loads(line) for line in stream.getvalue().splitlines()]


def test_log_lines_inside_a_span_carry_its_trace_and_span_ids(
    log_stream: io.StringIO, provider: TracerProvider
) -> None:
    tracer = provider.get_tracer("test")
    log = structlog.get_logger("test.logs")
    log.info("before")
    with tracer.start_as_current_span("outer") as outer, tracer.start_as_current_span("inner") as inner:
        log.info("inside", items=3)
        logging.getLogger("some.stdlib.lib").warning("stdlib says %s", "hi")
    log.info("after")
    before, inside, stdlib, after = lines(log_stream)
    ctx = inner.get_span_context()
    assert inside["trace_id"] == format(ctx.trace_id, "032x") == format(outer.get_span_context().trace_id, "032x")
    assert inside["span_id"] == format(ctx.span_id, "016x")
    assert len(inside["trace_id"]) == 32 and len(inside["span_id"]) == 16
    assert (inside["event"], inside["items"], inside["level"]) == ("inside", 3, "info")
    assert (stdlib["event"], stdlib["level"], stdlib["logger"]) == ("stdlib says hi", "warning", "some.stdlib.lib")
    assert stdlib["span_id"] == inside["span_id"]
    for line in (before, inside, stdlib, after):
        assert (line["service"], line["replica"], line["run_id"]) == ("svc-under-test", "r-7", "run-1")
        assert line["timestamp"].endswith("Z")
    assert "trace_id" not in before and "trace_id" not in after


def test_exceptions_are_logged_with_their_cause(log_stream: io.StringIO) -> None:
    log = structlog.get_logger("test.logs")
    try:
        try:
            raise ConnectionRefusedError("port 4222 closed")
        except ConnectionRefusedError as exc:
            raise RuntimeError("bus unavailable") from exc
    except RuntimeError:
        log.error("setup failed", exc_info=True)
    (line,) = lines(log_stream)
    assert "ConnectionRefusedError: port 4222 closed" in line["exception"]
    assert "RuntimeError: bus unavailable" in line["exception"]
    assert "direct cause" in line["exception"]


def test_level_filters_structlog_and_stdlib_alike() -> None:
    stream = io.StringIO()
    setup_logging("svc", TelemetryConfig(log_level="warning"), stream=stream)
    try:
        structlog.get_logger("a").info("dropped")
        logging.getLogger("b").info("dropped too")
        structlog.get_logger("a").warning("kept")
        logging.getLogger("b").error("kept too")
    finally:
        reset_logging()
    assert [line["event"] for line in lines(stream)] == ["kept", "kept too"]


def test_console_format_is_not_json_but_has_the_fields() -> None:
    stream = io.StringIO()
    setup_logging("svc", TelemetryConfig(log_format="console"), stream=stream, replica="r1")
    try:
        structlog.get_logger("a").info("hello console", n=5)
    finally:
        reset_logging()
    text = stream.getvalue()
    assert not text.startswith("{")
    assert "hello console" in text and "n=5" in text and "replica=r1" in text


def test_trace_processor_leaves_lines_alone_outside_spans(provider: TracerProvider) -> None:
    assert add_trace_context(None, "info", {"event": "x"}) == {"event": "x"}
    with provider.get_tracer("t").start_as_current_span("s") as span:
        out = add_trace_context(None, "info", {"event": "x"})
    assert out["span_id"] == format(span.get_span_context().span_id, "016x")


def test_span_file_holds_parent_ids_links_and_attributes(tmp_path: Path, provider: TracerProvider) -> None:
    path = tmp_path / "traces" / "spans.jsonl"
    exporter = SpanFileExporter(path)
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracer = provider.get_tracer("test")
    producers = []
    for i in range(2):
        with tracer.start_as_current_span(f"publish-{i}", kind=trace.SpanKind.PRODUCER) as p:
            producers.append(p.get_span_context())
    links = [Link(ctx, {"messaging.message.id": f"m{i}"}) for i, ctx in enumerate(producers)]
    attributes = {"batch": 2, "envs": ("a", "b")}
    with tracer.start_as_current_span("learner.step", links=links, attributes=attributes) as root:
        tracer.start_span("loss").end()
    provider.shutdown()
    records = {r["name"]: r for r in (json.loads(line) for line in path.read_text().splitlines())}
    assert sorted(records) == ["learner.step", "loss", "publish-0", "publish-1"]
    step, loss = records["learner.step"], records["loss"]
    assert step["parent_span_id"] is None
    assert loss["parent_span_id"] == step["span_id"] == format(root.get_span_context().span_id, "016x")
    assert loss["trace_id"] == step["trace_id"]
    assert step["attributes"] == {"batch": 2, "envs": ["a", "b"]}
    assert [(link["trace_id"], link["span_id"], link["attributes"]) for link in step["links"]] == [
        (format(c.trace_id, "032x"), format(c.span_id, "016x"), {"messaging.message.id": f"m{i}"})
        for i, c in enumerate(producers)
    ]
    assert records["publish-0"]["kind"] == "producer" and step["kind"] == "internal"
    assert all(r["service"] == "svc-under-test" for r in records.values())
    assert all(0 < r["start_ns"] <= r["end_ns"] for r in records.values())
    assert exporter.dropped == 0


def test_auto_mode_follows_the_otlp_endpoint_variables() -> None:
    auto = TelemetryConfig()
    assert effective_mode(auto, {}) == "none"
    assert effective_mode(auto, {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318"}) == "otlp"
    assert effective_mode(auto, {"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://c:4318/v1/traces"}) == "otlp"
    assert effective_mode(TelemetryConfig(traces="console"), {"OTEL_EXPORTER_OTLP_ENDPOINT": "x"}) == "console"
    with pytest.raises(msgspec.ValidationError, match="traces_file"):
        msgspec.convert({"traces": "file"}, TelemetryConfig)


SETUP_TRACING_SCRIPT = textwrap.dedent(
    """
    import json, sys
    from opentelemetry import trace
    from slipstream.telemetry.config import TelemetryConfig
    from slipstream.telemetry.tracing import setup_tracing, shutdown_tracing, tracer, tracing_mode

    path = sys.argv[1]
    first = setup_tracing("svc-a", TelemetryConfig(traces="file", traces_file=path), replica="rep-1", environ={})
    second = setup_tracing("svc-a", TelemetryConfig(traces="none"), environ={})
    with tracer("t").start_as_current_span("work"):
        pass
    shutdown_tracing()
    print(json.dumps({
        "same": first is second and trace.get_tracer_provider() is first,
        "mode": tracing_mode(),
        "otlp_imported": "opentelemetry.exporter.otlp.proto.http.trace_exporter" in sys.modules,
        "instance": first.resource.attributes.get("service.instance.id"),
    }))
    """
)


def test_setup_tracing_installs_one_provider_and_the_file_exporter(tmp_path: Path) -> None:
    # In a child process: set_tracer_provider works once per process and must not leak into this one.
    path = tmp_path / "spans.jsonl"
    env = {"PATH": "/usr/bin:/bin", "OTEL_SERVICE_NAME": ""}
    out = subprocess.run(
        [sys.executable, "-c", SETUP_TRACING_SCRIPT, str(path)], capture_output=True, text=True, env=env, timeout=30
    )
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    assert result == {"same": True, "mode": "file", "otlp_imported": False, "instance": "rep-1"}
    (span,) = [json.loads(line) for line in path.read_text().splitlines()]
    assert (span["name"], span["service"], span["parent_span_id"]) == ("work", "svc-a", None)
