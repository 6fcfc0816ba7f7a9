"""The task source's pure parts: the pacing rule, the learner-progress view and the task generator."""

from __future__ import annotations

from typing import Any

import pytest

from slipstream.schemas import LearnerStep, WeightAnnounce
from slipstream.task_source.generator import CHUNK, TaskGenerator
from slipstream.task_source.pacing import (
    min_policy_version,
    outstanding_groups,
    tasks_to_publish,
    unacked,
    window,
)
from slipstream.task_source.progress import LearnerProgress

pytestmark = pytest.mark.unit


def info(pending: int = 0, ack_pending: int = 0, *, durable: str = "c", messages: int | None = None) -> dict[str, Any]:
    """A stream_info dict shaped like the bus's, with one durable consumer."""
    return {
        "messages": pending + ack_pending if messages is None else messages,
        "consumers": {durable: {"num_pending": pending, "num_ack_pending": ack_pending, "num_redelivered": 0}},
    }


def infos(tasks: tuple[int, int] = (0, 0), raw: tuple[int, int] = (0, 0), scored: tuple[int, int] = (0, 0)):
    return {"TASKS": info(*tasks), "TRAJ_RAW": info(*raw), "TRAJ_SCORED": info(*scored)}


# -- window, outstanding, how many to publish -----------------------------------------------------


@pytest.mark.parametrize(("gps", "staleness", "expected"), [(4, 0, 4), (4, 2, 12), (1, 0, 1), (3, 5, 18)])
def test_window_is_one_step_of_groups_per_version_of_staleness(gps: int, staleness: int, expected: int) -> None:
    assert window(gps, staleness) == expected


@pytest.mark.parametrize(("gps", "staleness"), [(0, 1), (2, -1)])
def test_window_rejects_impossible_settings(gps: int, staleness: int) -> None:
    with pytest.raises(ValueError, match="groups_per_step"):
        window(gps, staleness)


def test_unacked_sums_pending_and_ack_pending_over_consumers() -> None:
    two = {"messages": 99, "consumers": {"a": {"num_pending": 3, "num_ack_pending": 2}, "b": {"num_pending": 1}}}
    assert unacked(two) == 6
    # No consumer bound: in a work queue the stored messages are exactly the unacked ones.
    assert unacked({"messages": 7, "consumers": {}}) == 7


def test_outstanding_counts_tasks_as_groups_and_trajectories_in_group_units() -> None:
    # 2 tasks waiting + 1 being rolled out = 3 groups; 4 raw + 6 scored trajectories at group_size 4 = 2.5 groups.
    assert outstanding_groups(infos(tasks=(2, 1), raw=(3, 1), scored=(2, 4)), 4) == pytest.approx(5.5)
    assert outstanding_groups(infos(), 8) == 0.0


def test_held_trajectories_leave_the_count_but_never_below_zero() -> None:
    got = infos(tasks=(1, 0), scored=(0, 8))
    assert outstanding_groups(got, 4, held_trajectories=4) == pytest.approx(2.0)
    assert outstanding_groups(got, 4, held_trajectories=8) == pytest.approx(1.0)
    assert outstanding_groups(got, 4, held_trajectories=50) == pytest.approx(1.0)


def test_outstanding_names_a_missing_stream_and_a_bad_group_size() -> None:
    with pytest.raises(ValueError, match="TRAJ_SCORED"):
        outstanding_groups({"TASKS": info(), "TRAJ_RAW": info()}, 4)
    with pytest.raises(ValueError, match="group_size"):
        outstanding_groups(infos(), 0)


@pytest.mark.parametrize(
    ("outstanding", "win", "expected"),
    [
        (0.0, 4, 4),  # empty pipeline: fill the window
        (3.0, 4, 1),
        (4.0, 4, 0),  # full
        (6.0, 4, 0),  # over (a redelivered task formed an extra group): never negative
        (2.5, 4, 2),  # publish while below: 2.5 -> 3.5 -> 4.5
        (3.75, 4, 1),
        (4.0 - 1e-12, 4, 0),  # float noise from dividing by group_size is not a missing group
    ],
)
def test_tasks_to_publish_fills_up_to_the_window(outstanding: float, win: int, expected: int) -> None:
    assert tasks_to_publish(outstanding, win) == expected


def test_a_full_cycle_converges_to_the_window() -> None:
    # Publish, roll out, score: the count in group units stays at the window once filled.
    win, g = 6, 4
    assert tasks_to_publish(outstanding_groups(infos(), g), win) == 6
    # 6 tasks published; 2 of them rolled out into 8 raw trajectories, 1 group scored.
    state = infos(tasks=(3, 1), raw=(4, 0), scored=(4, 0))
    assert outstanding_groups(state, g) == 6.0
    assert tasks_to_publish(outstanding_groups(state, g), win) == 0
    # The learner trained one group and acked it: one task's room.
    state = infos(tasks=(3, 1), raw=(4, 0), scored=(0, 0))
    assert tasks_to_publish(outstanding_groups(state, g), win) == 1


@pytest.mark.parametrize(("latest", "staleness", "expected"), [(-1, 0, 0), (0, 2, 0), (5, 0, 5), (5, 2, 3), (1, 4, 0)])
def test_min_policy_version_is_latest_minus_staleness_at_least_zero(latest: int, staleness: int, expected: int) -> None:
    assert min_policy_version(latest, staleness) == expected


# -- learner progress -------------------------------------------------------------------------------


def step(n: int, *, version: int | None = None, trajectories: int = 8, run_id: str = "r") -> LearnerStep:
    return LearnerStep(
        step=n, policy_version=n if version is None else version, run_id=run_id, n_trajectories=trajectories
    )


def test_progress_tracks_the_newest_version_from_steps_and_announces_of_its_run_only() -> None:
    p = LearnerProgress("r")
    assert (p.latest_version, p.latest_step) == (-1, 0)
    assert p.on_announce(WeightAnnounce(policy_version=0, manifest_key="k", run_id="r"))
    assert p.latest_version == 0
    assert p.on_step(step(1))
    assert (p.latest_version, p.latest_step) == (1, 1)
    assert p.on_announce(WeightAnnounce(policy_version=2, manifest_key="k", run_id="r"))
    assert p.latest_version == 2
    # Older news never moves it back; other runs are ignored.
    assert p.on_step(step(1))
    assert not p.on_step(step(40, run_id="other"))
    assert not p.on_announce(WeightAnnounce(policy_version=40, manifest_key="k", run_id="other"))
    assert (p.latest_version, p.latest_step) == (2, 1)


def test_progress_finishes_at_max_steps_and_never_when_it_is_zero() -> None:
    p = LearnerProgress("r")
    p.on_step(step(2))
    assert not p.finished(3)
    p.on_step(step(3))
    assert p.finished(3) and p.finished(2)
    assert not p.finished(0)


def test_held_trajectories_are_the_steps_after_the_last_checkpoint() -> None:
    p = LearnerProgress("r", checkpoint_every=3)
    p.on_step(step(1, trajectories=8))
    p.on_step(step(2, trajectories=6))
    assert (p.last_checkpoint_step(), p.held_trajectories()) == (0, 14)
    p.on_step(step(3, trajectories=8))  # checkpoint at 3 covers steps 1..3
    assert (p.last_checkpoint_step(), p.held_trajectories()) == (3, 0)
    p.on_step(step(4, trajectories=5))
    assert p.held_trajectories() == 5
    every = LearnerProgress("r")  # checkpoint every step: nothing is ever held
    every.on_step(step(1))
    assert every.held_trajectories() == 0
    with pytest.raises(ValueError, match="checkpoint_every"):
        LearnerProgress("r", checkpoint_every=0)


# -- task generator ---------------------------------------------------------------------------------


def test_generator_is_deterministic_round_robin_with_unique_ids() -> None:
    a = TaskGenerator(["arith", "reverse"], seed=3, group_size=4, run_id="run1")
    b = TaskGenerator(["arith", "reverse"], seed=3, group_size=4, run_id="run1")
    n = 2 * CHUNK + 10  # crosses chunk boundaries for both envs
    ta = [a.next(min_policy_version=0, now=1.0) for _ in range(n)]
    tb = [b.next(min_policy_version=0, now=2.0) for _ in range(n)]
    assert [t.task_id for t in ta] == [t.task_id for t in tb]
    assert [(t.prompt, t.reference) for t in ta] == [(t.prompt, t.reference) for t in tb]
    assert len({t.task_id for t in ta}) == n
    assert [t.env for t in ta[:4]] == ["arith", "reverse", "arith", "reverse"]
    first = ta[0]
    assert first.task_id == "run1:arith-train-3000000-0"
    assert (first.run_id, first.group_size, first.split, first.created_at) == ("run1", 4, "train", 1.0)
    assert first.reference and first.prompt.endswith("=")
    # Another seed, another stream of tasks.
    other = TaskGenerator(["arith"], seed=4, run_id="run1")
    assert [other.next(min_policy_version=0, now=0).task_id for _ in range(3)] != [t.task_id for t in ta[0:6:2]]


def test_generator_carries_min_policy_version_and_options() -> None:
    g = TaskGenerator(["arith"], env_options={"arith": {"max_operand": 3}}, seed=0, run_id="r")
    tasks = [g.next(min_policy_version=7, now=0.0) for _ in range(50)]
    assert {t.min_policy_version for t in tasks} == {7}
    assert max(int(t.reference) for t in tasks) <= 6


def test_generator_rejects_unknown_envs_and_options_at_construction() -> None:
    with pytest.raises(ValueError, match="unknown environment 'nope'"):
        TaskGenerator(["nope"])
    with pytest.raises(ValueError, match="unknown option"):
        TaskGenerator(["arith"], env_options={"arith": {"colour": "red"}})
    with pytest.raises(ValueError, match="at least one"):
        TaskGenerator([])


def test_the_source_reports_a_stall_only_after_the_learner_started_and_then_stood_still() -> None:
    from slipstream.runtime.progress import ProgressWatch
    from slipstream.task_source.config import TaskSourceConfig
    from slipstream.task_source.service import TaskSourceService

    now = [0.0]
    svc = TaskSourceService(TaskSourceConfig())
    svc.watch = ProgressWatch(60.0, clock=lambda: now[0])
    svc.outstanding = 12.0
    now[0] = 500.0
    assert svc._stall() is None  # groups outstanding, but the learner has not taken a step yet: starting
    svc.progress.on_step(LearnerStep(step=1, policy_version=1, run_id=svc.cfg.service.run_id, n_trajectories=4))
    assert svc._stall() is None
    now[0] = 561.0
    reason = svc._stall()
    assert reason is not None and reason.startswith("12 group(s) outstanding, learner at step 1 (version 1)")
    assert svc.status()["progress"]["stalled"] is True
    svc.progress.on_step(LearnerStep(step=2, policy_version=2, run_id=svc.cfg.service.run_id, n_trajectories=4))
    assert svc._stall() is None
