"""Claims: what the learner records in the Redis control plane about the trajectories it settles.

At a checkpoint commit the trained ids are claimed in the idempotency ledger
(`slipstream.control.Ledger.claim`) and only then acked: a trajectory is acked once it is both in
a committed checkpoint and in the ledger. The attempts whose claim came back True are recorded in
the per-task statistics (`TaskStats.record_many`) that the task source's difficulty filter reads,
so a redelivered trajectory counts once there too. Groups dropped as `uniform_group` (every
member got the same reward: the always- and never-solved tasks the filter is for) are claimed
and recorded the same way before their ack; they are not held when Redis is down.

When Redis cannot be reached, committed batches wait here with their acks (the deliveries stay
alive through the learner's heartbeats) and are claimed, recorded and acked when it is back. A
claim answered False means another learner step already counted the id (possible only without a
single leader): it is logged and counted, never recorded twice. (An id the ledger holds under this
very step was claimed by an earlier attempt whose answer was lost to a timeout: it is ours.)
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

from slipstream.control import Control, ControlUnavailable
from slipstream.learner.intake import Member
from slipstream.schemas import ScoredEpisode
from slipstream.telemetry.logs import get_logger
from slipstream.telemetry.metrics import counter, gauge

H = TypeVar("H")
log = get_logger(__name__)

CONFLICTS = counter("learner/ledger/conflicts", "Trained ids the ledger said another learner step had already counted.")
UNCLAIMED = gauge("learner/ledger/unclaimed", "Committed trajectories waiting for Redis to claim them (acks held).")
STATS_RECORDED = counter("learner/stats/recorded", "Scored attempts recorded in the per-task statistics (label kind).")
STATS_LOST = counter("learner/stats/lost", "Attempts not recorded in the task statistics because Redis was down.")


def task_key(env: str, metadata: Mapping[str, str], task_id: str) -> str:
    """The per-task statistics key: `<env>/<problem key>` (the env's canonical key), else `<env>/<task id>`.

    Must equal the task source's `slipstream.task_source.difficulty.task_key` (a unit test checks).
    """
    key = metadata.get("key", "")
    return f"{env}/{key or task_id}"


def attempt(scored: ScoredEpisode) -> tuple[str, float, bool]:
    """One scored attempt as `TaskStats.record_many` takes it."""
    t = scored.episode
    return task_key(t.env, t.metadata, t.task_id), scored.reward, scored.correct


@dataclass
class Committed(Generic[H]):
    """Trajectories of one committed checkpoint, waiting for their ledger claim before the ack.

    The members themselves, not copies of their handles: a redelivery that arrives meanwhile
    joins its member and is acked with it.
    """

    step: int
    members: Sequence[Member[H]]

    @property
    def scored(self) -> list[ScoredEpisode]:
        return [m.scored for m in self.members]


class Claims(Generic[H]):
    """Claims committed batches in the ledger, records their statistics, then lets them be acked."""

    def __init__(self, control: Control | None, ack: Callable[[Sequence[Member[H]]], Awaitable[None]]) -> None:
        self.control = control
        self._ack = ack
        self._pending: list[Committed[H]] = []
        self._lock = asyncio.Lock()

    @property
    def pending(self) -> int:
        """Trajectories committed but not yet claimed (their acks are held)."""
        return sum(len(c.scored) for c in self._pending)

    def pending_ids(self) -> list[str]:
        return [s.episode.episode_id for c in self._pending for s in c.scored]

    def drain(self) -> list[Member[H]]:
        """Remove and return every member still waiting for its claim (to hand back on stop)."""
        members = [m for c in self._pending for m in c.members]
        self._pending.clear()
        UNCLAIMED.set(0)
        return members

    async def committed(self, batch: Committed[H]) -> None:
        """A checkpoint covering `batch` committed: claim, record and ack it (now, or once Redis is back)."""
        self._pending.append(batch)
        await self.settle()

    async def settle(self) -> bool:
        """Claim and ack every waiting batch, oldest first; False when Redis stopped it (retry later)."""
        async with self._lock:
            while self._pending:
                batch = self._pending[0]
                if self.control is not None:
                    try:
                        await self._claim(batch)
                    except ControlUnavailable:
                        UNCLAIMED.set(self.pending)
                        return False
                self._pending.pop(0)
                await self._ack(batch.members)
            UNCLAIMED.set(0)
            return True

    async def _claim(self, batch: Committed[H]) -> None:
        assert self.control is not None
        ledger = self.control.ledger
        ids = [s.episode.episode_id for s in batch.scored]
        fresh = await ledger.claim(ids, batch.step)
        for i, first in enumerate(fresh):
            # An earlier attempt whose answer was lost (a timeout) may have claimed it: that was us.
            if not first and await ledger.step_of(ids[i]) == batch.step:
                fresh[i] = True
        taken = [tid for tid, first in zip(ids, fresh, strict=True) if not first]
        if taken:
            CONFLICTS.add(len(taken))
            log.warning("trained ids already counted by another step", step=batch.step, n=len(taken), ids=taken[:5])
        # The claim is done: a failure to record below must not undo it (the ids would count twice).
        await self._record([s for s, first in zip(batch.scored, fresh, strict=True) if first], "trained")

    async def uniform_group(self, scored: Sequence[ScoredEpisode], step: int) -> None:
        """Count the attempts of a group dropped as uniform (best effort: skipped while Redis is down)."""
        if self.control is None or not scored:
            return
        if not self.control.healthy:
            # Known down: do not stall the intake on a timeout; the attempts go uncounted.
            STATS_LOST.add(len(scored))
            return
        try:
            fresh = await self.control.ledger.claim([s.episode.episode_id for s in scored], step)
        except ControlUnavailable:
            STATS_LOST.add(len(scored))
            return
        await self._record([s for s, first in zip(scored, fresh, strict=True) if first], "uniform_group")

    async def _record(self, scored: Sequence[ScoredEpisode], kind: str) -> None:
        assert self.control is not None
        if not scored:
            return
        try:
            await self.control.task_stats.record_many(attempt(s) for s in scored)
        except ControlUnavailable as exc:
            STATS_LOST.add(len(scored))
            log.warning("task statistics not recorded", n=len(scored), error=str(exc))
            return
        STATS_RECORDED.add(len(scored), kind=kind)
