"""Pipelined JetStream publishing with bounded bytes and messages in flight, and acks that time out.

nats-py's `publish_async` futures never time out, and a stream that answers 429 leaves them
pending forever (nats.py#985). This publisher sends with a reply inbox of its own and tracks
each message until its PubAck: one watchdog task (not a timer per message) re-sends a message
whose ack is late, with the same headers and so the same `Nats-Msg-Id`, up to `publish_retries`
times, then fails its future with `PublishError`. Senders wait for room when `max_inflight_bytes`
or `max_inflight_msgs` is reached, which is what keeps a fast producer from overrunning the
server's ingest queue.

Without a msg id a re-send after a lost ack can store the message twice (at-least-once); with a
deterministic msg id the stream drops the copy (exactly-once within the duplicate window).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque

import msgspec
import nats.errors
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from slipstream.bus.base import PublishError
from slipstream.bus.config import BusConfig
from slipstream.bus.instruments import (
    PUBLISH_BYTES,
    PUBLISH_DUPLICATES,
    PUBLISH_ERRORS,
    PUBLISH_MESSAGES,
    PUBLISH_RETRIES,
)

log = logging.getLogger(__name__)
# Server answers worth a re-send: too many requests, and a stream leader that is moving.
_RETRYABLE_CODES = frozenset({429, 503})


class _ApiError(msgspec.Struct):
    code: int = 0
    err_code: int = 0
    description: str = ""


class _PubAck(msgspec.Struct):
    stream: str = ""
    seq: int = 0
    duplicate: bool = False
    error: _ApiError | None = None


_ack_decoder = msgspec.json.Decoder(_PubAck)


class _Pending:
    __slots__ = ("async_", "attempts", "data", "deadline", "future", "headers", "reply", "size", "subject")

    def __init__(
        self,
        subject: str,
        data: bytes,
        headers: dict[str, str] | None,
        future: asyncio.Future[int],
        deadline: float,
        reply: str,
        async_: bool,
    ) -> None:
        self.subject = subject
        self.data = data
        self.headers = headers
        self.size = len(data)
        self.future = future
        self.deadline = deadline
        self.reply = reply
        self.attempts = 1
        self.async_ = async_


class JetStreamPublisher:
    """Sends messages to JetStream and resolves one future per message with its stream sequence."""

    def __init__(self, nc: Client, cfg: BusConfig) -> None:
        self._nc = nc
        self._timeout = cfg.ack_timeout_s
        self._retries = max(0, cfg.publish_retries)
        self._max_bytes = cfg.max_inflight_bytes
        self._max_msgs = max(1, cfg.max_inflight_msgs)
        self._tick = max(0.01, min(0.2, self._timeout / 5))
        self._prefix = nc.new_inbox() + "."
        self._plen = len(self._prefix)
        self._pending: dict[str, _Pending] = {}
        self._order: deque[_Pending] = deque()  # send order = deadline order
        self._retry_soon: list[_Pending] = []
        self._bytes = 0
        self._next = 0
        self._space = asyncio.Event()
        self._idle = asyncio.Event()
        self._idle.set()
        self._acked_msgs = 0
        self._acked_bytes = 0
        self._failed = 0
        self._first_failure = ""
        self._sub: Subscription | None = None
        self._watchdog: asyncio.Task[None] | None = None
        self._closed = False

    @property
    def in_flight(self) -> tuple[int, int]:
        """(messages, bytes) sent and not yet acknowledged."""
        return len(self._pending), self._bytes

    async def start(self) -> None:
        self._sub = await self._nc.subscribe(self._prefix + "*", cb=self._on_reply)
        self._watchdog = asyncio.create_task(self._watch(), name="bus-publish-watchdog")

    async def send(
        self, subject: str, data: bytes, headers: dict[str, str] | None, *, async_: bool = True
    ) -> asyncio.Future[int]:
        """Send now (waiting for room first); the future resolves with the stream sequence."""
        if self._closed:
            raise PublishError(f"cannot publish to {subject!r}: the bus is closed")
        size = len(data)
        while self._pending and (self._bytes + size > self._max_bytes or len(self._pending) >= self._max_msgs):
            self._space.clear()
            await self._space.wait()
            if self._closed:
                raise PublishError(f"cannot publish to {subject!r}: the bus is closed")
        self._next += 1
        token = str(self._next)
        fut: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        p = _Pending(subject, data, headers, fut, time.monotonic() + self._timeout, self._prefix + token, async_)
        self._pending[token] = p
        self._order.append(p)
        self._bytes += size
        self._idle.clear()
        try:
            await self._nc.publish(subject, data, reply=p.reply, headers=headers)
        except nats.errors.OutboundBufferLimitError:
            # Disconnected with a full reconnect buffer: the watchdog re-sends when the ack is late.
            log.warning("publish to %r buffered out while disconnected; will re-send", subject)
        except nats.errors.Error as exc:
            self._finish(p)
            PUBLISH_ERRORS.add(1, reason="send")
            raise PublishError(f"cannot publish to {subject!r}: {exc!r}") from exc
        return fut

    async def publish(self, subject: str, data: bytes, headers: dict[str, str] | None) -> int:
        """Send and wait for the ack (re-sending a lost one); raises PublishError naming the subject."""
        fut = await self.send(subject, data, headers, async_=False)
        backstop = (self._retries + 1) * self._timeout + 4 * self._tick + 1.0
        try:
            return await asyncio.wait_for(fut, backstop)
        except TimeoutError:
            raise PublishError(f"no ack for {subject!r} within {backstop:.1f}s") from None

    async def flush(self, timeout: float | None = None) -> None:
        """Wait until every sent message is acked or failed; raise if any async publish failed."""
        if self._pending:
            try:
                await asyncio.wait_for(self._idle.wait(), timeout)
            except TimeoutError:
                n, nbytes = self.in_flight
                raise PublishError(f"{n} publishes ({nbytes} bytes) still unacknowledged after {timeout}s") from None
        self._flush_metrics()
        if self._failed:
            n, first = self._failed, self._first_failure
            self._failed, self._first_failure = 0, ""
            raise PublishError(f"{n} publishes failed since the last flush; first: {first}")

    def on_reconnected(self) -> None:
        """Acks of messages sent before the drop are lost with the old connection: re-send them now."""
        now = time.monotonic()
        for p in self._order:
            p.deadline = min(p.deadline, now)

    def on_denied(self, subject: str) -> None:
        """The server refused a publish to `subject`: fail its waiting messages now, not at the ack timeout.

        nats-py lower-cases the server's error line, so subjects are compared without case.
        """
        subject = subject.lower()
        for p in list(self._pending.values()):
            if p.subject.lower() == subject:
                self._fail(p, "permission denied: this bus user may not publish here", "denied")

    async def close(self) -> None:
        self._closed = True
        if self._watchdog is not None:
            self._watchdog.cancel()
            try:
                await self._watchdog
            except asyncio.CancelledError:
                pass
        for p in list(self._pending.values()):
            self._fail(p, "the bus closed before the ack arrived", "closed")
        self._space.set()
        self._flush_metrics()
        if self._sub is not None and not self._nc.is_closed:
            try:
                await self._sub.unsubscribe()
            except nats.errors.Error as exc:
                log.debug("unsubscribe of the ack inbox failed: %r", exc)

    # -- internals ----------------------------------------------------------------------------
    def _finish(self, p: _Pending) -> None:
        token = p.reply[self._plen :]
        if self._pending.pop(token, None) is None:
            return
        self._bytes -= p.size
        if not self._pending:
            self._idle.set()
        if not self._space.is_set():
            self._space.set()

    def _fail(self, p: _Pending, why: str, reason: str) -> None:
        self._finish(p)
        if p.future.done():
            return
        err = PublishError(f"publish to {p.subject!r} failed: {why}")
        p.future.set_exception(err)
        PUBLISH_ERRORS.add(1, reason=reason)
        if p.async_:
            # Reported by flush(); mark it retrieved so an unawaited future does not log at GC.
            p.future.exception()
            self._failed += 1
            self._first_failure = self._first_failure or str(err)
            log.warning("%s", err)

    async def _on_reply(self, msg: Msg) -> None:
        p = self._pending.get(msg.subject[self._plen :])
        if p is None or p.future.done():
            return  # the ack of a message already acked by an earlier attempt, or already failed
        data = msg.data
        if not data:
            status = msg.headers.get("Status", "") if msg.headers else ""
            if status == "503":
                self._fail(p, "no stream captures this subject (no responders); did ensure_streams run?", "no_stream")
            else:
                self._retry(p, f"status {status!r}")
            return
        try:
            ack = _ack_decoder.decode(data)
        except msgspec.DecodeError:
            self._fail(p, f"malformed ack {data[:200]!r}", "bad_ack")
            return
        if ack.error is not None:
            if ack.error.code in _RETRYABLE_CODES:
                self._retry(p, f"{ack.error.code} {ack.error.description}")
            else:
                self._fail(p, f"server error {ack.error.code}/{ack.error.err_code}: {ack.error.description}", "server")
            return
        self._finish(p)
        p.future.set_result(ack.seq)
        self._acked_msgs += 1
        self._acked_bytes += p.size
        if ack.duplicate:
            PUBLISH_DUPLICATES.add(1)

    def _retry(self, p: _Pending, why: str) -> None:
        if p.attempts > self._retries:
            self._fail(p, f"{why} after {p.attempts} attempts", "retries")
        else:
            self._retry_soon.append(p)

    def _flush_metrics(self) -> None:
        if self._acked_msgs:
            PUBLISH_MESSAGES.add(self._acked_msgs)
            PUBLISH_BYTES.add(self._acked_bytes)
            self._acked_msgs = self._acked_bytes = 0

    async def _resend(self, p: _Pending, now: float, why: str, *, requeue: bool = True) -> None:
        p.attempts += 1
        if requeue:
            # Only a message taken off the head of the deadline queue goes back on its tail; a
            # throttled one keeps its place (and deadline) so the queue stays in deadline order.
            p.deadline = now + self._timeout
            self._order.append(p)
        PUBLISH_RETRIES.add(1)
        log.info("re-sending %r (attempt %d): %s", p.subject, p.attempts, why)
        try:
            await self._nc.publish(p.subject, p.data, reply=p.reply, headers=p.headers)
        except nats.errors.Error as exc:
            log.warning("re-send to %r failed (%r); will try again at the next deadline", p.subject, exc)

    async def _watch(self) -> None:
        while True:
            await asyncio.sleep(self._tick)
            self._flush_metrics()
            now = time.monotonic()
            if self._retry_soon:
                todo, self._retry_soon = self._retry_soon, []
                for p in todo:
                    if not p.future.done():
                        await self._resend(p, now, "throttled or unavailable", requeue=False)
            order = self._order
            while order:
                p = order[0]
                if p.future.done() or p.reply[self._plen :] not in self._pending:
                    order.popleft()
                    continue
                if p.deadline > now:
                    break
                order.popleft()
                if p.attempts > self._retries:
                    self._fail(p, f"no ack within {self._timeout}s after {p.attempts} attempts", "timeout")
                else:
                    await self._resend(p, now, f"no ack within {self._timeout}s")
