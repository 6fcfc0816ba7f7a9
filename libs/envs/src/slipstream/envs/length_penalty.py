"""Composer 2's concave length penalty: C(x) = ((1 + k·x)^(1−q) − 1) / (k·(1−q)).

x is a weighted count of the effort an episode spent (sampled tokens, tool calls, turns). The
curve is concave for q > 0: the first units of effort cost the most and later ones less, so a
long task is not punished in proportion to its length while a short task done long-windedly
still loses reward. q = 0 gives the linear cost x; q → 1 the logarithm ln(1 + k·x) / k (its
limit, computed as such at q = 1 to avoid dividing by zero); k sets where the bend is.
The penalty is a named reward component, `−scale · C(x)`, so it shows next to what it taxes.
"""

from __future__ import annotations

import math
from typing import Annotated

import msgspec

Doc = msgspec.Meta


def concave_cost(x: float, *, k: float, q: float) -> float:
    """C(x) for x >= 0, k > 0, 0 <= q <= 1 (q = 1 is the logarithmic limit)."""
    if x < 0:
        raise ValueError(f"effort must be >= 0, got {x}")
    if not k > 0:
        raise ValueError(f"k must be > 0, got {k}")
    if not 0.0 <= q <= 1.0:
        raise ValueError(f"q must be in [0, 1], got {q}")
    if q == 1.0:
        return math.log1p(k * x) / k
    return ((1.0 + k * x) ** (1.0 - q) - 1.0) / (k * (1.0 - q))


class LengthPenalty(msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=True):
    """The penalty's shape and what it counts (an environment option, e.g. `code`'s `length_penalty`)."""

    k: Annotated[float, Doc(description="Where the curve bends: larger k, earlier flattening.")] = 0.01
    q: Annotated[float, Doc(description="Concavity: 0 linear, 1 logarithmic.")] = 0.5
    scale: Annotated[float, Doc(description="Reward subtracted per unit of C(x); 0 turns the penalty off.")] = 0.0
    per_token: Annotated[float, Doc(description="Effort per sampled token.")] = 1.0
    per_tool_call: Annotated[float, Doc(description="Effort per tool call.")] = 0.0
    per_turn: Annotated[float, Doc(description="Effort per policy turn.")] = 0.0

    def __post_init__(self) -> None:
        concave_cost(0.0, k=self.k, q=self.q)  # k and q checked once, with the same messages
        for name in ("scale", "per_token", "per_tool_call", "per_turn"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")

    def effort(self, *, tokens: int, tool_calls: int, turns: int) -> float:
        return self.per_token * tokens + self.per_tool_call * tool_calls + self.per_turn * turns

    def penalty(self, *, tokens: int, tool_calls: int, turns: int) -> float:
        """The reward component: −scale · C(effort), 0.0 when scale is 0."""
        if self.scale == 0.0:
            return 0.0
        x = self.effort(tokens=tokens, tool_calls=tool_calls, turns=turns)
        return -self.scale * concave_cost(x, k=self.k, q=self.q)
