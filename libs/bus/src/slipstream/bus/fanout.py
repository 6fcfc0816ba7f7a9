"""Fan-out reading: an ordered, ephemeral view of a subject that every subscriber sees in full.

Used for topics like `weights.announce` that every rollout worker must see (a durable pull
consumer would share them out instead). Nothing is acknowledged: settling a fan-out delivery is a
no-op. A message that does not decode cannot be dead-lettered from here (the stream keeps it for
everyone), so it is skipped, counted and logged.

The backend supplies three coroutines: open the ephemeral consumer, read the next raw message
(or None after a timeout), and close it. The reader opens lazily on first iteration, or eagerly
with `await reader.start()` / `async with` so `deliver="new"` starts from that moment.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any, Generic, TypeVar

import msgspec

from slipstream.bus.delivery import Action, Delivery
from slipstream.bus.envelope import schema_of
from slipstream.bus.instruments import CONSUME_ERRORS, CONSUME_MESSAGES
from slipstream.schemas.codec import SCHEMA_HEADER, SchemaError, decode_message

T = TypeVar("T", bound=msgspec.Struct)
RawMessage = tuple[bytes, dict[str, str], str, int]  # data, headers, subject, stream sequence
log = logging.getLogger(__name__)
_POLL_S = 0.5


class _NoSettle:
    async def settle(self, delivery: Delivery[Any], action: Action, delay_s: float) -> None:
        return None

    async def progress(self, delivery: Delivery[Any]) -> None:
        return None


_NO_SETTLE = _NoSettle()


class FanoutReader(Generic[T]):
    """Async iterator of deliveries from an ordered ephemeral consumer."""

    def __init__(
        self,
        subject: str,
        cls: type[T],
        open_: Callable[[], Awaitable[Any]],
        next_raw: Callable[[Any, float], Awaitable[RawMessage | None]],
        close_: Callable[[Any], Awaitable[None]],
        on_close: Callable[[FanoutReader[Any]], None],
    ) -> None:
        self.subject = subject
        self.cls = cls
        self._open = open_
        self._next = next_raw
        self._close = close_
        self._on_close = on_close
        self._own_header = schema_of(cls)
        self._decoder: msgspec.msgpack.Decoder[T] = msgspec.msgpack.Decoder(cls)
        self._handle: Any = None
        self._closed = False
        self.skipped = 0

    async def start(self) -> FanoutReader[T]:
        if self._handle is None and not self._closed:
            self._handle = await self._open()
        return self

    async def __aenter__(self) -> FanoutReader[T]:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def __aiter__(self) -> FanoutReader[T]:
        return self

    async def __anext__(self) -> Delivery[T]:
        await self.start()
        while not self._closed:
            try:
                raw = await self._next(self._handle, _POLL_S)
            except Exception:
                if self._closed:  # closed under a pending read: the backend may complain; we are done
                    break
                raise
            if raw is None or self._closed:
                continue
            data, headers, subject, seq = raw
            try:
                hdr = headers.get(SCHEMA_HEADER)
                if hdr is None or hdr == self._own_header:
                    msg = self._decoder.decode(data)
                else:  # another version, or an older type this one upgrades from
                    msg = decode_message(data, hdr, self.cls)
            except (SchemaError, msgspec.DecodeError, msgspec.ValidationError) as exc:
                self.skipped += 1
                CONSUME_ERRORS.add(1, reason="fanout_undecodable")
                log.warning("skipping undecodable %s seq %d on %s: %s", subject, seq, self.subject, exc)
                continue
            CONSUME_MESSAGES.add(1, durable="fanout")
            return Delivery(msg, subject, headers, data, 1, seq, _NO_SETTLE, None)
        raise StopAsyncIteration

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._handle is not None:
            await self._close(self._handle)
        self._on_close(self)
