"""Summaries of finished spans (span-file records): where time went per stage, and throughput over time.

Both work on the records `spanfile.read_spans` returns, so they serve `slipstream report` after a
run as well as a test holding spans in memory. A stage is one (service, span name) pair; only a
service's outermost spans count towards it (a span whose parent belongs to another service, or
that has none), so a publish nested in a handler's span is not counted twice.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

Span = Mapping[str, Any]


@dataclass(frozen=True)
class StageTime:
    service: str
    name: str
    count: int
    total_s: float
    """The sum of the spans' durations: spans open at the same time each count, so it can exceed wall time."""
    busy_s: float = 0.0
    """Wall-clock seconds in which at least one of the spans was open (the union of their intervals)."""

    @property
    def mean_s(self) -> float:
        return self.total_s / self.count if self.count else 0.0


def outermost(spans: Iterable[Span]) -> list[Span]:
    """Spans whose parent is not a span of the same service (a message's arrival, a loop's tick)."""
    items = list(spans)
    owner = {s["span_id"]: s.get("service", "") for s in items}
    return [s for s in items if owner.get(s.get("parent_span_id") or "") != s.get("service", "")]


def _duration_s(span: Span) -> float:
    start, end = span.get("start_ns"), span.get("end_ns")
    return max(0.0, (end - start) / 1e9) if isinstance(start, int) and isinstance(end, int) else 0.0


def _covered_s(intervals: list[tuple[int, int]]) -> float:
    """Seconds covered by the union of [start_ns, end_ns) intervals."""
    total, reach = 0, None
    for start, end in sorted(intervals):
        if reach is None or start > reach:
            total += end - start
            reach = end
        elif end > reach:
            total += end - reach
            reach = end
    return total / 1e9


def time_by_stage(spans: Iterable[Span]) -> list[StageTime]:
    """Seconds per (service, span name) over outermost spans, summed and as wall-clock cover; largest sum first."""
    acc: dict[tuple[str, str], list[float]] = {}
    cover: dict[tuple[str, str], list[tuple[int, int]]] = {}
    for s in outermost(spans):
        key = (str(s.get("service", "")), str(s.get("name", "")))
        slot = acc.setdefault(key, [0, 0.0])
        slot[0] += 1
        slot[1] += _duration_s(s)
        start, end = s.get("start_ns"), s.get("end_ns")
        if isinstance(start, int) and isinstance(end, int) and end > start:
            cover.setdefault(key, []).append((start, end))
    stages = [
        StageTime(svc, name, int(c), t, _covered_s(cover.get((svc, name), []))) for (svc, name), (c, t) in acc.items()
    ]
    return sorted(stages, key=lambda st: (-st.total_s, st.service, st.name))


def throughput(
    spans: Iterable[Span], *, buckets: int = 60, min_width_s: float = 1.0
) -> tuple[list[float], dict[str, list[float]]]:
    """Messages per second per service over the run, in at most `buckets` equal time slices.

    Slices are at least `min_width_s` wide, so a short run is not drawn as spikes of single
    messages. A service's messages are its outermost CONSUMER spans (one per message handled); a
    service with none (a source that only publishes) counts its outermost PRODUCER spans instead.
    Returns the slice starts (seconds since the first span) and one rate series per service.
    """
    top = [s for s in outermost(spans) if isinstance(s.get("start_ns"), int)]
    if not top:
        return [], {}
    by_service: dict[str, list[Span]] = {}
    for s in top:
        by_service.setdefault(str(s.get("service", "")), []).append(s)
    t0 = min(s["start_ns"] for s in top)
    t1 = max(s.get("end_ns") or s["start_ns"] for s in top)
    duration_s = max((t1 - t0) / 1e9, 1e-3)
    buckets = max(1, min(buckets, math.ceil(duration_s / min_width_s)))
    width_s = duration_s / buckets
    starts = [i * width_s for i in range(buckets)]
    out: dict[str, list[float]] = {}
    for service, items in sorted(by_service.items()):
        kind = "consumer" if any(s.get("kind") == "consumer" for s in items) else "producer"
        counts = [0] * buckets
        for s in items:
            if s.get("kind") == kind:
                counts[min(buckets - 1, math.floor((s["start_ns"] - t0) / 1e9 / width_s))] += 1
        if any(counts):
            out[service] = [c / width_s for c in counts]
    return starts, out
