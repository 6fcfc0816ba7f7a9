"""The NATS JetStream backend of the bus (nats-py 2.16).

One connection per Bus, reconnecting forever once it was up; the first connection is retried for
`connect_budget_s` and then reported as `BusUnavailable`. Publishing goes through
`JetStreamPublisher` (bounded in-flight, acks with timeouts); consuming binds a pull subscription
to the shared durable named in the subject table; fan-out subjects are read through ordered
ephemeral consumers, each created under a fresh name of this user's (`permissions.fanout_name`)
through the named, filtered create: the only create a service's NATS user is granted.
"""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import Mapping
from typing import Any, Generic, TypeVar

import msgspec
import nats.errors
import nats.js.errors
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.api import ConsumerConfig, DeliverPolicy

from slipstream.bus.base import BusError, BusUnavailable, DeliverFrom, PublishError
from slipstream.bus.config import BusConfig
from slipstream.bus.consumer import BaseConsumer
from slipstream.bus.delivery import Delivery
from slipstream.bus.envelope import check_size, envelope
from slipstream.bus.fanout import FanoutReader, RawMessage
from slipstream.bus.instruments import CONSUME_MESSAGES, CONSUME_PENDING, DENIED, DISCONNECTS, RECONNECTS
from slipstream.bus.permissions import ADMIN, fanout_name
from slipstream.bus.provisioning import ensure_all, ensure_stream
from slipstream.bus.publisher import JetStreamPublisher
from slipstream.bus.pull import PullFetcher
from slipstream.bus.topology import Topology
from slipstream.bus.tracing import producer_span, tracing_active
from slipstream.schemas.dead_letter import DeadLetter
from slipstream.schemas.subjects import ConsumerSpec, StreamSpec, dlq_subject

T = TypeVar("T", bound=msgspec.Struct)
log = logging.getLogger(__name__)

_ACK = b""
_NAK = b"-NAK"
_TERM = b"+TERM"
_PROGRESS = b"+WPI"
_DELIVER = {"new": DeliverPolicy.NEW, "last": DeliverPolicy.LAST, "all": DeliverPolicy.ALL}
STREAM_INFO_WAIT_S = 15.0  # how long stream_info waits out a cluster election (503) before giving up


_VIOLATION = re.compile(r"permissions violation for (publish|subscription) to \"?([^\"']+)", re.IGNORECASE)


def permission_violation(exc: BaseException) -> tuple[str, str] | None:
    """("publish" | "subscribe", subject) when `exc` is the server refusing an operation, else None.

    The subject comes back lower-cased (nats-py lower-cases the server's error line).
    """
    m = _VIOLATION.search(str(exc))
    if m is None:
        return None
    op = "publish" if m.group(1).lower() == "publish" else "subscribe"
    return op, m.group(2).strip().split(" ")[0]


def _pending(reply: str) -> int:
    """Messages still to be delivered to the consumer after this one, from its ack subject (v1 or v2 form)."""
    tokens = reply.split(".")
    return int(tokens[8] if len(tokens) == 9 else tokens[10])


def _ack_fields(reply: str) -> tuple[int, int]:
    """(num_delivered, stream sequence) from a JetStream ack subject, v1 or v2 (domain) form."""
    tokens = reply.split(".")
    if len(tokens) == 9:  # $JS.ACK.<stream>.<consumer>.<delivered>.<sseq>.<cseq>.<ts>.<pending>
        return int(tokens[4]), int(tokens[5])
    return int(tokens[6]), int(tokens[7])  # $JS.ACK.<domain>.<hash>.<stream>.<consumer>.<delivered>.<sseq>...


class JetStreamConsumer(BaseConsumer[T], Generic[T]):
    """A pull subscription bound to a shared durable."""

    def __init__(
        self,
        bus: NatsBus,
        stream: StreamSpec,
        spec: ConsumerSpec,
        cls: type[T],
        fetcher: PullFetcher,
    ) -> None:
        super().__init__(bus, stream, spec, cls)
        self._nc = bus.nc
        self._fetcher = fetcher
        self._bus_consumers = bus._consumers
        self._batch = bus.cfg.fetch_batch
        self._timeout = bus.cfg.fetch_timeout_s
        self._one_fetch = asyncio.Lock()  # the fetcher reads one inbox: one request at a time

    async def fetch(self, batch: int | None = None, timeout: float | None = None) -> list[Delivery[T]]:
        """Up to `batch` deliveries; an empty list when nothing came within `timeout`."""
        try:
            async with self._one_fetch:
                msgs = await self._fetcher.fetch(batch or self._batch, timeout or self._timeout)
        except nats.errors.Error as exc:  # closed or draining connection
            raise BusError(f"fetch from {self.stream}/{self.durable} failed: {exc!r}") from exc
        out: list[Delivery[T]] = []
        rejected: list[tuple[Msg, int, int, Any]] = []
        admit = self._admit
        for m in msgs:
            delivered, seq = _ack_fields(m.reply)
            got = admit(m.data, m.headers or {}, m.subject, delivered, seq, m)
            if type(got) is Delivery:
                out.append(got)
            else:
                rejected.append((m, delivered, seq, got))
        for m, delivered, seq, (kind, detail) in rejected:
            await self._dead_letter(m.data, m.headers or {}, m.subject, delivered, seq, m, kind, detail)
        if out:
            CONSUME_MESSAGES.add(len(out), durable=self.durable)
        if msgs:
            # Free: the server stamps every delivery with the consumer's backlog behind it. An
            # empty fetch says nothing (at max_ack_pending the server delivers nothing either).
            CONSUME_PENDING.set(_pending(msgs[-1].reply), durable=self.durable)
        return out

    async def close(self) -> None:
        self._bus_consumers.discard(self)
        await self._fetcher.close()

    async def _raw_ack(self, handle: Msg) -> None:
        await self._nc.publish(handle.reply, _ACK)

    async def _raw_nak(self, handle: Msg, delay_s: float) -> None:
        payload = _NAK if delay_s <= 0 else _NAK + b' {"delay": %d}' % int(delay_s * 1e9)
        await self._nc.publish(handle.reply, payload)

    async def _raw_term(self, handle: Msg) -> None:
        await self._nc.publish(handle.reply, _TERM)

    async def _raw_progress(self, handle: Msg) -> None:
        await self._nc.publish(handle.reply, _PROGRESS)


def _rename_on_recreate(psub: Any, owner: str) -> None:
    """Make nats-py recreate this ordered consumer under a fresh name after a gap or missed heartbeats.

    nats-py 2.16 recreates an ordered consumer from its original request (`_JSI._ccreq`), name
    included; with a name that is an update of the consumer it replaces, which the server
    refuses while that one still exists (it lingers for its inactive threshold). The Go client
    names each recreation afresh; this does the same before nats-py's own `recreate_consumer`.
    """
    jsi = getattr(getattr(psub, "_sub", None), "_jsi", None)
    recreate = getattr(jsi, "recreate_consumer", None)
    if jsi is None or recreate is None or not hasattr(jsi, "_ccreq"):
        raise BusError(
            "this nats-py has no ordered-consumer state where 2.16 keeps it (_sub._jsi): fan-out readers "
            "could not be recreated under a new name; pin nats-py 2.16 (tools/constraints.txt)"
        )

    async def recreate_renamed() -> None:
        jsi._ccreq.name = fanout_name(owner)
        await recreate()

    jsi.recreate_consumer = recreate_renamed


class NatsBus:
    """Bus over NATS JetStream."""

    def __init__(self, cfg: BusConfig, name: str, topology: Topology) -> None:
        self.cfg = cfg
        self.name = name
        self.topology = topology
        self.nc = Client()
        self._js: JetStreamContext | None = None
        self._publisher: JetStreamPublisher | None = None
        self._connected = False
        self._closed = False
        self._readers: set[FanoutReader[Any]] = set()
        self._consumers: set[JetStreamConsumer[Any]] = set()

    # -- connection ---------------------------------------------------------------------------
    async def start(self) -> None:
        servers = [u.strip() for u in self.cfg.url.split(",") if u.strip()]
        auth = self.cfg.nats_options()
        try:
            await asyncio.wait_for(
                self.nc.connect(
                    servers=servers,
                    name=self.name,
                    **auth,
                    connect_timeout=self.cfg.connect_timeout_s,  # type: ignore[arg-type]  # floats work
                    reconnect_time_wait=self.cfg.reconnect_wait_s,  # type: ignore[arg-type]
                    ping_interval=self.cfg.ping_interval_s,  # type: ignore[arg-type]
                    max_outstanding_pings=self.cfg.max_outstanding_pings,
                    max_reconnect_attempts=-1,
                    allow_reconnect=True,
                    drain_timeout=self.cfg.drain_timeout_s,  # type: ignore[arg-type]
                    disconnected_cb=self._on_disconnected,
                    reconnected_cb=self._on_reconnected,
                    error_cb=self._on_error,
                    closed_cb=self._on_closed,
                ),
                self.cfg.connect_budget_s,
            )
        except (TimeoutError, OSError, nats.errors.Error) as exc:
            try:
                await self.nc.close()
            except nats.errors.Error as close_exc:
                log.debug("close after a failed connect: %r", close_exc)
            who = f" as user {self.cfg.user!r}" if self.cfg.user else " without credentials"
            raise BusUnavailable(
                f"cannot connect to NATS at {self.cfg.url}{who} within {self.cfg.connect_budget_s:.0f}s ({exc!r})"
            ) from exc
        self._connected = True
        self._js = self.nc.jetstream()
        self._publisher = JetStreamPublisher(self.nc, self.cfg)
        await self._publisher.start()
        log.info("bus %s connected to %s", self.name, self.nc.connected_url.netloc if self.nc.connected_url else "")

    async def _on_disconnected(self) -> None:
        if self._connected and not self._closed:
            DISCONNECTS.add(1)
            log.warning("bus %s lost its NATS connection; reconnecting", self.name)
        self._connected = False

    async def _on_reconnected(self) -> None:
        self._connected = True
        RECONNECTS.add(1)
        log.warning("bus %s reconnected to NATS", self.name)
        if self._publisher is not None:
            self._publisher.on_reconnected()

    async def _on_error(self, exc: Exception) -> None:
        denied = permission_violation(exc)
        if denied is not None:
            op, subject = denied
            DENIED.add(1, op=op)
            log.error(
                "bus %s: the server refused to let user %r %s %r (not in its permissions)",
                self.name, self.cfg.user or "(none)", op, subject,
            )  # fmt: skip
            if op == "publish" and self._publisher is not None:
                self._publisher.on_denied(subject)
            return
        log.warning("bus %s: NATS error %r", self.name, exc)

    async def _on_closed(self) -> None:
        self._connected = False

    @property
    def connected(self) -> bool:
        return self._connected and self.nc.is_connected

    @property
    def max_payload(self) -> int:
        return self.nc.max_payload

    @property
    def js(self) -> JetStreamContext:
        if self._js is None:
            raise BusError("the bus is not started")
        return self._js

    @property
    def publisher(self) -> JetStreamPublisher:
        if self._publisher is None:
            raise BusError("the bus is not started")
        return self._publisher

    # -- provisioning ---------------------------------------------------------------------------
    @property
    def may_provision(self) -> bool:
        """Whether this connection may create and update streams (no user, or the admin user)."""
        return not self.cfg.user or self.cfg.user == ADMIN

    async def ensure_streams(self) -> None:
        await ensure_all(self.js, self.topology, self.cfg, admin=self.may_provision)

    # -- publishing -----------------------------------------------------------------------------
    async def publish(
        self,
        subject: str,
        msg: msgspec.Struct,
        *,
        msg_id: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> int:
        with producer_span(subject):
            data, hdrs = envelope(subject, msg, msg_id, headers, self.nc.max_payload)
            return await self.publisher.publish(subject, data, hdrs)

    async def publish_async(
        self,
        subject: str,
        msg: msgspec.Struct,
        *,
        msg_id: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> asyncio.Future[int]:
        if tracing_active():
            with producer_span(subject):
                data, hdrs = envelope(subject, msg, msg_id, headers, self.nc.max_payload)
                return await self.publisher.send(subject, data, hdrs)
        data, hdrs = envelope(subject, msg, msg_id, headers, self.nc.max_payload)
        return await self.publisher.send(subject, data, hdrs)

    async def publish_raw(self, subject: str, data: bytes, headers: dict[str, str]) -> int:
        check_size(subject, data, headers, self.nc.max_payload)
        return await self.publisher.publish(subject, data, headers)

    async def flush(self, timeout: float | None = None) -> None:
        await self.publisher.flush(timeout)

    @property
    def in_flight(self) -> tuple[int, int]:
        """(messages, bytes) published and not yet acknowledged."""
        return self.publisher.in_flight

    # -- consuming ------------------------------------------------------------------------------
    async def consumer(self, durable: str, cls: type[T]) -> JetStreamConsumer[T]:
        stream, spec = self.topology.consumer(durable)
        await ensure_stream(self.js, stream, self.topology.subjects[stream.name], self.cfg, admin=self.may_provision)
        fetcher = PullFetcher(self.nc, stream.name, durable)
        await fetcher.start()
        consumer = JetStreamConsumer(self, stream, spec, cls, fetcher)
        self._consumers.add(consumer)
        return consumer

    def _ordered(self, subject: str, stream: str, deliver: DeliverFrom) -> tuple[Any, Any, Any]:
        """open / next / close coroutines of an ordered ephemeral consumer on `subject`."""

        owner = self.cfg.user

        async def open_sub() -> Any:
            config = ConsumerConfig(name=fanout_name(owner))
            psub = await self.js.subscribe(
                subject, stream=stream, ordered_consumer=True, deliver_policy=_DELIVER[deliver], config=config
            )
            _rename_on_recreate(psub, owner)
            return psub

        async def next_raw(psub: Any, timeout: float) -> RawMessage | None:
            try:
                m = await psub.next_msg(timeout=timeout)
            except TimeoutError:  # nats-py raises both its own and asyncio's
                return None
            return m.data, m.headers or {}, m.subject, _ack_fields(m.reply)[1]

        async def close_sub(psub: Any) -> None:
            try:
                await psub.unsubscribe()
            except (nats.errors.Error, ValueError) as exc:
                log.debug("unsubscribe of %s failed: %r", subject, exc)

        return open_sub, next_raw, close_sub

    def subscribe(self, subject: str, cls: type[T], *, deliver: DeliverFrom = "new") -> FanoutReader[T]:
        stream = self.topology.stream_of(subject)
        if stream.retention == "workqueue":
            raise BusError(f"{subject!r} is on work-queue stream {stream.name}; use a durable consumer")
        if deliver not in _DELIVER:
            raise ValueError(f"deliver must be one of {sorted(_DELIVER)}, not {deliver!r}")
        open_sub, next_raw, close_sub = self._ordered(subject, stream.name, deliver)
        reader = FanoutReader(subject, cls, open_sub, next_raw, close_sub, self._readers.discard)
        self._readers.add(reader)
        return reader

    async def dead_letters(self, stream: str, *, limit: int = 100) -> list[DeadLetter]:
        """The oldest `limit` dead letters of `stream` (read-only: they stay in the DLQ)."""
        target = dlq_subject(stream)
        dlq_stream = self.topology.stream_of(target).name
        try:
            info = await self.js.stream_info(dlq_stream, subjects_filter=target)
        except nats.js.errors.NotFoundError:
            return []
        count = min(limit, (info.state.subjects or {}).get(target, 0))
        if count == 0:
            return []
        open_sub, next_raw, close_sub = self._ordered(target, dlq_stream, "all")
        psub = await open_sub()
        out: list[DeadLetter] = []
        try:
            while len(out) < count:
                raw = await next_raw(psub, 2.0)
                if raw is None:
                    break
                out.append(DeadLetter.from_message(raw[0], raw[1]))
        finally:
            await close_sub(psub)
        return out

    # -- inspection and shutdown ----------------------------------------------------------------
    async def stream_info(self, name: str) -> dict[str, Any]:
        # A clustered JetStream answers 503 ("temporarily unavailable") while its meta group elects a
        # leader (a node killed or cut off, a partition healing): an inspection waits that out, as
        # publishing and pulling do, for up to STREAM_INFO_WAIT_S.
        deadline = asyncio.get_running_loop().time() + STREAM_INFO_WAIT_S
        while True:
            try:
                si = await self.js.stream_info(name)
                infos = await self.js.consumers_info(name)
                break
            except nats.js.errors.NotFoundError as exc:
                raise BusError(f"stream {name!r} does not exist on {self.cfg.url}") from exc
            except nats.js.errors.ServiceUnavailableError as exc:
                if asyncio.get_running_loop().time() > deadline:
                    raise BusError(
                        f"stream {name!r}: JetStream still unavailable after {STREAM_INFO_WAIT_S:.0f} s "
                        f"on {self.cfg.url}"
                    ) from exc
                await asyncio.sleep(0.25)
        st = si.state
        cluster = si.cluster
        return {
            "name": name,
            # Clustered JetStream: the node leading the stream and each replica's state ({} on one node).
            "leader": (cluster.leader or "") if cluster is not None else "",
            "replicas": {
                p.name: {"current": bool(p.current), "offline": bool(p.offline), "lag": p.lag or 0}
                for p in ((cluster.replicas or []) if cluster is not None else [])
            },
            "messages": st.messages,
            "bytes": st.bytes,
            "first_seq": st.first_seq,
            "last_seq": st.last_seq,
            "consumer_count": st.consumer_count,
            "consumers": {
                c.name: {
                    "num_pending": c.num_pending or 0,
                    "num_ack_pending": c.num_ack_pending or 0,
                    "num_redelivered": c.num_redelivered or 0,
                    "num_waiting": c.num_waiting or 0,
                }
                for c in infos
            },
        }

    async def stored_sequences(self, name: str) -> list[int]:
        # The stream's info with its deleted sequences (nats-py's stream_info does not ask for them):
        # what is stored is first_seq..last_seq less those.
        reply = await self.nc.request(
            f"$JS.API.STREAM.INFO.{name}",
            msgspec.json.encode({"deleted_details": True}),
            timeout=self.cfg.ack_timeout_s,
        )
        body = msgspec.json.decode(reply.data)
        if "error" in body:
            raise BusError(f"stream {name!r} on {self.cfg.url}: {body['error'].get('description', body['error'])}")
        state = body["state"]
        if not state.get("messages"):
            return []
        deleted = set(state.get("deleted") or ())
        return [s for s in range(int(state["first_seq"]), int(state["last_seq"]) + 1) if s not in deleted]

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        timeout = self.cfg.drain_timeout_s
        if self._publisher is not None:
            try:
                await self._publisher.flush(timeout)
            except PublishError as exc:
                log.warning("bus %s closing with unacknowledged publishes: %s", self.name, exc)
            await self._publisher.close()
        for reader in list(self._readers):
            await reader.close()
        # Unsubscribe pull inboxes rather than drain them: nothing more is wanted from them.
        for consumer in list(self._consumers):
            await consumer.close()
        try:
            if not self.nc.is_closed:
                await asyncio.wait_for(self.nc.drain(), timeout + 1.0)
        except (TimeoutError, OSError, nats.errors.Error) as exc:  # a broken socket raises OSError
            log.warning("bus %s: drain did not finish (%r); closing", self.name, exc)
        finally:
            # Even when the drain raised or this close was cancelled: a client left open is a
            # socket that outlives its event loop (an asyncio.run) and is collected unclosed.
            if not self.nc.is_closed:
                await self.nc.close()
            self._connected = False
