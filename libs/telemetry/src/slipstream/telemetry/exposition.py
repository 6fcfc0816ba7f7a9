"""Reading the Prometheus text format back: what a scrape of /metrics says, as numbers.

`slipstream top` and the scrape tests read the services' /metrics; this parses the subset of
the text exposition format (0.0.4) that `Registry.render_prometheus` writes and Prometheus
client libraries commonly emit: `# HELP` / `# TYPE` lines, samples with optional labels and an
optional timestamp. A line that is none of these is an error naming the line.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterator
from dataclasses import dataclass, field

_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{.*\})?\s+(\S+)(\s+-?\d+)?\s*$")
_LABEL = re.compile(r'\s*([a-zA-Z_][a-zA-Z0-9_]*)\s*=\s*"((?:[^"\\]|\\.)*)"\s*(,|$)')
_ESCAPES = {"\\\\": "\\", '\\"': '"', "\\n": "\n"}
_SUFFIXES = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "summary": ("_sum", "_count")}


@dataclass(frozen=True)
class Sample:
    name: str
    labels: dict[str, str]
    value: float

    def matches(self, labels: dict[str, str]) -> bool:
        return all(self.labels.get(k) == v for k, v in labels.items())


@dataclass
class Exposition:
    """One scrape: the declared families (name -> type) and every sample in order."""

    types: dict[str, str] = field(default_factory=dict)
    samples: list[Sample] = field(default_factory=list)

    def families(self) -> set[str]:
        """Every family declared by a `# TYPE` line or seen in a sample (base names, no suffix)."""
        return set(self.types) | {self.family_of(s.name) for s in self.samples}

    def family_of(self, sample_name: str) -> str:
        for family, kind in self.types.items():
            if sample_name == family or any(sample_name == family + sfx for sfx in _SUFFIXES.get(kind, ())):
                return family
        return sample_name

    def select(self, name: str, **labels: str) -> Iterator[Sample]:
        """Samples called `name` whose labels include `labels`."""
        return (s for s in self.samples if s.name == name and s.matches(labels))

    def value(self, name: str, **labels: str) -> float | None:
        """The first matching sample's value, None when there is none."""
        return next((s.value for s in self.select(name, **labels)), None)

    def total(self, name: str, **labels: str) -> float:
        """The sum over every matching sample (0.0 when there is none)."""
        return sum(s.value for s in self.select(name, **labels))

    def histogram(self, family: str, **labels: str) -> tuple[list[tuple[float, float]], float, float]:
        """(cumulative buckets as (le, count), sum, count), summed over matching label sets."""
        buckets: dict[float, float] = {}
        for s in self.select(family + "_bucket", **labels):
            le = math.inf if s.labels.get("le") == "+Inf" else float(s.labels.get("le", "nan"))
            buckets[le] = buckets.get(le, 0.0) + s.value
        return sorted(buckets.items()), self.total(family + "_sum", **labels), self.total(family + "_count", **labels)

    def histogram_mean(self, family: str, **labels: str) -> float | None:
        _, total, count = self.histogram(family, **labels)
        return total / count if count else None


def _labels(raw: str, line: str) -> dict[str, str]:
    body = raw[1:-1].strip()
    out: dict[str, str] = {}
    pos = 0
    while pos < len(body):
        m = _LABEL.match(body, pos)
        if m is None:
            raise ValueError(f"bad label set {raw!r} in metrics line {line!r}")
        out[m.group(1)] = re.sub(r"\\[\\\"n]", lambda e: _ESCAPES[e.group(0)], m.group(2))
        pos = m.end()
    return out


def parse_prometheus(text: str) -> Exposition:
    """Parse a /metrics body; ValueError naming the first line that is not in the format."""
    exp = Exposition()
    for raw in text.splitlines():
        line = raw.strip()
        if not line:
            continue
        if line.startswith("#"):
            parts = line.split(None, 3)
            if len(parts) >= 4 and parts[1] == "TYPE":
                exp.types[parts[2]] = parts[3].strip()
            continue
        m = _SAMPLE.match(line)
        if m is None:
            raise ValueError(f"not a Prometheus sample line: {line!r}")
        name, labels, value = m.group(1), m.group(2), m.group(3)
        try:
            number = float(value)  # also "NaN", "+Inf", "-Inf"
        except ValueError:
            raise ValueError(f"bad sample value {value!r} in metrics line {line!r}") from None
        exp.samples.append(Sample(name, _labels(labels, line) if labels else {}, number))
    return exp
