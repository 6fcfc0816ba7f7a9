"""An in-process stand-in for a JetStream server: streams, dedup, and durable pull consumers.

It keeps the semantics services rely on, so their unit tests mean something: a work-queue
message is removed once acked or terminated; a nak or an expired ack wait makes it deliverable
again (after the nak delay), counting deliveries; a consumer stops delivering a message after
its max_deliver and never has more than max_ack_pending unacked; a `Nats-Msg-Id` seen within the
duplicate window returns the first message's sequence. Limits streams keep every message (up to
max_age) and give each durable its own cursor. All state lives in one event loop's thread.
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from dataclasses import dataclass, field

from slipstream.bus.base import BusError, PublishError
from slipstream.bus.envelope import MSG_ID_HEADER
from slipstream.bus.topology import server_max_deliver
from slipstream.schemas.subjects import ConsumerSpec, StreamSpec


def subject_matches(pattern: str, subject: str) -> bool:
    p, s = pattern.split("."), subject.split(".")
    for i, tok in enumerate(p):
        if tok == ">":
            return len(s) > i
        if i >= len(s) or (tok != "*" and tok != s[i]):
            return False
    return len(p) == len(s)


@dataclass(slots=True)
class Stored:
    seq: int
    subject: str
    data: bytes
    headers: dict[str, str]
    time: float


@dataclass
class ConsumerState:
    spec: ConsumerSpec
    cursor: int = 0  # highest stream sequence considered for a first delivery
    inflight: dict[int, float] = field(default_factory=dict)  # seq -> ack deadline
    redeliver: dict[int, float] = field(default_factory=dict)  # seq -> not before
    deliveries: dict[int, int] = field(default_factory=dict)  # seq -> times delivered
    redelivered: int = 0

    @property
    def max_deliver(self) -> int:
        return server_max_deliver(self.spec)


@dataclass
class StreamState:
    spec: StreamSpec
    subjects: list[str]
    messages: dict[int, Stored] = field(default_factory=dict)
    last_seq: int = 0
    dedup: OrderedDict[str, tuple[int, float]] = field(default_factory=OrderedDict)
    consumers: dict[str, ConsumerState] = field(default_factory=dict)

    def captures(self, subject: str) -> bool:
        return any(subject_matches(p, subject) for p in self.subjects)


class MemoryBroker:
    """Streams and consumers shared by every memory Bus with the same URL in this process."""

    def __init__(self) -> None:
        self.streams: dict[str, StreamState] = {}
        self._waiters: list[asyncio.Future[None]] = []

    # -- provisioning -------------------------------------------------------------------------
    def ensure_stream(self, spec: StreamSpec, subjects: list[str]) -> None:
        st = self.streams.get(spec.name)
        if st is None:
            for other in self.streams.values():
                overlap = [p for p in subjects if p in other.subjects]
                if overlap:
                    raise BusError(f"subjects {overlap} of {spec.name} overlap stream {other.spec.name}")
            st = self.streams[spec.name] = StreamState(spec, list(subjects))
        else:
            if st.spec.retention != spec.retention:
                raise BusError(f"stream {spec.name} exists with retention {st.spec.retention}, not {spec.retention}")
            st.spec, st.subjects = spec, list(subjects)
        for c in spec.consumers:
            cs = st.consumers.get(c.durable)
            if cs is None:
                st.consumers[c.durable] = ConsumerState(c)
            else:
                cs.spec = c

    def stream(self, name: str) -> StreamState:
        try:
            return self.streams[name]
        except KeyError:
            raise BusError(f"stream {name!r} does not exist (did ensure_streams run?)") from None

    # -- publishing ---------------------------------------------------------------------------
    def publish(self, subject: str, data: bytes, headers: dict[str, str]) -> tuple[int, bool]:
        """Store one message; (sequence, duplicate)."""
        st = next((s for s in self.streams.values() if s.captures(subject)), None)
        if st is None:
            raise PublishError(f"publish to {subject!r} failed: no stream captures this subject")
        now = time.monotonic()
        window = st.spec.duplicate_window_s
        while st.dedup:
            oldest = next(iter(st.dedup.values()))
            if now - oldest[1] <= window:
                break
            st.dedup.popitem(last=False)
        msg_id = headers.get(MSG_ID_HEADER)
        if msg_id is not None and msg_id in st.dedup:
            return st.dedup[msg_id][0], True
        self._expire(st, now)
        st.last_seq += 1
        st.messages[st.last_seq] = Stored(st.last_seq, subject, data, dict(headers), now)
        if msg_id is not None:
            st.dedup[msg_id] = (st.last_seq, now)
        self.wake()
        return st.last_seq, False

    def _expire(self, st: StreamState, now: float) -> None:
        if st.spec.max_age_s <= 0:
            return
        for seq in [s for s, m in st.messages.items() if now - m.time > st.spec.max_age_s]:
            del st.messages[seq]

    # -- consuming ----------------------------------------------------------------------------
    def take(self, stream: str, durable: str, batch: int) -> list[tuple[Stored, int]]:
        """Up to `batch` deliverable messages for a durable, redeliveries first."""
        st = self.stream(stream)
        c = st.consumers[durable]
        now = time.monotonic()
        for seq, deadline in list(c.inflight.items()):
            if deadline <= now:
                del c.inflight[seq]
                c.redeliver[seq] = now
        out: list[tuple[Stored, int]] = []
        limit = c.spec.max_ack_pending
        for seq in sorted(c.redeliver):
            if len(out) >= batch or len(c.inflight) >= limit:
                return out
            if c.redeliver[seq] > now:
                continue
            del c.redeliver[seq]
            m = st.messages.get(seq)
            n = c.deliveries.get(seq, 0)
            if m is None or (c.max_deliver > 0 and n >= c.max_deliver):
                # Gone, or out of deliveries: like JetStream, it stays in the stream undelivered.
                c.deliveries.pop(seq, None)
                continue
            c.deliveries[seq] = n + 1
            c.redelivered += 1
            c.inflight[seq] = now + c.spec.ack_wait_s
            out.append((m, n + 1))
        while len(out) < batch and len(c.inflight) < limit and c.cursor < st.last_seq:
            c.cursor += 1
            m = st.messages.get(c.cursor)
            if m is None or not subject_matches(c.spec.filter_subject, m.subject):
                continue
            c.deliveries[m.seq] = 1
            c.inflight[m.seq] = now + c.spec.ack_wait_s
            out.append((m, 1))
        return out

    def next_due(self, stream: str, durable: str) -> float | None:
        """Monotonic time at which a nak'd or unacked message becomes deliverable again."""
        c = self.stream(stream).consumers[durable]
        times = list(c.inflight.values()) + list(c.redeliver.values())
        return min(times) if times else None

    def settle(self, stream: str, durable: str, seq: int, action: str, delay_s: float = 0.0) -> None:
        st = self.stream(stream)
        c = st.consumers[durable]
        now = time.monotonic()
        if action == "progress":
            if seq in c.inflight:
                c.inflight[seq] = now + c.spec.ack_wait_s
            return
        if action == "nak":
            if c.inflight.pop(seq, None) is not None:
                c.redeliver[seq] = now + max(0.0, delay_s)
                self.wake()
            return
        # ack / term: done for this consumer
        c.inflight.pop(seq, None)
        c.redeliver.pop(seq, None)
        c.deliveries.pop(seq, None)
        if st.spec.retention == "workqueue" or (st.spec.retention == "interest" and self._all_done(st, seq)):
            st.messages.pop(seq, None)

    @staticmethod
    def _all_done(st: StreamState, seq: int) -> bool:
        return all(seq <= o.cursor and seq not in o.inflight and seq not in o.redeliver for o in st.consumers.values())

    def read_from(self, stream: str, pattern: str, deliver: str) -> int:
        """First sequence an ordered reader of `pattern` sees for deliver = new | last | all."""
        st = self.stream(stream)
        if deliver == "all":
            return 1
        if deliver == "last":
            for seq in sorted(st.messages, reverse=True):
                if subject_matches(pattern, st.messages[seq].subject):
                    return seq
        return st.last_seq + 1

    def read(self, stream: str, pattern: str, start: int) -> Stored | None:
        st = self.stream(stream)
        for seq in range(start, st.last_seq + 1):
            m = st.messages.get(seq)
            if m is not None and subject_matches(pattern, m.subject):
                return m
        return None

    def info(self, name: str) -> dict[str, object]:
        st = self.stream(name)
        consumers = {}
        for durable, c in st.consumers.items():
            pending = sum(
                1
                for seq, m in st.messages.items()
                if seq > c.cursor and subject_matches(c.spec.filter_subject, m.subject)
            )
            consumers[durable] = {
                "num_pending": pending,
                "num_ack_pending": len(c.inflight) + len(c.redeliver),
                "num_redelivered": c.redelivered,
                "num_waiting": 0,
            }
        seqs = list(st.messages)
        return {
            "name": name,
            "leader": "",  # one process: no cluster, as on a single nats-server
            "replicas": {},
            "messages": len(st.messages),
            "bytes": sum(len(m.data) for m in st.messages.values()),
            "first_seq": min(seqs) if seqs else st.last_seq + 1,
            "last_seq": st.last_seq,
            "consumer_count": len(st.consumers),
            "consumers": consumers,
        }

    # -- waiting ------------------------------------------------------------------------------
    def wake(self) -> None:
        waiters, self._waiters = self._waiters, []
        for w in waiters:
            if not w.done():
                w.set_result(None)

    async def wait(self, timeout: float) -> None:
        """Sleep until something is published or nak'd, or `timeout` passes."""
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append(fut)
        try:
            await asyncio.wait_for(fut, max(0.0, timeout))
        except TimeoutError:
            pass
        finally:
            if fut in self._waiters:
                self._waiters.remove(fut)


_BROKERS: dict[str, MemoryBroker] = {}


def broker_for(url: str) -> MemoryBroker:
    """The process-wide broker for a URL: buses configured alike see the same streams."""
    found = _BROKERS.get(url)
    if found is None:
        found = _BROKERS[url] = MemoryBroker()
    return found


def reset_brokers() -> None:
    """Forget every memory stream (tests that share a URL call this between cases)."""
    _BROKERS.clear()
