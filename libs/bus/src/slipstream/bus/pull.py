"""Fetching from a JetStream pull consumer with one reply inbox and no per-message tasks.

nats-py's `PullSubscription.fetch` reads each message through `next_msg`, which creates a task,
a `wait_for` and a uuid per message (~15 µs, a sixth of the per-message cost of a 23 KB
trajectory). This fetcher speaks the same protocol directly: a `no_wait` request for what is
available now (the server ends it with a 404/408 status when it has fewer than asked), and, only
when nothing was there, one lingering request for a single message with `expires`, so no request
is left open on the server to deliver messages nobody is waiting for. A message that still
arrives after a local timeout (a slow server, a reconnect) stays queued and is returned by the
next fetch.

A "no responders" answer (503) is what a JetStream cluster gives while the consumer's leader is
being elected (its node was killed or cut off): for up to `LEADERLESS_BUDGET_S` a fetch that gets
one returns what it has after a short pause, and the caller's next fetch asks again; only a
consumer that stays unanswered longer (deleted, never created) raises `BusError`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque

import nats.errors
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from slipstream.bus.base import BusError

log = logging.getLogger(__name__)
_ACK_PREFIX = "$JS.ACK."
_NO_RESPONDERS = "503"
# How long past its own `expires` we wait for the server's end-of-request status.
_GRACE_S = 0.25
# A batch arrives as one burst; a pause this long after a message means the server has no more
# for now (it does not always say so: at max_ack_pending it holds a no_wait request open).
_IDLE_GAP_S = 0.1
_MIN_EXPIRES_S = 0.01
LEADERLESS_BUDGET_S = 30.0
"""How long a durable may answer "no responders" (a cluster electing its leader) before fetch raises."""
_LEADERLESS_PAUSE_S = 0.2


def _wake(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)


class PullFetcher:
    """Batches from one durable, read off a private inbox."""

    def __init__(self, nc: Client, stream: str, durable: str) -> None:
        self._nc = nc
        self._stream = stream
        self._durable = durable
        self._request_subject = f"$JS.API.CONSUMER.MSG.NEXT.{stream}.{durable}"
        self._inbox = nc.new_inbox()
        self._queue: deque[Msg] = deque()
        self._waiter: asyncio.Future[None] | None = None
        self._sub: Subscription | None = None
        self._unanswered_since: float | None = None

    async def start(self) -> None:
        self._sub = await self._nc.subscribe(self._inbox, cb=self._on_msg)

    async def close(self) -> None:
        if self._sub is not None:
            try:
                await self._sub.unsubscribe()
            except (nats.errors.Error, ValueError) as exc:
                log.debug("unsubscribe of %s/%s failed: %r", self._stream, self._durable, exc)
            self._sub = None
        if self._queue:
            # Fetched by the server for us, never handed out: they come back after ack_wait.
            log.info("%s/%s closed with %d undelivered messages", self._stream, self._durable, len(self._queue))
            self._queue.clear()

    async def _on_msg(self, msg: Msg) -> None:
        self._queue.append(msg)
        w = self._waiter
        if w is not None and not w.done():
            w.set_result(None)

    async def _next(self, deadline: float) -> Msg | None:
        """The next message or status from the inbox, or None at `deadline` (loop time)."""
        loop = asyncio.get_running_loop()
        while not self._queue:
            remaining = deadline - loop.time()
            if remaining <= 0:
                return None
            fut: asyncio.Future[None] = loop.create_future()
            self._waiter = fut
            timer = loop.call_later(remaining, _wake, fut)
            try:
                await fut
            finally:
                timer.cancel()
                self._waiter = None
        return self._queue.popleft()

    def _status(self, msg: Msg) -> str | None:
        """None for a message of the stream; the status code of a server notice otherwise."""
        if msg.reply and msg.reply.startswith(_ACK_PREFIX):
            return None
        return (msg.headers or {}).get("Status", "?")

    def _leaderless(self, status: str | None) -> bool:
        """True for a "no responders" status within the budget; raises past it; resets on anything else."""
        if status != _NO_RESPONDERS:
            self._unanswered_since = None
            return False
        now = time.monotonic()
        if self._unanswered_since is None:
            self._unanswered_since = now
            log.warning("pull consumer %s/%s has no leader now; asking again", self._stream, self._durable)
        if now - self._unanswered_since > LEADERLESS_BUDGET_S:
            raise BusError(
                f"pull consumer {self._durable} on stream {self._stream} has not answered for "
                f"{now - self._unanswered_since:.0f} s (deleted? not created? no cluster quorum?)"
            )
        return True

    async def _drain_available(self, out: list[Msg], batch: int, deadline: float) -> None:
        """Ask for what is there right now and read until `batch` or the server says no more."""
        need = batch - len(out)
        await self._nc.publish(self._request_subject, b'{"batch":%d,"no_wait":true}' % need, reply=self._inbox)
        loop = asyncio.get_running_loop()
        until = deadline
        while need > 0:
            m = await self._next(until)
            if m is None:
                return
            status = self._status(m)
            if self._leaderless(status):
                await asyncio.sleep(_LEADERLESS_PAUSE_S)
                return
            if status is None:
                out.append(m)
                need -= 1
                until = min(deadline, loop.time() + _IDLE_GAP_S)
                continue
            return  # 404 no messages / 408 / 409: this request is over

    async def fetch(self, batch: int, timeout: float) -> list[Msg]:
        if batch < 1:
            raise ValueError(f"batch must be >= 1, not {batch}")
        loop = asyncio.get_running_loop()
        deadline = loop.time() + max(timeout, _MIN_EXPIRES_S)
        out: list[Msg] = []
        while self._queue and len(out) < batch:  # stragglers of an earlier request
            queued = self._queue.popleft()
            if self._status(queued) is None:
                out.append(queued)
        if len(out) < batch:
            await self._drain_available(out, batch, deadline)
        if out:
            return out
        remaining = deadline - loop.time()
        if remaining < _MIN_EXPIRES_S:
            return out
        expires_ns = int((remaining - _MIN_EXPIRES_S / 2) * 1e9)
        await self._nc.publish(self._request_subject, b'{"batch":1,"expires":%d}' % expires_ns, reply=self._inbox)
        while True:
            m = await self._next(deadline + _GRACE_S)
            if m is None:
                return out
            status = self._status(m)
            if self._leaderless(status):
                await asyncio.sleep(_LEADERLESS_PAUSE_S)
                return out
            if status is None:
                out.append(m)
                break
            if status in ("404", "408", "409"):
                return out
            # 100 (heartbeat) and other notices: keep waiting for this request's answer
        if batch > 1:
            await self._drain_available(out, batch, loop.time() + _GRACE_S)
        return out
