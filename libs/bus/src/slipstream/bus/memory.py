"""The in-memory backend of the bus: one process, no server, the same contract as JetStream.

For unit tests of services and for single-process demos. Every memory Bus with the same `url`
shares one `MemoryBroker`, so a service's publisher and its consumer (or two "replicas") see the
same streams. Messages are encoded, headed and size-checked exactly as for NATS, so a message
that would not survive the wire fails here too.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Mapping
from typing import Any, Generic, TypeVar

import msgspec

from slipstream.bus.base import BusError, DeliverFrom, PublishError
from slipstream.bus.config import BusConfig
from slipstream.bus.consumer import BaseConsumer
from slipstream.bus.delivery import Delivery
from slipstream.bus.envelope import check_size, envelope
from slipstream.bus.fanout import FanoutReader, RawMessage
from slipstream.bus.instruments import (
    CONSUME_MESSAGES,
    PUBLISH_BYTES,
    PUBLISH_DUPLICATES,
    PUBLISH_ERRORS,
    PUBLISH_MESSAGES,
)
from slipstream.bus.memory_broker import MemoryBroker, broker_for
from slipstream.bus.topology import Topology
from slipstream.bus.tracing import producer_span
from slipstream.schemas.dead_letter import DeadLetter
from slipstream.schemas.subjects import ConsumerSpec, StreamSpec, dlq_subject

T = TypeVar("T", bound=msgspec.Struct)
log = logging.getLogger(__name__)


class MemoryConsumer(BaseConsumer[T], Generic[T]):
    def __init__(self, bus: MemoryBus, stream: StreamSpec, spec: ConsumerSpec, cls: type[T]) -> None:
        super().__init__(bus, stream, spec, cls)
        self._memory_bus = bus
        self._broker = bus.broker
        self._batch = bus.cfg.fetch_batch
        self._timeout = bus.cfg.fetch_timeout_s

    async def fetch(self, batch: int | None = None, timeout: float | None = None) -> list[Delivery[T]]:
        if self._memory_bus.closed:
            raise BusError(f"fetch from {self.stream}/{self.durable} failed: the bus is closed")
        await asyncio.sleep(0)  # a busy stream must not starve the rest of the loop
        batch = batch or self._batch
        deadline = time.monotonic() + (timeout or self._timeout)
        while True:
            items = self._broker.take(self.stream, self.durable, batch)
            if items:
                break
            now = time.monotonic()
            if now >= deadline:
                return []
            due = self._broker.next_due(self.stream, self.durable)
            wake_at = deadline if due is None else min(deadline, max(due, now + 0.001))
            await self._broker.wait(wake_at - now)
        out: list[Delivery[T]] = []
        for m, delivered in items:
            got = self._admit(m.data, dict(m.headers), m.subject, delivered, m.seq, m.seq)
            if type(got) is Delivery:
                out.append(got)
            else:
                kind, detail = got  # type: ignore[misc]
                await self._dead_letter(m.data, dict(m.headers), m.subject, delivered, m.seq, m.seq, kind, detail)
        if out:
            CONSUME_MESSAGES.add(len(out), durable=self.durable)
        return out

    async def close(self) -> None:
        return None

    async def _raw_ack(self, handle: int) -> None:
        self._broker.settle(self.stream, self.durable, handle, "ack")

    async def _raw_nak(self, handle: int, delay_s: float) -> None:
        self._broker.settle(self.stream, self.durable, handle, "nak", delay_s)

    async def _raw_term(self, handle: int) -> None:
        self._broker.settle(self.stream, self.durable, handle, "term")

    async def _raw_progress(self, handle: int) -> None:
        self._broker.settle(self.stream, self.durable, handle, "progress")


class _Cursor:
    __slots__ = ("next_seq", "pattern", "stream")

    def __init__(self, stream: str, pattern: str, next_seq: int) -> None:
        self.stream = stream
        self.pattern = pattern
        self.next_seq = next_seq


class MemoryBus:
    """Bus over a process-local MemoryBroker."""

    def __init__(self, cfg: BusConfig, name: str, topology: Topology) -> None:
        self.cfg = cfg
        self.name = name
        self.topology = topology
        self.broker: MemoryBroker = broker_for(cfg.url)
        self.closed = False
        self._failed = 0
        self._first_failure = ""
        self._readers: set[FanoutReader[Any]] = set()

    async def start(self) -> None:
        return None

    @property
    def connected(self) -> bool:
        return not self.closed

    @property
    def max_payload(self) -> int:
        return self.cfg.memory_max_payload

    async def ensure_streams(self) -> None:
        for spec in self.topology.streams.values():
            self.broker.ensure_stream(spec, self.topology.subjects[spec.name])

    def _store(self, subject: str, data: bytes, hdrs: dict[str, str]) -> int:
        if self.closed:
            raise PublishError(f"cannot publish to {subject!r}: the bus is closed")
        try:
            seq, duplicate = self.broker.publish(subject, data, hdrs)
        except PublishError:
            PUBLISH_ERRORS.add(1, reason="no_stream")
            raise
        if duplicate:
            PUBLISH_DUPLICATES.add(1)
        else:
            PUBLISH_MESSAGES.add(1)
            PUBLISH_BYTES.add(len(data))
        return seq

    async def publish(
        self,
        subject: str,
        msg: msgspec.Struct,
        *,
        msg_id: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> int:
        with producer_span(subject):
            data, hdrs = envelope(subject, msg, msg_id, headers, self.max_payload)
            return self._store(subject, data, hdrs)

    async def publish_async(
        self,
        subject: str,
        msg: msgspec.Struct,
        *,
        msg_id: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> asyncio.Future[int]:
        with producer_span(subject):
            data, hdrs = envelope(subject, msg, msg_id, headers, self.max_payload)
        fut: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        try:
            fut.set_result(self._store(subject, data, hdrs))
        except PublishError as exc:
            # Same shape as JetStream: the failure is in the future and reported by flush().
            fut.set_exception(exc)
            fut.exception()
            self._failed += 1
            self._first_failure = self._first_failure or str(exc)
        await asyncio.sleep(0)
        return fut

    async def publish_raw(self, subject: str, data: bytes, headers: dict[str, str]) -> int:
        check_size(subject, data, headers, self.max_payload)
        return self._store(subject, data, headers)

    async def flush(self, timeout: float | None = None) -> None:
        if self._failed:
            n, first = self._failed, self._first_failure
            self._failed, self._first_failure = 0, ""
            raise PublishError(f"{n} publishes failed since the last flush; first: {first}")

    @property
    def in_flight(self) -> tuple[int, int]:
        return 0, 0

    async def consumer(self, durable: str, cls: type[T]) -> MemoryConsumer[T]:
        stream, spec = self.topology.consumer(durable)
        self.broker.ensure_stream(stream, self.topology.subjects[stream.name])
        return MemoryConsumer(self, stream, spec, cls)

    def subscribe(self, subject: str, cls: type[T], *, deliver: DeliverFrom = "new") -> FanoutReader[T]:
        stream = self.topology.stream_of(subject)
        if stream.retention == "workqueue":
            raise BusError(f"{subject!r} is on work-queue stream {stream.name}; use a durable consumer")
        if deliver not in ("new", "last", "all"):
            raise ValueError(f"deliver must be one of ['all', 'last', 'new'], not {deliver!r}")
        broker = self.broker

        async def open_sub() -> _Cursor:
            broker.ensure_stream(stream, self.topology.subjects[stream.name])
            return _Cursor(stream.name, subject, broker.read_from(stream.name, subject, deliver))

        async def next_raw(cur: _Cursor, timeout: float) -> RawMessage | None:
            deadline = time.monotonic() + timeout
            while True:
                m = broker.read(cur.stream, cur.pattern, cur.next_seq)
                if m is not None:
                    cur.next_seq = m.seq + 1
                    return m.data, dict(m.headers), m.subject, m.seq
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return None
                await broker.wait(remaining)

        async def close_sub(cur: _Cursor) -> None:
            return None

        reader = FanoutReader(subject, cls, open_sub, next_raw, close_sub, self._readers.discard)
        self._readers.add(reader)
        return reader

    async def dead_letters(self, stream: str, *, limit: int = 100) -> list[DeadLetter]:
        target = dlq_subject(stream)
        dlq_stream = self.topology.stream_of(target).name
        if dlq_stream not in self.broker.streams:
            return []
        out: list[DeadLetter] = []
        seq = 1
        while len(out) < limit:
            m = self.broker.read(dlq_stream, target, seq)
            if m is None:
                break
            out.append(DeadLetter.from_message(m.data, dict(m.headers)))
            seq = m.seq + 1
        return out

    async def stream_info(self, name: str) -> dict[str, Any]:
        self.topology.stream(name)
        return self.broker.info(name)

    async def stored_sequences(self, name: str) -> list[int]:
        self.topology.stream(name)
        return sorted(self.broker.stream(name).messages)

    async def close(self) -> None:
        if self.closed:
            return
        for reader in list(self._readers):
            await reader.close()
        self.closed = True
        self.broker.wake()
