"""A span exporter that appends finished spans to a JSON-lines file, one span per line.

`slipstream up --traces FILE` points every service of the local stack at one file, so a whole
trace (task -> rollout -> scoring -> learner step, joined by parent ids and links) can be read
back without a collector. Each batch is written with a single O_APPEND `write`, which keeps
lines from several processes whole on a local filesystem. `read_spans` reads such files back
(`slipstream report`, the trace tests).
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import msgspec
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

_encoder = msgspec.json.Encoder()
_log = logging.getLogger(__name__)


def _hex_trace(trace_id: int) -> str:
    return format(trace_id, "032x")


def _hex_span(span_id: int) -> str:
    return format(span_id, "016x")


def _attrs(attributes: Mapping[str, Any] | None) -> dict[str, Any]:
    # OTel attribute values are scalars or tuples of scalars; JSON wants lists.
    return {k: list(v) if isinstance(v, tuple) else v for k, v in (attributes or {}).items()}


def span_record(span: ReadableSpan) -> dict[str, Any]:
    """The JSON-able form of one finished span (the schema of a line in the file)."""
    ctx = span.get_span_context()
    assert ctx is not None, "a finished SDK span always has a context"
    return {
        "trace_id": _hex_trace(ctx.trace_id),
        "span_id": _hex_span(ctx.span_id),
        "parent_span_id": _hex_span(span.parent.span_id) if span.parent is not None else None,
        "name": span.name,
        "kind": span.kind.name.lower(),
        "service": str(span.resource.attributes.get("service.name", "")),
        "start_ns": span.start_time,
        "end_ns": span.end_time,
        "status": span.status.status_code.name.lower(),
        "attributes": _attrs(span.attributes),
        "links": [
            {
                "trace_id": _hex_trace(link.context.trace_id),
                "span_id": _hex_span(link.context.span_id),
                "attributes": _attrs(link.attributes),
            }
            for link in span.links
        ],
        "events": [{"name": e.name, "time_ns": e.timestamp, "attributes": _attrs(e.attributes)} for e in span.events],
    }


class SpanFileExporter(SpanExporter):
    """Appends spans as JSON lines to `path` (created with its parent directory if missing)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._fd: int | None = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        self._lock = threading.Lock()
        self.dropped = 0

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        if not spans:
            return SpanExportResult.SUCCESS
        data = b"".join(_encoder.encode(span_record(s)) + b"\n" for s in spans)
        with self._lock:
            if self._fd is None:
                self.dropped += len(spans)
                _log.warning("span file exporter is shut down; %d spans dropped", len(spans))
                return SpanExportResult.FAILURE
            try:
                os.write(self._fd, data)
            except OSError as exc:
                self.dropped += len(spans)
                _log.warning("span file write failed; %d spans dropped (%d so far): %s", len(spans), self.dropped, exc)
                return SpanExportResult.FAILURE
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        with self._lock:
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return True


def read_spans(paths: Iterable[str | Path]) -> tuple[list[dict[str, Any]], int]:
    """Every span record in these files, and how many lines could not be read.

    A process killed mid-write can leave a torn last line; such lines are skipped, counted and
    logged rather than failing the whole read. A missing file is an error (a wrong path).
    """
    spans: list[dict[str, Any]] = []
    bad = 0
    for path in paths:
        for n, line in enumerate(Path(path).read_bytes().splitlines(), 1):
            if not line.strip():
                continue
            try:
                record = msgspec.json.decode(line)
            except msgspec.DecodeError:
                record = None
            if not isinstance(record, dict) or "span_id" not in record or "trace_id" not in record:
                bad += 1
                _log.warning("%s:%d is not a span record; skipped", path, n)
                continue
            spans.append(record)
    return spans, bad
