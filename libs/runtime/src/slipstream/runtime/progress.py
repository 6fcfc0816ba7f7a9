"""Readiness that reflects progress: "ready" means "moving", not only "connected".

A service that is connected but cannot advance (tasks held while no rollout finishes, a learner
that has trajectories and makes no step, a task source whose window stays full while the learner
stands still) used to answer ready while stuck. `ProgressWatch` turns that into a readiness
answer: the service describes, when asked, whether work is pending and what marks progress (a
counter, a version); when work has been pending and the mark has not moved for `stall_after_s`,
the watch names the stall, the service answers not ready and shows the reason in its status.

It is evaluated when a probe (or `status`) asks, never on a timer, so it costs nothing between
probes; `stall_after_s = 0` turns it off. It is meant to be conservative: a pause no longer than
the budget (a slow step, a cold start) never flips readiness.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable
from typing import Any


class ProgressWatch:
    """Tracks one service's progress mark and how long pending work has gone without it moving."""

    def __init__(self, stall_after_s: float, *, clock: Callable[[], float] = time.monotonic) -> None:
        if stall_after_s < 0:
            raise ValueError(f"stall_after_s must be >= 0, got {stall_after_s}")
        self.stall_after_s = stall_after_s
        self._clock = clock
        self._mark: Hashable = None
        self._moved_at = clock()
        self._pending_since: float | None = None
        self.reason: str | None = None

    def observe(self, mark: Hashable, pending: str | None) -> str | None:
        """Record the current progress `mark` and what is pending (None: nothing); returns the stall, if any."""
        now = self._clock()
        if mark != self._mark:
            self._mark = mark
            self._moved_at = now
        if not pending:
            self._pending_since = None
            self.reason = None
            return None
        if self._pending_since is None:
            self._pending_since = now
        idle = now - max(self._moved_at, self._pending_since)
        if self.stall_after_s <= 0 or idle < self.stall_after_s:
            self.reason = None
            return None
        self.reason = f"{pending}; nothing advanced for {idle:.0f} s"
        return self.reason

    def status(self) -> dict[str, Any]:
        """The /readyz fragment, from the last `observe`."""
        out: dict[str, Any] = {
            "stalled": self.reason is not None,
            "last_progress_s_ago": round(self._clock() - self._moved_at, 1),
        }
        if self.reason is not None:
            out["reason"] = self.reason
        return out
