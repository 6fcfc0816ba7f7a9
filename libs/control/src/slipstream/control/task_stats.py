"""Per-task statistics (attempts, solves, mean reward) and the difficulty filter built on them.

A task that the policy always solves, or never solves, gives GRPO no signal (every reward in its
group is equal) and wastes rollouts. The task source asks `should_skip` before sending a task;
the scorer side records each scored attempt. Statistics are one Redis hash per task,
`slipstream:{run}:task:<task_key>` = {attempts, solved, reward_sum}, updated with increments in
one MULTI so readers never see a half-applied attempt.

Record an attempt where it is counted once: in the learner's step commit, for the trajectories
whose ledger claim returned True; a redelivered trajectory recorded elsewhere would count twice.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Any

import msgspec

from slipstream.control.client import ControlClient
from slipstream.control.keyspace import Keyspace
from slipstream.telemetry.metrics import REGISTRY

SKIPS = REGISTRY.counter("control/tasks/skips", "Tasks the difficulty filter said to skip, by reason.")

ALWAYS_SOLVED = "always_solved"
NEVER_SOLVED = "never_solved"


class TaskStat(msgspec.Struct, frozen=True, kw_only=True):
    """What the run knows about one task."""

    attempts: int = 0
    solved: int = 0
    reward_sum: float = 0.0

    @property
    def mean_reward(self) -> float:
        return self.reward_sum / self.attempts if self.attempts else 0.0

    @property
    def solve_rate(self) -> float:
        return self.solved / self.attempts if self.attempts else 0.0


def skip_reason(stat: TaskStat, *, min_attempts: int, solved_above: float, solved_below: float) -> str | None:
    """Why to skip a task: "always_solved" (solve_rate >= solved_above), "never_solved" (<= solved_below).

    Both only once the task has `min_attempts` attempts: a young task is never skipped.
    """
    check_thresholds(min_attempts, solved_above, solved_below)
    if stat.attempts < min_attempts:
        return None
    if stat.solve_rate >= solved_above:
        return ALWAYS_SOLVED
    if stat.solve_rate <= solved_below:
        return NEVER_SOLVED
    return None


def check_thresholds(min_attempts: int, solved_above: float, solved_below: float) -> None:
    """Raise ValueError naming the bad setting of the difficulty filter."""
    if min_attempts < 1:
        raise ValueError(f"min_attempts must be >= 1, got {min_attempts}")
    if not 0.0 <= solved_below < solved_above <= 1.0:
        raise ValueError(
            f"need 0 <= solved_below < solved_above <= 1, got solved_below={solved_below}, solved_above={solved_above}"
        )


class TaskStats:
    """Statistics of the run's tasks, keyed by the task's stable key (e.g. `<env>/<task_id>`)."""

    def __init__(self, client: ControlClient, run_id: str) -> None:
        self.client = client
        self.keys = Keyspace(run_id)

    def _key(self, task_key: str) -> str:
        if not isinstance(task_key, str) or not task_key:
            raise ValueError(f"task_key must be a non-empty string, got {task_key!r}")
        return self.keys.task(task_key)

    async def record(self, task_key: str, reward: float, correct: bool) -> None:
        """Count one scored attempt of `task_key`."""
        await self.record_many([(task_key, reward, correct)])

    async def record_many(self, attempts: Iterable[tuple[str, float, bool]]) -> int:
        """Count several attempts (task_key, reward, correct) in one round trip; returns how many."""
        rows = [(self._key(k), float(r), bool(c)) for k, r, c in attempts]
        bad = [(k, r) for k, r, _ in rows if not math.isfinite(r)]
        if bad:
            raise ValueError(f"rewards must be finite numbers; got {bad[:3]!r}")
        if not rows:
            return 0

        async def run(r: Any) -> None:
            async with r.pipeline(transaction=True) as pipe:
                for key, reward, correct in rows:
                    pipe.hincrby(key, "attempts", 1)
                    pipe.hincrby(key, "solved", int(correct))
                    pipe.hincrbyfloat(key, "reward_sum", reward)
                await pipe.execute()

        await self.client.call("tasks.record", run)
        return len(rows)

    async def get(self, task_key: str) -> TaskStat:
        """The statistics of `task_key` (all zero for a task never recorded)."""
        return (await self.get_many([task_key]))[0]

    async def get_many(self, task_keys: Sequence[str]) -> list[TaskStat]:
        keys = [self._key(k) for k in task_keys]
        if not keys:
            return []

        async def run(r: Any) -> list[Any]:
            async with r.pipeline(transaction=False) as pipe:
                for key in keys:
                    pipe.hgetall(key)
                return list(await pipe.execute())

        return [_stat(h) for h in await self.client.call("tasks.get", run)]

    async def should_skip(
        self, task_key: str, *, min_attempts: int, solved_above: float = 1.0, solved_below: float = 0.0
    ) -> str | None:
        """Why the task source should skip `task_key` ("always_solved" / "never_solved"), or None.

        Each skip is counted in `control/tasks/skips{reason}`; the caller does not count it again.
        """
        check_thresholds(min_attempts, solved_above, solved_below)
        reason = skip_reason(
            await self.get(task_key), min_attempts=min_attempts, solved_above=solved_above, solved_below=solved_below
        )
        if reason is not None:
            SKIPS.add(reason=reason)
        return reason


def _stat(h: dict[str, str]) -> TaskStat:
    return TaskStat(
        attempts=int(h.get("attempts", 0)), solved=int(h.get("solved", 0)), reward_sum=float(h.get("reward_sum", 0.0))
    )
