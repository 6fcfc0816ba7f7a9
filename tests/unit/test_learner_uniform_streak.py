"""The learner says when it takes no step because every group's rewards are equal."""

from __future__ import annotations

import pytest

from slipstream.learner.commit import UniformStreak

pytestmark = pytest.mark.unit


def test_a_streak_is_reported_at_the_first_threshold_and_at_each_doubling() -> None:
    streak = UniformStreak(first=4)
    reported = [streak.observe(0, 2) for _ in range(10)]  # 2, 4, ..., 20 trajectories at step 0
    assert reported == [None, 4, None, 8, None, None, None, 16, None, None]


def test_a_new_step_resets_the_streak() -> None:
    streak = UniformStreak(first=4)
    assert streak.observe(0, 3) is None
    assert streak.observe(1, 3) is None  # the step moved: 3, not 6
    assert streak.observe(1, 1) == 4
    assert streak.observe(1, 0) is None  # nothing dropped: nothing to say


def test_a_jump_past_several_thresholds_is_reported_once() -> None:
    streak = UniformStreak(first=4)
    assert streak.observe(0, 40) == 40
    assert streak.observe(0, 8) is None  # next due at 64
    assert streak.observe(0, 16) == 64


def test_first_must_be_positive() -> None:
    with pytest.raises(ValueError, match="first must be >= 1, got 0"):
        UniformStreak(first=0)
