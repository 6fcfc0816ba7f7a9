"""The restart policy of the local stack, on a hand-driven clock: backoff, the crash budget, final exits."""

from __future__ import annotations

import signal

import pytest

from slipstream.stack.supervisor import NO_RESTART, RestartPolicy, Supervisor, SupervisorEvent, describe_exit

pytestmark = pytest.mark.unit


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def make(policy: RestartPolicy) -> tuple[Supervisor, Clock, list[SupervisorEvent]]:
    clock = Clock()
    seen: list[SupervisorEvent] = []
    return Supervisor(policy, clock=clock, wall=lambda: 5.0, on_event=seen.append), clock, seen


def test_backoff_doubles_per_crash_in_the_window_and_is_capped() -> None:
    policy = RestartPolicy(backoff_s=1.0, max_backoff_s=5.0)
    assert [policy.delay(k) for k in range(5)] == [1.0, 2.0, 4.0, 5.0, 5.0]


def test_a_crash_is_restarted_after_its_backoff_and_counted() -> None:
    sup, clock, seen = make(RestartPolicy(backoff_s=1.0, max_restarts=3, window_s=60))
    sup.watch("learner")
    assert sup.counts() == {"learner": 0}
    ev = sup.exited("learner", -signal.SIGKILL)
    assert (ev.kind, ev.detail) == ("crashed", "restarting in 1.0 s")
    assert sup.due() == []
    assert sup.restart_in("learner") == 1.0
    clock.t += 0.99
    assert sup.due() == []
    clock.t += 0.02
    assert sup.due() == ["learner"]
    sup.restarted("learner", "pid 7")
    assert sup.due() == [] and sup.restarts("learner") == 1 and sup.state("learner") == "running"
    # The second crash inside the window waits twice as long.
    clock.t += 5
    assert sup.exited("learner", 1).detail == "restarting in 2.0 s"
    assert [e.kind for e in seen] == ["crashed", "restarted", "crashed"]
    assert seen[1].message() == "learner restarted (restart 1, pid 7)"
    assert "killed by SIGKILL" in seen[0].message()


def test_gives_up_after_max_restarts_within_the_window_with_a_clear_message() -> None:
    sup, clock, _ = make(RestartPolicy(backoff_s=0.5, max_restarts=2, window_s=60))
    for _ in range(2):
        assert sup.exited("reward-model", 1).kind == "crashed"
        clock.t += 10
        assert sup.due() == ["reward-model"]
        sup.restarted("reward-model")
    ev = sup.exited("reward-model", 1)
    assert ev.kind == "gave_up"
    assert sup.gave_up("reward-model") == (
        "reward-model crashed 3 times within 60 s (last: exit code 1) after 2 restart(s); not restarting it again"
    )
    clock.t += 1000
    assert sup.due() == [] and sup.state("reward-model") == "gave_up" and sup.restarts("reward-model") == 2


def test_crashes_that_left_the_window_no_longer_count() -> None:
    sup, clock, _ = make(RestartPolicy(backoff_s=1.0, max_restarts=1, window_s=30))
    sup.exited("task-source", 1)
    clock.t += 31  # the first crash is out of the window: budget and backoff start over
    sup.restarted("task-source")
    ev = sup.exited("task-source", 1)
    assert (ev.kind, ev.detail) == ("crashed", "restarting in 1.0 s")


def test_exit_zero_finishes_and_a_config_error_is_not_retried() -> None:
    sup, _, _ = make(RestartPolicy())
    assert sup.exited("learner", 0).kind == "finished"
    assert sup.state("learner") == "finished" and sup.due() == []
    ev = sup.exited("eval-gate", 2)
    assert ev.kind == "gave_up" and "configuration error" in ev.detail


def test_a_retired_service_stays_down_and_keeps_a_final_state() -> None:
    sup, clock, _ = make(RestartPolicy(backoff_s=1.0))
    sup.exited("rollout-worker", 1)
    sup.retire("rollout-worker")  # a stop came during the backoff
    clock.t += 100
    assert sup.due() == [] and sup.state("rollout-worker") == "retired"
    sup.exited("learner", 0)
    sup.retire("learner")
    assert sup.state("learner") == "finished"


def test_policy_validation_and_exit_descriptions() -> None:
    assert not NO_RESTART.enabled
    with pytest.raises(ValueError, match="max_restarts must be >= 0"):
        RestartPolicy(max_restarts=-1)
    assert describe_exit(-9) == "killed by SIGKILL"
    assert describe_exit(3) == "exit code 3"
    assert describe_exit(None) == "still running"
