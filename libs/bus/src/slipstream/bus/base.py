"""The bus boundary: the protocols every backend implements and the errors it raises.

Services type against `Bus`, `Consumer` and `Subscription`; `connect_bus` picks the JetStream or
the in-memory implementation from `[bus] type`. One contract suite (tests/contract/test_bus.py)
holds both to the same behaviour.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Mapping
from typing import Any, Literal, Protocol, TypeVar

import msgspec

from slipstream.bus.delivery import Delivery
from slipstream.schemas.dead_letter import DeadLetter

T = TypeVar("T", bound=msgspec.Struct)
DeliverFrom = Literal["new", "last", "all"]


class BusError(Exception):
    """Base class of everything the bus raises on purpose."""


class BusUnavailable(BusError):
    """The first connection to the server could not be made within the connect budget."""


class PublishError(BusError):
    """A publish was not acknowledged by the stream (no stream, server error, or acks lost past the retries)."""


class PayloadTooLarge(PublishError):
    """The message is bigger than the server accepts; refused before anything was sent."""


class Consumer(Protocol[T]):
    """A shared durable pull consumer: every replica of a service binds to the same one."""

    durable: str
    stream: str

    async def fetch(self, batch: int | None = None, timeout: float | None = None) -> list[Delivery[T]]: ...

    async def close(self) -> None: ...


class Subscription(Protocol[T]):
    """An ordered, ephemeral view of a fan-out subject; every subscriber sees every message."""

    def __aiter__(self) -> AsyncIterator[Delivery[T]]: ...

    async def __anext__(self) -> Delivery[T]: ...

    async def close(self) -> None: ...


class Bus(Protocol):
    """What services use to move messages. See the package docstring for semantics."""

    @property
    def connected(self) -> bool: ...

    @property
    def max_payload(self) -> int: ...

    async def ensure_streams(self) -> None: ...

    async def publish(
        self,
        subject: str,
        msg: msgspec.Struct,
        *,
        msg_id: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> int: ...

    async def publish_async(
        self,
        subject: str,
        msg: msgspec.Struct,
        *,
        msg_id: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> asyncio.Future[int]: ...

    async def publish_raw(self, subject: str, data: bytes, headers: dict[str, str]) -> int: ...

    async def flush(self, timeout: float | None = None) -> None: ...

    @property
    def in_flight(self) -> tuple[int, int]: ...

    async def consumer(self, durable: str, cls: type[T]) -> Consumer[T]: ...

    def subscribe(self, subject: str, cls: type[T], *, deliver: DeliverFrom = "new") -> Subscription[T]: ...

    async def stream_info(self, name: str) -> dict[str, Any]: ...

    async def stored_sequences(self, name: str) -> list[int]:
        """The sequence numbers of the messages `name` still stores, ascending (for audits: a
        work-queue stream keeps what nobody acked)."""
        ...

    async def dead_letters(self, stream: str, *, limit: int = 100) -> list[DeadLetter]: ...

    async def close(self) -> None: ...
