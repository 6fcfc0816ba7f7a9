"""How well each rubric agrees with what users did: the evidence for retiring a rubric that drifted.

A judge's rubrics are proxies; the user signal (an accepted answer, an edit that persisted, a
thumbs up: whatever the feedback path turns into a number) is what they stand for. Over a window
of episodes that carry both, each rubric gets:

- `n`: episodes where it was sampled, scored, and a user signal exists;
- `correlation`: Pearson's r between its score and the signal (NaN when either is constant);
- `accuracy`: how often its pass/fail (score >= `pass_threshold`) matches the signal's
  (signal >= `signal_threshold`);
- `drifting`: enough data (`n >= min_n`) and a correlation below `min_correlation` (or NaN):
  a candidate to retire, or to rewrite under a new id.

Pure functions over plain values, so the realtime demo, a notebook or a dashboard job can call
them on what they have (`Judgement.scores` and the feedback per episode).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

AGGREGATE = "(judge)"
"""Row name of the judge's aggregate when `include_aggregate` rows are passed in."""


@dataclass(frozen=True)
class RubricAgreement:
    rubric_id: str
    n: int
    correlation: float
    accuracy: float
    mean_score: float
    drifting: bool


def pearson(xs: Sequence[float], ys: Sequence[float]) -> float:
    """Pearson's r of two equally long sequences; NaN with fewer than 2 points or no spread."""
    if len(xs) != len(ys):
        raise ValueError(f"{len(xs)} scores vs {len(ys)} signals")
    n = len(xs)
    if n < 2:
        return math.nan
    mx, my = sum(xs) / n, sum(ys) / n
    sxy = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True))
    sxx = sum((x - mx) ** 2 for x in xs)
    syy = sum((y - my) ** 2 for y in ys)
    if sxx <= 0 or syy <= 0:
        return math.nan
    return sxy / math.sqrt(sxx * syy)


def agreement(
    scores: Sequence[Mapping[str, float]],
    signals: Sequence[float | None],
    *,
    pass_threshold: float = 0.5,
    signal_threshold: float = 0.5,
    min_n: int = 20,
    min_correlation: float = 0.1,
) -> list[RubricAgreement]:
    """Each rubric's agreement with the user signal over episodes, sorted by correlation (worst first).

    `scores[i]` is episode i's rubric id -> score in [0, 1] (`Judgement.scores`; rubrics not
    sampled or not scored are simply absent), `signals[i]` its user signal (None: no feedback,
    the episode is skipped).
    """
    if len(scores) != len(signals):
        raise ValueError(f"{len(scores)} score rows vs {len(signals)} signals")
    pairs: dict[str, tuple[list[float], list[float]]] = {}
    for row, signal in zip(scores, signals, strict=True):
        if signal is None or not math.isfinite(signal):
            continue
        for rid, s in row.items():
            xs, ys = pairs.setdefault(rid, ([], []))
            xs.append(float(s))
            ys.append(float(signal))
    out: list[RubricAgreement] = []
    for rid, (xs, ys) in pairs.items():
        r = pearson(xs, ys)
        hits = sum((x >= pass_threshold) == (y >= signal_threshold) for x, y in zip(xs, ys, strict=True))
        drifting = len(xs) >= min_n and (math.isnan(r) or r < min_correlation)
        out.append(RubricAgreement(rid, len(xs), r, hits / len(xs), sum(xs) / len(xs), drifting))
    return sorted(out, key=lambda a: (-math.inf if math.isnan(a.correlation) else a.correlation, a.rubric_id))


def with_aggregate(scores: Mapping[str, float], aggregate: float) -> dict[str, float]:
    """A score row plus the judge's aggregate under `AGGREGATE`, so the report has a row for the whole judge."""
    return {**scores, AGGREGATE: aggregate}


def format_agreement(report: Sequence[RubricAgreement]) -> str:
    """A plain-text table of the report (what `slipstream demo --realtime` prints)."""
    lines = [f"{'rubric':<24} {'n':>5} {'corr':>6} {'acc':>5} {'mean':>5}  status"]
    for a in report:
        corr = "  n/a" if math.isnan(a.correlation) else f"{a.correlation:+.2f}"
        status = "DRIFTING: retire or rewrite" if a.drifting else "ok"
        lines.append(f"{a.rubric_id:<24} {a.n:>5} {corr:>6} {a.accuracy:>5.2f} {a.mean_score:>5.2f}  {status}")
    return "\n".join(lines)
