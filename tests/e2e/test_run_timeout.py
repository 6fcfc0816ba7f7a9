"""A run past its timeout_s ends as a failed run naming the budget, not a traceback.

`bench summary` on a loaded machine died mid-bench on an uncaught TimeoutError from the run's
follow loop (its other seeds and arms never ran); now the run's summary says what happened and
the caller goes on. The stack is stopped, as after any failed run.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from slipstream.run.presets import demo_plan
from slipstream.run.training import TrainingPlan, run_training
from slipstream.stack import pid_alive

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


def _shrunk_plan() -> TrainingPlan:
    """The default demo's plan, with a 5-step warm-start and an 8-task held-out eval."""
    plan = demo_plan()
    plan.sft_steps = 5
    plan.sft_target_accuracy = 0.0
    plan.heldout_tasks = 8
    plan.train_eval_tasks = 0
    return plan


@pytest.mark.timeout(300)
def test_a_run_past_its_timeout_fails_with_a_clear_error_and_stops_its_stack(tmp_path: Path) -> None:
    plan = _shrunk_plan()
    plan.max_steps = 100_000  # never finishes inside the budget
    plan.timeout_s = 5.0
    stack_pids: list[int] = []
    summary = run_training(
        plan, tmp_path / "run", on_stack=lambda stack: stack_pids.extend(s.pid for s in stack.services.values())
    )
    assert not summary.ok
    assert "did not finish within the run's timeout_s = 5 s" in summary.error, summary.error
    assert "of 100000" in summary.error
    assert stack_pids and not any(pid_alive(p) for p in stack_pids)


@pytest.mark.timeout(300)
def test_a_run_whose_learner_never_steps_ends_at_its_stall_timeout_with_after_figures(tmp_path: Path) -> None:
    """Groups of one are uniform by definition, so the learner drops every trajectory and never
    steps (as every group of a too-sure warm-start did in session 29's recall runs, which then idled
    to their timeout with no final evaluation): the run ends after stall_timeout_s, says so, stops
    its stack, and still scores its last version (v0) on held-out."""
    plan = _shrunk_plan()
    plan.group_size = 1
    plan.max_steps = 100
    plan.timeout_s = 240.0
    plan.stall_timeout_s = 8.0
    stack_pids: list[int] = []
    summary = run_training(
        plan, tmp_path / "run", on_stack=lambda stack: stack_pids.extend(s.pid for s in stack.services.values())
    )
    assert not summary.ok
    assert summary.error.startswith("stalled: no learner step for"), summary.error
    assert "after step 0 of 100" in summary.error and summary.stalled_at_step == 0
    assert summary.steps == 0 and summary.wall_time_s < 200
    # Two evaluations: v0 before RL, and the last version there is (v0 again) as the run's after.
    assert [row["version"] for row in summary.eval_curve] == [0, 0]
    assert summary.heldout_accuracy_after == summary.eval_curve[-1]["accuracy"]
    assert stack_pids and not any(pid_alive(p) for p in stack_pids)
