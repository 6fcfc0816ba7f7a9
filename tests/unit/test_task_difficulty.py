"""The task source's difficulty filter without Redis: skip reasons, counting, the outage fallback, config checks."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from slipstream.control import ControlUnavailable, TaskStat
from slipstream.learner.claims import task_key as learner_task_key
from slipstream.schemas import Task
from slipstream.task_source.config import TasksSection
from slipstream.task_source.difficulty import DifficultyFilter, task_key

pytestmark = pytest.mark.unit


class FakeStats:
    def __init__(self, control: FakeControl) -> None:
        self.control = control
        self.table: dict[str, TaskStat] = {}
        self.calls = 0

    async def get_many(self, keys: Sequence[str]) -> list[TaskStat]:
        self.calls += 1
        if not self.control.up:
            self.control.healthy = False
            raise ControlUnavailable("redis://x", "tasks.get", ConnectionRefusedError())
        self.control.healthy = True
        return [self.table.get(k, TaskStat()) for k in keys]


class FakeControl:
    def __init__(self) -> None:
        self.up = True
        self.healthy = True
        self.task_stats = FakeStats(self)


def task(key: str) -> Task:
    return Task(task_id=f"run:arith-train-0-{key}", env="arith", prompt=f"{key}=", metadata={"key": key})


async def test_always_and_never_solved_tasks_are_skipped_once_they_have_enough_attempts() -> None:
    control = FakeControl()
    control.task_stats.table = {
        "arith/1+1": TaskStat(attempts=4, solved=4, reward_sum=4.0),
        "arith/9+9": TaskStat(attempts=4, solved=0),
        "arith/5+5": TaskStat(attempts=4, solved=2, reward_sum=2.0),
        "arith/2+2": TaskStat(attempts=3, solved=3, reward_sum=3.0),  # too young to judge
    }
    f = DifficultyFilter(control, min_attempts=4, solved_above=1.0, solved_below=0.0)  # type: ignore[arg-type]
    reasons = await f.reasons([task("1+1"), task("9+9"), task("5+5"), task("2+2"), task("7+7")])
    assert reasons == ["always_solved", "never_solved", None, None, None]
    assert f.skipped == {"always_solved": 1, "never_solved": 1} and not f.degraded


async def test_with_redis_down_everything_passes_and_redis_is_asked_again_only_later() -> None:
    control = FakeControl()
    control.task_stats.table = {"arith/1+1": TaskStat(attempts=9, solved=9, reward_sum=9.0)}
    f = DifficultyFilter(control, min_attempts=2, solved_above=0.9, solved_below=0.1, retry_s=60.0)  # type: ignore[arg-type]
    control.up = False
    assert await f.reasons([task("1+1"), task("3+3")]) == [None, None]
    assert await f.reasons([task("1+1")]) == [None]  # within retry_s and still unhealthy: not asked
    assert (control.task_stats.calls, f.unfiltered, f.degraded) == (1, 3, True)
    control.up = True
    control.healthy = True  # another operation (the health probe) reached Redis: ask again at once
    assert await f.reasons([task("1+1")]) == ["always_solved"]
    assert (control.task_stats.calls, f.degraded) == (2, False)


def test_the_learner_and_the_task_source_key_statistics_the_same_way() -> None:
    cases = [("arith", {"key": "3+4"}, "run:arith-train-0-1"), ("reverse", {}, "run:reverse-train-0-2")]
    for env, metadata, task_id in cases:
        assert task_key(env, metadata, task_id) == learner_task_key(env, metadata, task_id)


def test_the_filter_thresholds_are_checked_only_when_it_is_on() -> None:
    assert TasksSection(skip_solved_above=0.2, skip_solved_below=0.5).skip_min_attempts == 0
    with pytest.raises(ValueError, match=r"skip_solved_below \(0.5\) must be below skip_solved_above \(0.2\)"):
        TasksSection(skip_min_attempts=3, skip_solved_above=0.2, skip_solved_below=0.5)
