"""Readiness that reflects progress: a service with pending work and no progress for the budget says why."""

from __future__ import annotations

import pytest

from slipstream.runtime.progress import ProgressWatch

pytestmark = pytest.mark.unit


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def test_pending_work_without_progress_stalls_after_the_budget_and_recovers() -> None:
    clock = Clock()
    watch = ProgressWatch(30.0, clock=clock)
    assert watch.observe(0, "2 task(s) held") is None
    clock.t += 29
    assert watch.observe(0, "2 task(s) held") is None  # within the budget: still ready
    clock.t += 2
    reason = watch.observe(0, "2 task(s) held")
    assert reason == "2 task(s) held; nothing advanced for 31 s"
    assert watch.status() == {"stalled": True, "last_progress_s_ago": 31.0, "reason": reason}
    clock.t += 1
    assert watch.observe(1, "2 task(s) held") is None  # the mark moved: progress
    assert watch.status()["stalled"] is False


def test_idle_time_with_nothing_pending_does_not_count() -> None:
    clock = Clock()
    watch = ProgressWatch(30.0, clock=clock)
    assert watch.observe(0, None) is None
    clock.t += 600  # nothing to do for ten minutes: not a stall
    assert watch.observe(0, None) is None
    assert watch.observe(0, "1 task(s) held") is None  # work arrives: its clock starts now
    clock.t += 29
    assert watch.observe(0, "1 task(s) held") is None
    clock.t += 2
    assert watch.observe(0, "1 task(s) held") is not None
    assert watch.observe(0, None) is None  # the work went away (handed back): ready again


def test_a_zero_budget_never_stalls_and_a_negative_one_is_refused() -> None:
    clock = Clock()
    watch = ProgressWatch(0.0, clock=clock)
    watch.observe(0, "x")
    clock.t += 10_000
    assert watch.observe(0, "x") is None
    with pytest.raises(ValueError, match="stall_after_s"):
        ProgressWatch(-1.0)
