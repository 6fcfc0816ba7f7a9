"""Toggle: Kimi K2.5's token-budget control, alternating a budget phase with a free one.

For learner step t (steps already taken, the first is 0) and a phase length of m steps:

- budget phase, ⌊t/m⌋ even: r̃(x, y) = r(x, y) · 𝟙{ acc(x) < λ  or  |y| ≤ budget(x) },
  where acc(x) is the share of the group's answers that are correct; the budget only bites once
  the task is solved often enough, so accuracy is not traded for brevity too early;
- free phase, ⌊t/m⌋ odd: r̃ = r.

budget(x) is the ρ-th percentile (linear interpolation between order statistics, numpy's default)
of the lengths |y| of the task's **correct** answers, measured the first time a group of that task
holds a correct answer and then frozen. Lengths are the tokens the policy sampled. A zeroed answer
has every score component set to 0 too, so a reward schedule re-weighting the components cannot
bring the reward back (0 · λ = 0).

Pure: `ToggleConfig` is the `[learner] toggle` table, `toggle_rewards` the rule on plain values,
`Budgets` the frozen budgets (a dict; the caller decides where it lives), `tokens_per_correct`
the figure the rule is judged by. Importable without torch.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Annotated

import msgspec

Doc = msgspec.Meta


class ToggleConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True, frozen=True):
    """`[learner.toggle]`: Toggle's budget phase (Kimi K2.5 §4.4.2; λ, m and ρ are not disclosed there)."""

    enabled: Annotated[bool, Doc(description="Apply the budget phase; false trains on the rewards as scored.")] = False
    period: Annotated[int, Doc(description="m: learner steps per phase (budget, free, budget, ...).")] = 10
    rho: Annotated[float, Doc(description="ρ: percentile (0-100) of a task's correct-answer lengths kept.")] = 50.0
    accuracy: Annotated[
        float, Doc(description="λ: the budget applies to a group only when this share (0-1) of it is correct.")
    ] = 0.5

    def __post_init__(self) -> None:
        if self.period < 1:
            raise ValueError(f"toggle period must be >= 1 step, got {self.period}")
        if not (math.isfinite(self.rho) and 0.0 <= self.rho <= 100.0):
            raise ValueError(f"toggle rho must be a percentile in [0, 100], got {self.rho}")
        if not (math.isfinite(self.accuracy) and 0.0 <= self.accuracy <= 1.0):
            raise ValueError(f"toggle accuracy (λ) must be in [0, 1], got {self.accuracy}")

    def budget_phase(self, step: int) -> bool:
        """Whether learner step `step` is in a budget phase (⌊step/m⌋ even)."""
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        return (step // self.period) % 2 == 0


def percentile(values: Sequence[float], rho: float) -> float:
    """The ρ-th percentile of `values`, linear between order statistics (numpy's default method)."""
    if not values:
        raise ValueError("percentile of no values")
    if not 0.0 <= rho <= 100.0:
        raise ValueError(f"rho must be in [0, 100], got {rho}")
    ordered = sorted(values)
    pos = (len(ordered) - 1) * rho / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def toggle_rewards(
    rewards: Sequence[float],
    correct: Sequence[bool],
    lengths: Sequence[int],
    *,
    budget: float | None,
    accuracy: float,
    budget_phase: bool,
) -> list[float]:
    """The rewards one group trains with: r·𝟙{acc < λ or |y| ≤ budget} in a budget phase, r otherwise.

    `accuracy` is λ; `budget` None (no correct answer measured yet for this task) leaves r as is.
    """
    if not len(rewards) == len(correct) == len(lengths):
        raise ValueError(f"{len(rewards)} rewards, {len(correct)} correct flags and {len(lengths)} lengths differ")
    if not budget_phase or budget is None or not rewards:
        return list(rewards)
    if sum(correct) / len(correct) < accuracy:
        return list(rewards)
    return [r if n <= budget else 0.0 for r, n in zip(rewards, lengths, strict=True)]


class Budgets:
    """Frozen budgets by task key: set once, from the first group holding a correct answer."""

    def __init__(self, rho: float, frozen: Mapping[str, float] | None = None) -> None:
        self.rho = rho
        self.frozen: dict[str, float] = dict(frozen or {})

    def __len__(self) -> int:
        return len(self.frozen)

    def measure(self, key: str, correct: Sequence[bool], lengths: Sequence[int]) -> float | None:
        """The task's budget: frozen already, else the ρ-percentile of this group's correct lengths
        (then frozen), else None (no correct answer yet)."""
        if key in self.frozen:
            return self.frozen[key]
        good = [float(n) for n, ok in zip(lengths, correct, strict=True) if ok]
        if not good:
            return None
        self.frozen[key] = percentile(good, self.rho)
        return self.frozen[key]


def tokens_per_correct(lengths: Sequence[int], correct: Sequence[bool]) -> float:
    """Mean length of the correct answers (0.0 when none is correct): what Toggle sets out to lower."""
    good = [n for n, ok in zip(lengths, correct, strict=True) if ok]
    return sum(good) / len(good) if good else 0.0
