"""The promotion rule of eval-gate, as a pure function over per-task scores.

A candidate version is promoted iff it was evaluated on enough tasks, its mean score clears an
absolute floor, and it is not worse than the promoted version beyond a margin at the configured
confidence. "Not worse" is a paired test: both versions are scored on the same pinned tasks, so
the per-task differences candidate - baseline cancel the task difficulty, and the lower end of
their two-sided confidence interval must stay at or above -margin (a non-inferiority test). A
candidate that is merely indistinguishable from the promoted one is promoted, so training is
not blocked by noise; one that is likely worse by more than the margin is not.

Intervals are Student-t intervals (t quantiles from the regularised incomplete beta function;
a Cornish-Fisher expansion past 200 degrees of freedom), stdlib only. No I/O here: eval-gate
feeds the scores in and publishes what comes out.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

# What decided, one word per rule (metric labels: gate/decision/rejected{reason}).
KINDS = ("promote", "too_few_samples", "below_floor", "worse_than_promoted")
# Past this many degrees of freedom the Cornish-Fisher series is accurate to ~1e-9 and cheaper.
_CF_DF = 200


@dataclass(frozen=True)
class Decision:
    """The verdict on one candidate, with the numbers behind it (NaN where undefined, e.g. n < 2)."""

    promote: bool
    reason: str
    score: float  # mean candidate score
    ci_low: float
    ci_high: float
    diff_mean: float | None  # mean of candidate - baseline per task; None without a baseline
    diff_ci_low: float | None
    diff_ci_high: float | None
    n: int
    baseline_score: float | None = None  # mean baseline score on the same tasks
    kind: str = ""  # the rule that decided, a metric label: one of KINDS

    @property
    def decision(self) -> str:
        """'promote' or 'reject', as `EvalResult.decision` spells it."""
        return "promote" if self.promote else "reject"


def decide(
    candidate: Sequence[float],
    baseline: Sequence[float] | None,
    *,
    margin: float,
    confidence: float,
    floor: float,
    min_samples: int,
    baseline_version: int | None = None,
) -> Decision:
    """Promote or reject `candidate` (per-task scores), against `baseline` on the same tasks.

    `baseline` is None for the first version (nothing promoted yet); otherwise `baseline[i]` is the
    promoted version's score on the task of `candidate[i]`. `baseline_version` only names it in
    the reason.
    """
    _check(candidate, baseline, margin=margin, confidence=confidence, floor=floor, min_samples=min_samples)
    n = len(candidate)
    score, ci_low, ci_high = mean_ci(candidate, confidence)
    diff_mean = diff_low = diff_high = base_score = None
    if baseline is not None:
        base_score = statistics.fmean(baseline) if n else math.nan
        diff_mean, diff_low, diff_high = mean_ci([c - b for c, b in zip(candidate, baseline, strict=True)], confidence)

    def verdict(promote: bool, reason: str, kind: str = "promote") -> Decision:
        return Decision(promote, reason, score, ci_low, ci_high, diff_mean, diff_low, diff_high, n, base_score, kind)

    if n < min_samples:
        return verdict(False, f"too few samples: {n} < {min_samples}", "too_few_samples")
    if score < floor:
        s, f = _pair(score, floor)
        return verdict(False, f"below floor: {s} < {f}", "below_floor")
    summary = f"score {_num(score)} (CI {_num(ci_low)}..{_num(ci_high)}) >= floor {_num(floor)}"
    if baseline is None or diff_low is None or diff_mean is None or diff_high is None:
        return verdict(True, f"promote: {summary}; no promoted version to compare with")
    who = f"v{baseline_version}" if baseline_version is not None else "version"
    if diff_low < -margin:
        lo, m = _pair(diff_low, -margin)
        return verdict(False, f"worse than promoted {who} beyond margin: diff CI low {lo} < {m}", "worse_than_promoted")
    return verdict(
        True,
        f"promote: {summary}; diff vs promoted {who} {diff_mean:+.2f} "
        f"(CI {_num(diff_low)}..{_num(diff_high)}) within margin {_num(margin)}",
    )


def mean_ci(values: Sequence[float], confidence: float) -> tuple[float, float, float]:
    """(mean, low, high): the two-sided Student-t interval of the mean; NaN bounds for n < 2."""
    n = len(values)
    if n == 0:
        return math.nan, math.nan, math.nan
    mean = statistics.fmean(values)
    if n < 2:
        return mean, math.nan, math.nan
    half = t_quantile((1 + confidence) / 2, n - 1) * statistics.stdev(values) / math.sqrt(n)
    return mean, mean - half, mean + half


def t_quantile(p: float, df: float) -> float:
    """The p-quantile of Student's t distribution with `df` degrees of freedom."""
    if not 0.0 < p < 1.0:
        raise ValueError(f"quantile probability must be in (0, 1), got {p}")
    if df <= 0:
        raise ValueError(f"degrees of freedom must be > 0, got {df}")
    if p < 0.5:
        return -t_quantile(1 - p, df)
    if p == 0.5:
        return 0.0
    if df > _CF_DF:
        return _cornish_fisher(p, df)
    lo, hi = 0.0, 1.0
    while t_cdf(hi, df) < p:
        lo, hi = hi, hi * 2
    for _ in range(200):
        mid = (lo + hi) / 2
        if t_cdf(mid, df) < p:
            lo = mid
        else:
            hi = mid
        if hi - lo <= 1e-12 * max(1.0, hi):
            break
    return (lo + hi) / 2


def t_cdf(t: float, df: float) -> float:
    """P(T <= t) for Student's t with `df` degrees of freedom."""
    tail = 0.5 * _betainc(df / 2, 0.5, df / (df + t * t))
    return 1 - tail if t > 0 else tail


def _cornish_fisher(p: float, df: float) -> float:
    # Abramowitz & Stegun 26.7.5: t as a series in 1/df around the normal quantile z.
    z = statistics.NormalDist().inv_cdf(p)
    g1 = (z**3 + z) / 4
    g2 = (5 * z**5 + 16 * z**3 + 3 * z) / 96
    g3 = (3 * z**7 + 19 * z**5 + 17 * z**3 - 15 * z) / 384
    g4 = (79 * z**9 + 776 * z**7 + 1482 * z**5 - 1920 * z**3 - 945 * z) / 92160
    return z + g1 / df + g2 / df**2 + g3 / df**3 + g4 / df**4


def _betainc(a: float, b: float, x: float) -> float:
    """The regularised incomplete beta function I_x(a, b) (continued fraction, Lentz's method)."""
    if x <= 0.0:
        return 0.0
    if x >= 1.0:
        return 1.0
    log_front = math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x)
    # The fraction converges fast for x < (a+1)/(a+b+2); use the symmetry I_x(a,b) = 1 - I_{1-x}(b,a) otherwise.
    if x > (a + 1) / (a + b + 2):
        return 1.0 - _betainc(b, a, 1.0 - x)
    return math.exp(log_front) * _beta_fraction(a, b, x) / a


def _beta_fraction(a: float, b: float, x: float) -> float:
    tiny = 1e-300
    c, d = 1.0, 1.0 - (a + b) * x / (a + 1)
    d = 1.0 / (d if abs(d) > tiny else tiny)
    h = d
    for m in range(1, 1000):
        for num in (
            m * (b - m) * x / ((a + 2 * m - 1) * (a + 2 * m)),
            -(a + m) * (a + b + m) * x / ((a + 2 * m) * (a + 2 * m + 1)),
        ):
            d = 1.0 + num * d
            d = 1.0 / (d if abs(d) > tiny else tiny)
            c = 1.0 + num / c
            c = c if abs(c) > tiny else tiny
            h *= d * c
        if abs(d * c - 1.0) < 1e-15:
            break
    return h


def _check(
    candidate: Sequence[float],
    baseline: Sequence[float] | None,
    *,
    margin: float,
    confidence: float,
    floor: float,
    min_samples: int,
) -> None:
    if not 0.0 < confidence < 1.0:
        raise ValueError(f"confidence must be in (0, 1), got {confidence}")
    if not (math.isfinite(margin) and margin >= 0):
        raise ValueError(f"margin must be a finite number >= 0, got {margin}")
    if math.isnan(floor):
        raise ValueError("floor must be a number, got NaN")
    if min_samples < 2:
        raise ValueError(f"min_samples must be >= 2 (a confidence interval needs two scores), got {min_samples}")
    for name, values in (("candidate", candidate), ("baseline", baseline or ())):
        bad = [i for i, v in enumerate(values) if not math.isfinite(v)]
        if bad:
            raise ValueError(f"{name} scores must be finite; index {bad[0]} is {values[bad[0]]}")
    if baseline is not None and len(baseline) != len(candidate):
        raise ValueError(
            f"paired scores need the same tasks: {len(candidate)} candidate scores vs {len(baseline)} baseline scores"
        )


def _num(x: float) -> str:
    return f"{x:.2f}"


def _pair(a: float, b: float) -> tuple[str, str]:
    """`a` and `b` with 2 decimals, or more when 2 would print two different numbers alike."""
    for digits in range(2, 7):
        sa, sb = f"{a:.{digits}f}", f"{b:.{digits}f}"
        if sa != sb:
            break
    return sa, sb
