"""Process-wide metrics: counters, gauges and histograms named `<service>/<subsystem>/<metric>`.

One registry per process renders the Prometheus text format for `/metrics`. Names are paths
(torchforge's convention); the Prometheus name replaces '/' and '-' with '_'. Instruments are
cheap enough for per-message use on the hot path (a dict lookup and an add).
"""

from __future__ import annotations

import bisect
import math
import re
import threading
from collections.abc import Iterable, Sequence

_NAME = re.compile(r"^[a-z][a-z0-9_-]*/[a-z0-9_-]+/[a-z0-9_.-]+$")
LabelKey = tuple[tuple[str, str], ...]


def prom_name(name: str) -> str:
    return re.sub(r"[^a-zA-Z0-9_]", "_", name)


def _labels(labels: dict[str, str]) -> LabelKey:
    return tuple(sorted((k, str(v)) for k, v in labels.items()))


def _fmt_labels(key: LabelKey, extra: Iterable[tuple[str, str]] = ()) -> str:
    items = list(key) + list(extra)
    if not items:
        return ""
    body = ",".join(f'{k}="{v.replace(chr(92), chr(92) * 2).replace(chr(34), chr(92) + chr(34))}"' for k, v in items)
    return "{" + body + "}"


class _Instrument:
    kind = ""

    def __init__(self, name: str, description: str) -> None:
        if not _NAME.match(name):
            raise ValueError(f"metric name {name!r} must look like '<service>/<subsystem>/<metric>'")
        self.name = name
        self.description = description
        self._lock = threading.Lock()

    def render(self) -> list[str]:
        raise NotImplementedError

    def snapshot(self) -> dict[LabelKey, float] | dict[LabelKey, list[float]]:
        """A copy of every labelled value, taken under the lock (safe while other threads record)."""
        raise NotImplementedError


class Counter(_Instrument):
    kind = "counter"

    def __init__(self, name: str, description: str) -> None:
        super().__init__(name, description)
        self.values: dict[LabelKey, float] = {}

    def add(self, amount: float = 1.0, **labels: str) -> None:
        if amount < 0:
            raise ValueError(f"counter {self.name} cannot decrease")
        key = _labels(labels)
        with self._lock:
            self.values[key] = self.values.get(key, 0.0) + amount

    def value(self, **labels: str) -> float:
        return self.values.get(_labels(labels), 0.0)

    def total(self) -> float:
        return sum(self.snapshot().values())

    def snapshot(self) -> dict[LabelKey, float]:
        with self._lock:
            return dict(self.values)

    def render(self) -> list[str]:
        n = prom_name(self.name) + "_total"
        return [f"{n}{_fmt_labels(k)} {v:g}" for k, v in sorted(self.snapshot().items())]


class Gauge(_Instrument):
    kind = "gauge"

    def __init__(self, name: str, description: str) -> None:
        super().__init__(name, description)
        self.values: dict[LabelKey, float] = {}

    def set(self, value: float, **labels: str) -> None:
        with self._lock:
            self.values[_labels(labels)] = float(value)

    def value(self, **labels: str) -> float:
        return self.values.get(_labels(labels), math.nan)

    def snapshot(self) -> dict[LabelKey, float]:
        with self._lock:
            return dict(self.values)

    def render(self) -> list[str]:
        n = prom_name(self.name)
        return [f"{n}{_fmt_labels(k)} {v:g}" for k, v in sorted(self.snapshot().items())]


DEFAULT_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class Histogram(_Instrument):
    kind = "histogram"

    def __init__(self, name: str, description: str, buckets: Sequence[float] = DEFAULT_BUCKETS) -> None:
        super().__init__(name, description)
        self.buckets = tuple(sorted(buckets))
        self.series: dict[LabelKey, list[float]] = {}  # bucket counts..., +Inf count, sum

    def observe(self, value: float, **labels: str) -> None:
        key = _labels(labels)
        with self._lock:
            s = self.series.get(key)
            if s is None:
                s = self.series[key] = [0.0] * (len(self.buckets) + 2)
            s[bisect.bisect_left(self.buckets, value)] += 1
            s[-1] += value

    def count(self, **labels: str) -> int:
        s = self.series.get(_labels(labels))
        return int(sum(s[:-1])) if s else 0

    def snapshot(self) -> dict[LabelKey, list[float]]:
        """Per label set: one count per bucket (not cumulative), the +Inf overflow count, then the sum."""
        with self._lock:
            return {k: list(v) for k, v in self.series.items()}

    def render(self) -> list[str]:
        n = prom_name(self.name)
        out: list[str] = []
        for key, s in sorted(self.snapshot().items()):
            cum = 0.0
            for b, c in zip(self.buckets, s, strict=False):
                cum += c
                out.append(f"{n}_bucket{_fmt_labels(key, [('le', f'{b:g}')])} {cum:g}")
            cum += s[len(self.buckets)]
            out.append(f"{n}_bucket{_fmt_labels(key, [('le', '+Inf')])} {cum:g}")
            out.append(f"{n}_sum{_fmt_labels(key)} {s[-1]:g}")
            out.append(f"{n}_count{_fmt_labels(key)} {cum:g}")
        return out


class Registry:
    def __init__(self) -> None:
        self._instruments: dict[str, _Instrument] = {}
        self._lock = threading.Lock()

    def _get(self, cls: type[_Instrument], name: str, description: str, **kw: object) -> _Instrument:
        with self._lock:
            inst = self._instruments.get(name)
            if inst is None:
                inst = self._instruments[name] = cls(name, description, **kw)  # type: ignore[arg-type]
            elif not isinstance(inst, cls):
                raise TypeError(f"metric {name} already registered as a {inst.kind}")
            return inst

    def counter(self, name: str, description: str = "") -> Counter:
        return self._get(Counter, name, description)  # type: ignore[return-value]

    def gauge(self, name: str, description: str = "") -> Gauge:
        return self._get(Gauge, name, description)  # type: ignore[return-value]

    def histogram(self, name: str, description: str = "", buckets: Sequence[float] = DEFAULT_BUCKETS) -> Histogram:
        return self._get(Histogram, name, description, buckets=buckets)  # type: ignore[return-value]

    def names(self) -> list[str]:
        return sorted(self._instruments)

    def instruments(self) -> list[Counter | Gauge | Histogram]:
        """Every registered instrument, sorted by name (what exporters walk)."""
        with self._lock:
            return [self._instruments[n] for n in sorted(self._instruments)]  # type: ignore[misc]

    def render_prometheus(self) -> str:
        lines: list[str] = []
        for inst in self.instruments():
            pn = prom_name(inst.name)
            lines.append(f"# HELP {pn} {inst.description or inst.name}")
            lines.append(f"# TYPE {pn} {inst.kind}")
            lines.extend(inst.render())
        return "\n".join(lines) + "\n"


REGISTRY = Registry()
counter = REGISTRY.counter
gauge = REGISTRY.gauge
histogram = REGISTRY.histogram
