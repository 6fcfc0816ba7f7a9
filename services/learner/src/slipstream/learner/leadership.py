"""The learner's leadership: one learner per run trains, under the run's leader lease and its fencing token.

With `[service] redis_url` set, a learner takes the lease (`slipstream.control.LeaderLease`)
before it reads its checkpoint, and keeps it alive in the background. A second learner of the
run either waits for the holder to go away (`lease_wait = true`: a standby, named in its log) or
exits 1 with a message naming the holder.

`confirm()` is asked before every optimizer step, before a staged version leaves the step, and
before every checkpoint commit. It answers True (this learner leads: go on), False (Redis cannot
be reached: pause, hold acks, ask again) or raises `LeadershipLost` (another learner leads: stop
at once, stage nothing, exit non-zero; the supervisor restarts the process, which then waits).

A lease that merely lapsed (Redis restarted without persistence and lost the key, or stayed
unreachable for longer than the TTL) is taken back when nobody else took it meanwhile: the new
token must be exactly the old one + 1 (every acquisition of the run increments the counter, so
a gap means someone else held it), and the run's durable state (latest checkpoint, highest
stored version) must be what this learner left. Either check failing makes the loss final.

Every staged version carries the token and the holder id in its file metadata; the
weight-publisher announces it only while that holder still holds the lease (README, "Fencing").
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable

from slipstream.control import Control, ControlUnavailable, LeaderLease, LeaseHeld, LeaseInfo
from slipstream.telemetry.logs import get_logger
from slipstream.telemetry.metrics import counter

log = get_logger(__name__)

FENCE_TOKEN_KEY = "fence_token"
"""Staged-file metadata key of the fencing token (the weight-publisher reads the same key)."""
LEASE_HOLDER_KEY = "lease_holder"
"""Staged-file metadata key of the lease holder id."""

RECLAIMED = counter("learner/lease/reclaimed", "Leases taken back after they lapsed with nobody else holding them.")
PAUSES = counter("learner/lease/pauses", "Times training paused because the control plane could not be reached.")

Quiet = Callable[[], Awaitable[str | None]]
"""Says why the run is no longer this learner's to continue (another learner advanced it), or None."""


class LeadershipLost(RuntimeError):
    """Another learner leads the run (or may have): this one must stop and exit non-zero."""


class Leadership:
    """This process's hold on the run's leader lease."""

    def __init__(self, control: Control, *, holder_id: str, ttl_s: float, wait: bool) -> None:
        self.control = control
        self.lease: LeaderLease = control.lease(holder_id, ttl_s=ttl_s)
        self.wait = wait
        self.waiting_for: LeaseInfo | None = None
        self.reclaimed = 0
        """Times the lease was taken back after it lapsed (the service re-marks its ledger then)."""
        self._poll_s = min(1.0, max(0.05, ttl_s / 10))
        self._paused_since: float | None = None

    @property
    def holder_id(self) -> str:
        return self.lease.holder_id

    @property
    def token(self) -> int:
        return self.lease.token or 0

    @property
    def lost_event(self) -> asyncio.Event:
        """Set by the keepalive when a renewal is refused or Redis stayed away for a whole TTL."""
        return self.lease.lost_event

    def valid(self) -> bool:
        """Held by this process's own clock (renewed less than a TTL ago); no Redis round trip."""
        return self.lease.held

    # -- taking the lease -------------------------------------------------------------------------
    async def acquire(self, *, min_token: int) -> int:
        """Take the lease before anything of the run is read; returns the fencing token.

        wait=False: `LeaseHeld` (naming the holder) propagates, and the service exits 1. wait=True:
        log who is waited for (again when the holder changes), retry through Redis outages.
        """
        announced: tuple[str, int] | None = None
        unreachable = False
        while True:
            try:
                token = await self.lease.acquire(wait=False, min_token=min_token)
                break
            except LeaseHeld as exc:
                if not self.wait:
                    log.error(
                        "another learner holds the leader lease; exiting (set [learner] lease_wait = true to wait)",
                        holder=exc.holder,
                        token=exc.token,
                        remaining_s=round(exc.remaining_s, 2),
                    )
                    raise
                self.waiting_for = LeaseInfo(exc.holder, exc.token, exc.remaining_s)
                if announced != (exc.holder, exc.token):
                    announced = (exc.holder, exc.token)
                    log.info(
                        "waiting for the leader lease",
                        holder=exc.holder,
                        token=exc.token,
                        remaining_s=round(exc.remaining_s, 2),
                        me=self.holder_id,
                    )
            except ControlUnavailable as exc:
                if not self.wait:
                    raise
                if not unreachable:
                    log.warning("control plane unreachable while waiting for the leader lease", error=str(exc))
                unreachable = True
            await asyncio.sleep(self._poll_s)
        self.waiting_for = None
        self.lease.keepalive()
        return token

    # -- keeping it -------------------------------------------------------------------------------
    async def confirm(self, quiet: Quiet) -> bool:
        """True: this learner leads now. False: Redis unreachable (pause). Raises `LeadershipLost`."""
        try:
            if self.lease.lost:
                await self._reclaim(quiet)
            elif not await self.lease.check(self.token):
                info = await self.lease.current()
                if info is not None and (info.holder, info.token) != (self.holder_id, self.token):
                    raise LeadershipLost(self._taken_by(info))
                # Vacant (Redis lost the key) or ours with no time left: take it back if still ours to take.
                await self._reclaim(quiet)
        except ControlUnavailable as exc:
            if self._paused_since is None:
                self._paused_since = time.monotonic()
                PAUSES.add()
                log.warning("control plane unreachable: training paused, acks held", error=str(exc))
            return False
        if self._paused_since is not None:
            log.info("control plane back: training resumes", paused_s=round(time.monotonic() - self._paused_since, 2))
            self._paused_since = None
        return True

    @property
    def paused(self) -> bool:
        return self._paused_since is not None

    async def _reclaim(self, quiet: Quiet) -> None:
        # No renewal may race the re-acquisition (a refused one would flag the new token as lost).
        await self.lease.stop_keepalive()
        old = self.token
        reason = self.lease.lost_reason or "lease lapsed"
        info = await self.lease.current()
        if info is not None and info.holder != self.holder_id:
            raise LeadershipLost(self._taken_by(info))
        try:
            new = await self.lease.acquire(wait=False, min_token=old)
        except LeaseHeld as exc:
            raise LeadershipLost(str(exc)) from exc
        if new != old + 1:
            await self._give_up()
            raise LeadershipLost(
                f"another learner held the lease of run {self.lease.keys.run_id!r} while it had lapsed "
                f"(fencing token {old} -> {new}); this learner's state is no longer the run's"
            )
        problem = await quiet()
        if problem is not None:
            await self._give_up()
            raise LeadershipLost(problem)
        self.lease.keepalive()
        self.reclaimed += 1
        RECLAIMED.add()
        log.warning("leader lease reclaimed", old_token=old, token=new, after=reason)

    async def _give_up(self) -> None:
        with contextlib.suppress(ControlUnavailable):
            await self.lease.release()

    def _taken_by(self, info: LeaseInfo) -> str:
        return (
            f"the leader lease of run {self.lease.keys.run_id!r} is now held by {info.holder!r} (fencing token "
            f"{info.token}); this learner (token {self.token}) stops without staging or committing anything more"
        )

    # -- leaving ----------------------------------------------------------------------------------
    async def release(self) -> None:
        """Hand the lease over at once (a clean stop), so a standby need not wait for the TTL."""
        try:
            await self.lease.release()
        except ControlUnavailable as exc:
            # It lapses by itself within the TTL.
            log.warning("lease not released; it lapses within its ttl", error=str(exc))

    def status(self) -> dict[str, object]:
        out: dict[str, object] = {"holder": self.holder_id, "token": self.token, "held": self.lease.held}
        if self.waiting_for is not None:
            out["waiting_for"] = self.waiting_for.holder
        if self.paused:
            out["paused"] = "control plane unreachable"
        return out
