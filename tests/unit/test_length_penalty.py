"""Composer 2's length penalty (libs/envs length_penalty.py): hand-computed values at q = 0, q -> 1, q = 0.5."""

from __future__ import annotations

import math

import pytest

from slipstream.envs.length_penalty import LengthPenalty, concave_cost

pytestmark = pytest.mark.unit


def test_q_zero_is_linear() -> None:
    for x in (0.0, 1.0, 37.0, 1000.0):
        assert concave_cost(x, k=0.1, q=0.0) == pytest.approx(x)


def test_q_one_is_the_logarithm_and_the_limit_of_q_to_one() -> None:
    # ln(1 + 0.1 * 100) / 0.1 = ln(11) * 10 = 23.9789527...
    assert concave_cost(100.0, k=0.1, q=1.0) == pytest.approx(10 * math.log(11))
    assert concave_cost(100.0, k=0.1, q=1.0) == pytest.approx(23.978952728)
    assert concave_cost(100.0, k=0.1, q=1 - 1e-9) == pytest.approx(23.978952728, rel=1e-6)


def test_q_half_between() -> None:
    # ((1 + 0.1 * 80) ** 0.5 - 1) / (0.1 * 0.5) = (3 - 1) / 0.05 = 40
    assert concave_cost(80.0, k=0.1, q=0.5) == pytest.approx(40.0)
    linear, half, log = (concave_cost(80.0, k=0.1, q=q) for q in (0.0, 0.5, 1.0))
    assert log < half < linear  # more concave, cheaper long episodes


def test_the_cost_is_concave_for_q_above_zero() -> None:
    first = concave_cost(10.0, k=0.1, q=0.5) - concave_cost(0.0, k=0.1, q=0.5)
    later = concave_cost(110.0, k=0.1, q=0.5) - concave_cost(100.0, k=0.1, q=0.5)
    assert first > later > 0


def test_penalty_weights_effort_and_is_a_negative_component() -> None:
    pen = LengthPenalty(k=0.1, q=0.5, scale=0.01, per_token=0.5, per_tool_call=10.0, per_turn=5.0)
    # effort = 0.5 * 100 + 10 * 2 + 5 * 2 = 80 -> C = 40 -> -0.4
    assert pen.effort(tokens=100, tool_calls=2, turns=2) == 80.0
    assert pen.penalty(tokens=100, tool_calls=2, turns=2) == pytest.approx(-0.4)
    assert LengthPenalty().penalty(tokens=10_000, tool_calls=9, turns=9) == 0.0  # scale 0: off


def test_bad_shapes_name_the_field() -> None:
    with pytest.raises(ValueError, match="q must be in"):
        LengthPenalty(q=1.5)
    with pytest.raises(ValueError, match="k must be > 0"):
        concave_cost(1.0, k=0.0, q=0.5)
    with pytest.raises(ValueError, match="per_turn must be >= 0"):
        LengthPenalty(per_turn=-1)
    with pytest.raises(ValueError, match="effort must be >= 0"):
        concave_cost(-1.0, k=0.1, q=0.5)
