"""How the scores of an episode's rubrics combine into the judge's one number (pure functions).

- `mean`: the rubrics' scores weighted by their rubric weights (Rubrics-as-Rewards' explicit
  aggregation);
- `median`: the unweighted median, robust to one rubric that drifts far from the others;
- `majority`: each rubric votes pass (score >= threshold) or fail with its weight; 1.0 when the
  passing weight is more than half, 0.0 when less, 0.5 on an exact tie (OpenClaw-RL and NeMo Gym
  majority-vote their judges the same way).
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping


def aggregate(
    scores: Mapping[str, float], weights: Mapping[str, float], how: str, *, pass_threshold: float = 0.5
) -> float:
    """The aggregate of `scores` (rubric id -> [0, 1]); `weights` gives each rubric's weight (default 1)."""
    if not scores:
        raise ValueError("no rubric scores to aggregate")
    w = {rid: float(weights.get(rid, 1.0)) for rid in scores}
    if any(v <= 0 for v in w.values()):
        raise ValueError(f"rubric weights must be > 0, got {w}")
    if how == "mean":
        return sum(scores[rid] * w[rid] for rid in scores) / sum(w.values())
    if how == "median":
        return float(statistics.median(scores.values()))
    if how == "majority":
        passed = sum(w[rid] for rid, s in scores.items() if s >= pass_threshold)
        total = sum(w.values())
        if abs(2 * passed - total) <= 1e-12 * total:
            return 0.5
        return 1.0 if 2 * passed > total else 0.0
    raise ValueError(f"unknown aggregation {how!r}; expected 'mean', 'median' or 'majority'")
