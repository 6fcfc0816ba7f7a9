"""The difficulty filter: skip tasks the policy always solves or never solves (no GRPO signal either way).

The learner records every scored attempt it settles (trained, or dropped as a uniform group) in
the run's per-task statistics in Redis (`slipstream.control.TaskStats`), keyed by `task_key`.
Before publishing, the source reads the statistics of its candidate tasks in one round trip and
drops those that `slipstream.control.skip_reason` says are `always_solved` (solve rate at or
above `skip_solved_above`) or `never_solved` (at or below `skip_solved_below`), once a task has
`skip_min_attempts` attempts; skips are counted by reason and replaced by the next tasks.

Redis down never stops the source: the candidates go out unfiltered (counted), and Redis is asked
again after `retry_s`, or as soon as another operation on the connection (the service's health
probe) reached it: an outage costs one timeout per `retry_s`, not one per task.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence

from slipstream.control import Control, ControlUnavailable, skip_reason
from slipstream.schemas import Task
from slipstream.telemetry.logs import get_logger
from slipstream.telemetry.metrics import counter

log = get_logger(__name__)

SKIPPED = counter("tasks/source/skipped", "Tasks not published because the difficulty filter skipped them (reason).")
UNFILTERED = counter("tasks/source/unfiltered", "Tasks published without the filter because Redis was unreachable.")


def task_key(env: str, metadata: Mapping[str, str], task_id: str) -> str:
    """The per-task statistics key: `<env>/<problem key>` (the env's canonical key), else `<env>/<task id>`.

    Must equal the learner's `slipstream.learner.claims.task_key` (a unit test checks).
    """
    key = metadata.get("key", "")
    return f"{env}/{key or task_id}"


class DifficultyFilter:
    """Which candidate tasks to skip, from the run's task statistics."""

    def __init__(
        self,
        control: Control,
        *,
        min_attempts: int,
        solved_above: float,
        solved_below: float,
        retry_s: float = 5.0,
    ) -> None:
        if min_attempts < 1:
            raise ValueError(f"the difficulty filter needs min_attempts >= 1, got {min_attempts}")
        self.control = control
        self.min_attempts = min_attempts
        self.solved_above = solved_above
        self.solved_below = solved_below
        self.retry_s = retry_s
        self.skipped: dict[str, int] = {}
        self.unfiltered = 0
        self._down_since: float | None = None
        self._last_try = 0.0

    @property
    def degraded(self) -> bool:
        """True while Redis is unreachable and tasks go out unfiltered."""
        return self._down_since is not None

    async def reasons(self, tasks: Sequence[Task]) -> list[str | None]:
        """Per task, why to skip it ("always_solved" / "never_solved"), or None; all None while Redis is away."""
        if not tasks:
            return []
        now = time.monotonic()
        if self._down_since is not None and not self.control.healthy and now - self._last_try < self.retry_s:
            return self._unfiltered(tasks)
        self._last_try = now
        try:
            stats = await self.control.task_stats.get_many([task_key(t.env, t.metadata, t.task_id) for t in tasks])
        except ControlUnavailable as exc:
            if self._down_since is None:
                self._down_since = now
                log.warning("control plane unreachable: publishing tasks unfiltered", error=str(exc))
            return self._unfiltered(tasks)
        if self._down_since is not None:
            log.info("control plane back: difficulty filter on", down_s=round(now - self._down_since, 2))
            self._down_since = None
        out = [
            skip_reason(
                s, min_attempts=self.min_attempts, solved_above=self.solved_above, solved_below=self.solved_below
            )
            for s in stats
        ]
        for reason in out:
            if reason is not None:
                SKIPPED.add(1, reason=reason)
                self.skipped[reason] = self.skipped.get(reason, 0) + 1
        return out

    def _unfiltered(self, tasks: Sequence[Task]) -> list[str | None]:
        UNFILTERED.add(len(tasks))
        self.unfiltered += len(tasks)
        return [None] * len(tasks)
