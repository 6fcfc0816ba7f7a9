"""The learner's leader lease with a fencing token: one learner per run, and a stale one is fenced.

A lease is the Redis string `<token>:<holder_id>` with a TTL. Acquiring it (one Lua script:
set-if-absent with a TTL, then INCR the run's fence counter) yields the fencing token, an integer that grows
with every acquisition of the run and is never reused. The holder keeps the lease alive with
`keepalive()`; when a renewal is refused (the key expired or another holder took over) or Redis
stays unreachable for a whole TTL, the lease flips to `lost` and the learner must stop
publishing. With a Sentinel URL, an acquisition or renewal counts only once a replica holds it
(`ControlClient.replicated`), so a failover never hands out a token twice. Right before
announcing weights the learner calls `fenced_publish_allowed(token)`: one atomic check that the
token is still the current one and the lease has time left. A learner that was paused (GC, a
network partition) past its TTL therefore cannot publish, since a successor's acquisition
replaced the token.

The check and the publish are two steps, so a holder that stalls between them for longer than
`min_remaining_s` can still publish once; consumers that also compare the fencing token carried
with a version close that gap (README, "Fencing").
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import socket
import time

import structlog

from slipstream.control.client import ControlClient, ControlError, ControlUnavailable
from slipstream.control.keyspace import Keyspace
from slipstream.telemetry.metrics import REGISTRY

log = structlog.get_logger("slipstream.control.lease")

ACQUIRED = REGISTRY.counter("control/lease/acquired", "Leader lease acquisitions (each one issues a fencing token).")
LOST = REGISTRY.counter("control/lease/lost", "Leader leases lost while held, by reason.")
FENCED = REGISTRY.counter("control/lease/fenced", "Publishes refused by the fencing check, by reason.")

# KEYS: lease, fence. ARGV: holder, ttl_ms, floor. -> {1, token, ttl_ms} or {0, "<token>:<holder>", pttl_ms}.
# The same holder id takes the lease over at once (a restarted pod with a stable name); the new
# token fences its previous incarnation. `floor` keeps tokens above any the caller has seen, should
# Redis have lost the counter.
_ACQUIRE = """
local cur = redis.call('GET', KEYS[1])
if cur then
  local sep = string.find(cur, ':', 1, true)
  if string.sub(cur, sep + 1) ~= ARGV[1] then
    return {0, cur, redis.call('PTTL', KEYS[1])}
  end
end
local token = redis.call('INCR', KEYS[2])
local floor = tonumber(ARGV[3])
if token <= floor then
  token = floor + 1
  redis.call('SET', KEYS[2], token)
end
redis.call('SET', KEYS[1], token .. ':' .. ARGV[1], 'PX', ARGV[2])
return {1, token, tonumber(ARGV[2])}
"""
# KEYS: lease. ARGV: "<token>:<holder>", ttl_ms.
_RENEW = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('PEXPIRE', KEYS[1], ARGV[2])
end
return 0
"""
_RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('DEL', KEYS[1])
end
return 0
"""
# KEYS: lease. -> {value or false, pttl_ms}; one script so value and TTL are read together.
_INSPECT = """
return {redis.call('GET', KEYS[1]), redis.call('PTTL', KEYS[1])}
"""


def default_holder_id() -> str:
    """`host:pid:random`: unique per process, readable in a LeaseHeld message."""
    return f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(3)}"


class LeaseHeld(ControlError):
    """Another holder has the lease."""

    def __init__(self, run_id: str, holder: str, token: int, remaining_s: float, waited_s: float | None) -> None:
        self.run_id = run_id
        self.holder = holder
        self.token = token
        self.remaining_s = remaining_s
        waited = f" after waiting {waited_s:.1f} s" if waited_s is not None else ""
        super().__init__(
            f"the leader lease of run {run_id!r} is held by {holder!r} (fencing token {token}) for another "
            f"{remaining_s:.1f} s unless renewed{waited}; another learner of this run is running: stop it, "
            "or start this one with wait enabled to take over when it exits"
        )


class LeaseInfo:
    """Who holds a lease, under which token, for how much longer."""

    __slots__ = ("holder", "remaining_s", "token")

    def __init__(self, holder: str, token: int, remaining_s: float) -> None:
        self.holder = holder
        self.token = token
        self.remaining_s = remaining_s

    @classmethod
    def parse(cls, value: str, pttl_ms: int) -> LeaseInfo:
        token, _, holder = value.partition(":")
        # PTTL -1 (no expiry) cannot happen through this module; report it as no time left.
        return cls(holder, int(token) if token.isdigit() else 0, max(pttl_ms, 0) / 1000)

    def __repr__(self) -> str:
        return f"LeaseInfo(holder={self.holder!r}, token={self.token}, remaining_s={self.remaining_s:.3f})"


class LeaderLease:
    """The leader lease of one run, as seen by one would-be holder."""

    def __init__(self, client: ControlClient, run_id: str, holder_id: str | None = None, ttl_s: float = 10.0) -> None:
        if ttl_s <= 0:
            raise ValueError(f"lease ttl_s must be > 0, got {ttl_s}")
        self.client = client
        self.keys = Keyspace(run_id)
        self.holder_id = holder_id or default_holder_id()
        if not self.holder_id.strip():
            raise ValueError("lease holder_id must not be blank")
        self.ttl_s = ttl_s
        self.token: int | None = None
        self.lost_reason: str | None = None
        self.lost_event = asyncio.Event()
        self._renewed_at = 0.0  # monotonic time the last successful (re)newal was *sent*
        self._keepalive: asyncio.Task[None] | None = None
        self._acquire = client.script(_ACQUIRE)
        self._renew = client.script(_RENEW)
        self._release = client.script(_RELEASE)
        self._inspect = client.script(_INSPECT)

    @property
    def _ttl_ms(self) -> int:
        return max(1, int(self.ttl_s * 1000))

    @property
    def _value(self) -> str:
        return f"{self.token}:{self.holder_id}"

    @property
    def lost(self) -> bool:
        """True once the lease was held and then lost, or has lapsed by this process's own clock."""
        if self.lost_event.is_set():
            return True
        return self.token is not None and time.monotonic() - self._renewed_at >= self.ttl_s

    @property
    def held(self) -> bool:
        return self.token is not None and not self.lost

    async def acquire(self, wait: bool = False, timeout_s: float | None = None, *, min_token: int = 0) -> int:
        """Take the lease and return the new fencing token.

        The token is above `min_token` and above any token this object held: a learner passes the
        token stored in its checkpoint, so tokens keep growing even if Redis lost its counter.

        wait=False: raise `LeaseHeld` (holder and remaining TTL in the message) when another
        holder has it. wait=True: poll until it is free, for at most `timeout_s` (None = no
        limit), then raise `LeaseHeld`. While waiting, a Redis outage is retried; without wait,
        or past the deadline, it raises `ControlUnavailable`.
        """
        start = time.monotonic()
        deadline = None if timeout_s is None else start + timeout_s
        poll_s = min(1.0, max(0.05, self.ttl_s / 10))
        floor = max(min_token, self.token or 0)
        while True:
            sent = time.monotonic()
            try:
                ok, a, b = await self.client.replicated(
                    "lease.acquire",
                    self._acquire,
                    [self.keys.lease, self.keys.fence],
                    [self.holder_id, self._ttl_ms, floor],
                )
            except ControlUnavailable:
                if not wait or (deadline is not None and time.monotonic() >= deadline):
                    raise
                await asyncio.sleep(poll_s)
                continue
            if int(ok) == 1:
                return self._took(int(a), sent)
            info = LeaseInfo.parse(str(a), int(b))
            now = time.monotonic()
            if not wait or (deadline is not None and now >= deadline):
                raise LeaseHeld(
                    self.keys.run_id, info.holder, info.token, info.remaining_s, now - start if wait else None
                )
            pause = min(poll_s, max(info.remaining_s, 0.01))
            if deadline is not None:
                pause = min(pause, max(deadline - now, 0.0))
            await asyncio.sleep(pause)

    def _took(self, token: int, sent: float) -> int:
        if self.token is not None and token != self.token:
            log.info("lease re-acquired", run_id=self.keys.run_id, holder=self.holder_id, old=self.token, token=token)
        self.token = token
        self._renewed_at = sent
        self.lost_reason = None
        self.lost_event = asyncio.Event()
        ACQUIRED.add()
        log.info("lease acquired", run_id=self.keys.run_id, holder=self.holder_id, token=token, ttl_s=self.ttl_s)
        return token

    async def renew(self) -> bool:
        """Extend the TTL if this holder (with its current token) still has the lease."""
        if self.token is None:
            return False
        sent = time.monotonic()
        value = self._value
        done = await self.client.replicated("lease.renew", self._renew, [self.keys.lease], [value, self._ttl_ms])
        if int(done) == 1:
            self._renewed_at = sent
            return True
        return False

    async def release(self) -> bool:
        """Give the lease up (only if still ours); True when it was ours. Stops the keepalive."""
        await self.stop_keepalive()
        if self.token is None:
            return False
        value = self._value
        done = await self.client.call("lease.release", lambda r: self._release(keys=[self.keys.lease], args=[value]))
        log.info(
            "lease released", run_id=self.keys.run_id, holder=self.holder_id, token=self.token, was_held=bool(done)
        )
        self.token = None
        return int(done) == 1

    async def current(self) -> LeaseInfo | None:
        """The lease as Redis has it now (any holder), or None when nobody holds it."""
        value, pttl = await self.client.call("lease.inspect", lambda r: self._inspect(keys=[self.keys.lease]))
        if not value:
            return None
        return LeaseInfo.parse(str(value), int(pttl))

    async def check(self, token: int, *, min_remaining_s: float = 0.0) -> bool:
        """Is `token` this holder's current fencing token, with at least `min_remaining_s` of lease left?"""
        info = await self.current()
        if info is None or info.token != token or info.holder != self.holder_id:
            return False
        return info.remaining_s > min_remaining_s

    async def fenced_publish_allowed(self, token: int, *, min_remaining_s: float = 0.0) -> bool:
        """The gate right before announcing a version: `check(token)`, failing closed.

        False (counted and logged, by reason) when the lease was lost, the token was superseded, or
        Redis cannot be asked; `min_remaining_s` should cover the time the announce takes.
        """
        reason: str | None = None
        if self.lost:
            reason = "lease_lost"
        else:
            try:
                if not await self.check(token, min_remaining_s=min_remaining_s):
                    reason = "token_superseded_or_lapsed"
            except ControlUnavailable:
                reason = "redis_unavailable"
        if reason is None:
            return True
        FENCED.add(reason=reason)
        log.warning("publish fenced", run_id=self.keys.run_id, holder=self.holder_id, token=token, reason=reason)
        return False

    def keepalive(self, interval_s: float | None = None) -> asyncio.Task[None]:
        """Start renewing every `interval_s` (default ttl/3) in a background task; returns it.

        The task ends when the lease is lost (`lost` turns True, `lost_event` is set, the reason is
        in `lost_reason`) or on `stop_keepalive()`/`release()`.
        """
        if self.token is None:
            raise ControlError("keepalive() needs a held lease: call acquire() first")
        interval = interval_s if interval_s is not None else self.ttl_s / 3
        if interval <= 0 or interval >= self.ttl_s:
            raise ValueError(f"keepalive interval must be in (0, ttl_s={self.ttl_s}), got {interval}")
        if self._keepalive is not None and not self._keepalive.done():
            return self._keepalive
        self._keepalive = asyncio.create_task(self._keep(interval), name=f"lease-keepalive-{self.keys.run_id}")
        return self._keepalive

    async def stop_keepalive(self) -> None:
        task, self._keepalive = self._keepalive, None
        if task is not None and not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def _keep(self, interval: float) -> None:
        delay = interval
        while True:
            await asyncio.sleep(delay)
            try:
                if await self.renew():
                    delay = interval
                    continue
                self._mark_lost("refused", "renewal refused: the lease expired or another holder took it")
                return
            except ControlUnavailable as exc:
                if time.monotonic() - self._renewed_at < self.ttl_s:
                    # Still valid in Redis (if Redis is alive at all): retry sooner than usual.
                    delay = max(0.05, interval / 4)
                    continue
                self._mark_lost("unreachable", f"Redis unreachable for longer than the lease ttl ({exc})")
                return
            except Exception as exc:
                # Not an outage (a script or protocol error): this holder can no longer vouch for
                # its lease, so it must stop publishing; the error still surfaces from the task.
                self._mark_lost("error", f"renewal failed: {exc!r}")
                raise

    def _mark_lost(self, kind: str, reason: str) -> None:
        self.lost_reason = reason
        self.lost_event.set()
        LOST.add(reason=kind)
        log.error("lease lost", run_id=self.keys.run_id, holder=self.holder_id, token=self.token, reason=reason)
