"""What every backend's durable consumer shares: admitting a fetched message, and settling it.

A fetched message is admitted (decoded into the consumer's type) or rejected to the DLQ when it
does not decode, when its `Slipstream-Schema` header names another type or a newer version, or
when it has used up its deliveries. A nak on the last allowed delivery dead-letters instead of
asking for a redelivery that would never come. The backends only supply the raw operations.
"""

from __future__ import annotations

import logging
from typing import Any, Generic, Protocol, TypeVar

import msgspec

from slipstream.bus import dlq
from slipstream.bus.base import PublishError
from slipstream.bus.delivery import Action, Delivery
from slipstream.bus.envelope import schema_of
from slipstream.bus.instruments import DLQ_ERRORS
from slipstream.schemas.codec import SCHEMA_HEADER, SchemaError, check_header, decode, upgrade_for
from slipstream.schemas.subjects import ConsumerSpec, StreamSpec

T = TypeVar("T", bound=msgspec.Struct)
# A dead letter that could not be published is retried after this pause (on the spare delivery).
DLQ_RETRY_DELAY_S = 5.0
log = logging.getLogger(__name__)


class RawPublisher(Protocol):
    @property
    def max_payload(self) -> int: ...

    async def publish_raw(self, subject: str, data: bytes, headers: dict[str, str]) -> int: ...


class BaseConsumer(Generic[T]):
    """Admission, dead-lettering and settlement on top of a backend's raw ack/nak/term/progress."""

    def __init__(self, bus: RawPublisher, stream: StreamSpec, spec: ConsumerSpec, cls: type[T]) -> None:
        self.durable = spec.durable
        self.stream = stream.name
        self.spec = spec
        self.cls = cls
        self.max_deliver = spec.max_deliver
        self._bus = bus
        self._own_header = schema_of(cls)
        self._decoder: msgspec.msgpack.Decoder[T] = msgspec.msgpack.Decoder(cls)

    # -- raw operations, per backend ------------------------------------------------------------
    async def _raw_ack(self, handle: Any) -> None:
        raise NotImplementedError

    async def _raw_nak(self, handle: Any, delay_s: float) -> None:
        raise NotImplementedError

    async def _raw_term(self, handle: Any) -> None:
        raise NotImplementedError

    async def _raw_progress(self, handle: Any) -> None:
        raise NotImplementedError

    # -- admission ------------------------------------------------------------------------------
    def _admit(
        self, data: bytes, headers: dict[str, str], subject: str, delivered: int, seq: int, handle: Any
    ) -> Delivery[T] | tuple[dlq.ReasonKind, str]:
        """A Delivery, or the reason this message must go to the DLQ."""
        if 0 < self.max_deliver < delivered:
            return "max_deliveries", f"delivered {delivered} times; max_deliver is {self.max_deliver}"
        hdr = headers.get(SCHEMA_HEADER)
        if hdr is not None and hdr != self._own_header:
            # Another version of this type, or an older type it upgrades from (codec.UPGRADES).
            try:
                up = upgrade_for(hdr, self.cls)
                if up is None:
                    check_header(hdr, self.cls)
            except SchemaError as exc:
                return "schema", str(exc)
            if up is not None:
                try:
                    msg = up[1](decode(data, up[0]))
                except SchemaError as exc:
                    return "decode", str(exc)
                return Delivery(msg, subject, headers, data, delivered, seq, self, handle)
        try:
            msg = self._decoder.decode(data)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            return "decode", f"cannot decode {self.cls.__name__}: {exc}"
        return Delivery(msg, subject, headers, data, delivered, seq, self, handle)

    async def _dead_letter(
        self,
        data: bytes,
        headers: dict[str, str],
        subject: str,
        delivered: int,
        seq: int,
        handle: Any,
        kind: dlq.ReasonKind,
        detail: str,
    ) -> bool:
        """Publish to dlq.<STREAM>, then term the source. On failure, leave it for a redelivery.

        A message that fits the bus but not with the DLQ headers is dead-lettered with its body
        cut, the cut recorded in headers (`dlq.fit`): never left to be retried forever.
        """

        def dlq_headers(original: dict[str, str] | None) -> dict[str, str]:
            return dlq.dead_letter_headers(
                original,
                kind=kind,
                detail=detail,
                subject=subject,
                stream=self.stream,
                consumer=self.durable,
                deliveries=delivered,
                sequence=seq,
            )

        body, hdrs, cut = dlq.fit(data, dlq_headers(headers), dlq_headers(None), self._bus.max_payload)
        target = dlq.target(self.stream)
        try:
            await self._bus.publish_raw(target, body, hdrs)
        except PublishError as exc:
            DLQ_ERRORS.add(1, stream=self.stream)
            log.error("cannot dead-letter %s seq %d to %s (%s); left for redelivery", subject, seq, target, exc)
            await self._raw_nak(handle, DLQ_RETRY_DELAY_S)
            return False
        await self._raw_term(handle)
        dlq.count(self.stream, kind, subject, seq, detail, cut)
        return True

    # -- settlement (called by Delivery) --------------------------------------------------------
    async def settle(self, delivery: Delivery[Any], action: Action, delay_s: float) -> None:
        if action == "ack":
            await self._raw_ack(delivery._handle)
        elif action == "term":
            await self._raw_term(delivery._handle)
        elif action == "release":
            await self._raw_nak(delivery._handle, 0.0)
        elif 0 < self.max_deliver <= delivery.num_delivered:
            await self._dead_letter(
                delivery.data,
                delivery.headers,
                delivery.subject,
                delivery.num_delivered,
                delivery.stream_seq,
                delivery._handle,
                "max_deliveries",
                f"not processed after {delivery.num_delivered} deliveries (max_deliver {self.max_deliver})",
            )
        else:
            await self._raw_nak(delivery._handle, delay_s)

    async def progress(self, delivery: Delivery[Any]) -> None:
        await self._raw_progress(delivery._handle)
