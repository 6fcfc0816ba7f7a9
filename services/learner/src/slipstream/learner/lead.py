"""The learner's lead on its run: taken at start, confirmed before every step, stage and commit, handed over at stop.

`leadership.py` keeps the lease itself (acquire, confirm, reclaim, release) and knows nothing of
the learner. This module adds what needs the learner's state: the check a lapsed lease must pass
before it is taken back (the run's latest checkpoint and highest published version are still this
learner's), the shared ledger re-marked from the retained checkpoints (at start, and after a
reclaim, since Redis may have restarted empty), the fence that rides in every staged file, and the
hand-over that keeps the lease until the publisher has announced the last staged version.

Only with `[service] redis_url`. While Redis is unreachable `confirm` waits (training pauses,
acks stay held) and the learner goes on by itself when Redis is back (README, "The control
plane"). Without a control plane the service has no `Lead` and `confirmed` is always True.
"""

from __future__ import annotations

import asyncio
import contextlib
import time

from slipstream.bus import Bus, Delivery
from slipstream.control import Control, ControlUnavailable
from slipstream.learner.checkpoint import Checkpoints
from slipstream.learner.claims import Claims
from slipstream.learner.leadership import FENCE_TOKEN_KEY, LEASE_HOLDER_KEY, Leadership
from slipstream.learner.ledger import TrainedLedger
from slipstream.learner.progress import Progress
from slipstream.learner.resume import last_announced, last_published
from slipstream.schemas import ScoredEpisode
from slipstream.store import ObjectStore
from slipstream.telemetry.logs import get_logger

log = get_logger(__name__)


class Lead:
    """This learner's lease on the run, with the ledger marking and fencing that come with it."""

    def __init__(
        self,
        control: Control,
        leadership: Leadership,
        *,
        claims: Claims[Delivery[ScoredEpisode]],
        checkpoints: Checkpoints,
        store: ObjectStore,
        ledger: TrainedLedger,
        progress: Progress,
    ) -> None:
        self.control = control
        self.leadership = leadership
        self.claims = claims
        self.checkpoints = checkpoints
        self.store = store
        self.ledger = ledger
        self.progress = progress

    @classmethod
    async def take(
        cls,
        control: Control,
        *,
        holder_id: str,
        ttl_s: float,
        wait: bool,
        claims: Claims[Delivery[ScoredEpisode]],
        checkpoints: Checkpoints,
        store: ObjectStore,
        ledger: TrainedLedger,
        progress: Progress,
    ) -> Lead:
        """Take the run's leader lease (waiting for it, or failing, per `wait`)."""
        leadership = Leadership(control, holder_id=holder_id, ttl_s=ttl_s, wait=wait)
        # Tokens keep growing past the checkpoint's even if Redis lost its counter.
        min_token = await asyncio.to_thread(checkpoints.fence_token)
        token = await leadership.acquire(min_token=min_token)
        log.info("leading the run", run_id=control.run_id, holder=holder_id, token=token)
        return cls(
            control, leadership, claims=claims, checkpoints=checkpoints, store=store, ledger=ledger, progress=progress
        )

    @property
    def token(self) -> int:
        return self.leadership.token

    @property
    def lost_event(self) -> asyncio.Event:
        return self.leadership.lost_event

    def fence(self) -> dict[str, str]:
        """The staged file's metadata that lets the publisher announce it only under this lease."""
        return {FENCE_TOKEN_KEY: str(self.leadership.token), LEASE_HOLDER_KEY: self.leadership.holder_id}

    async def mark_ledger(self) -> None:
        """Put the retained checkpoints' ids in the shared ledger (crash mid-commit; Redis that lost them)."""
        waiting = set(self.claims.pending_ids())  # claimed under their own step when Redis lets them
        ids = [tid for tid in self.ledger.ids() if tid not in waiting]
        if not ids:
            return
        try:
            restored = await self.control.ledger.mark(ids, self.progress.committed_step)
        except ControlUnavailable as exc:
            # The local ledger still covers them; the next start (or reclaim) marks them again.
            log.warning("ledger not restored from the checkpoints", ids=len(ids), error=str(exc))
            return
        log.info("ledger restored from the checkpoints", ids=len(ids), restored=restored)

    async def confirm(self, stop: asyncio.Event | None) -> bool:
        """Confirm this learner leads the run; while Redis is away wait (until `stop`; once without it).

        False: not confirmed (stopping, or Redis down with no wait). Raises `LeadershipLost`.
        """
        while True:
            reclaimed = self.leadership.reclaimed
            if await self.leadership.confirm(self._run_unchanged):
                if self.leadership.reclaimed != reclaimed:
                    await self.mark_ledger()  # Redis may have restarted empty
                return True
            if stop is None or stop.is_set():
                return False
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), 0.5)

    async def _run_unchanged(self) -> str | None:
        """Why the run moved on without this learner while its lease had lapsed, or None."""
        p = self.progress
        latest = await asyncio.to_thread(self.checkpoints.latest_step)
        if latest > p.committed_step:
            return f"checkpoint step {latest} was committed by another learner (this one: {p.committed_step})"
        published = await asyncio.to_thread(last_published, self.store, self.control.run_id)
        if published > p.version:
            return f"version {published} was published by another learner (this one holds {p.version})"
        return None

    async def hand_over(self, bus: Bus, handover_s: float) -> None:
        """Keep the lease while the publisher announces what was staged (it announces only under a held lease)."""
        if not self.leadership.valid():
            return
        deadline = time.monotonic() + handover_s
        announced = -1
        while time.monotonic() < deadline:
            # Announced, not just stored: the publisher checks the lease once more right before the announce.
            announced = await last_announced(bus, self.control.run_id, 0.5)
            if announced >= self.progress.version:
                return
            await asyncio.sleep(0.1)
        log.warning(
            "lease released before the last staged versions were announced; a successor fences them",
            announced=announced,
            policy_version=self.progress.version,
        )

    async def release(self) -> None:
        """Give the lease up (a standby takes over at once instead of after the ttl)."""
        await self.leadership.release()


async def confirmed(lead: Lead | None, stop: asyncio.Event | None) -> bool:
    """`lead.confirm(stop)`; True without a control plane, where there is no lease to confirm."""
    return lead is None or await lead.confirm(stop)
