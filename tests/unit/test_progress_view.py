"""The demo's progress view: what it prints from a run's events when there is no live table."""

from __future__ import annotations

import io

import pytest
from rich.console import Console

from slipstream.run.plan import TrainingPlan
from slipstream.run.progress import ProgressView

pytestmark = pytest.mark.unit


def test_warm_start_checks_print_on_the_cliff_and_at_most_every_30_s(monkeypatch: pytest.MonkeyPatch) -> None:
    import slipstream.run.progress as progress

    clock = [100.0]
    monkeypatch.setattr(progress.time, "monotonic", lambda: clock[0])
    out = io.StringIO()
    view = ProgressView(Console(file=out, width=200), TrainingPlan(), live=False)

    def check(at: float, step: int, greedy: float, sampled: float = 0.01) -> None:
        clock[0] = at
        view.on_event("warmstart_check", {"step": step, "greedy": greedy, "sampled": sampled})

    check(110, 25, 0.0)  # 10 s in, flat: nothing
    check(131, 50, 0.02)  # 31 s since the view began: a line
    check(140, 75, 0.05)  # 9 s later, moved 0.03: nothing
    check(145, 100, 0.42)  # the cliff: moved 0.4 since the last line
    check(150, 125, 0.61, sampled=-1.0)  # no sampled target: no sampled figure
    lines = out.getvalue().splitlines()
    assert lines == [
        "warm-start step 50: greedy train accuracy 0.020, expected sampled success 0.010",
        "warm-start step 100: greedy train accuracy 0.420, expected sampled success 0.010",
        "warm-start step 125: greedy train accuracy 0.610",
    ]
