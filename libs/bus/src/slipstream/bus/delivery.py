"""One message handed to a service: the decoded struct, where it came from, and how to settle it.

Settling (ack, nak, term) happens at most once; a second settlement is a logged no-op that
returns False, so a handler and the consume loop can both try to settle without crashing.
`in_progress` may be called any number of times before settlement.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Generic, Literal, Protocol, TypeVar

import msgspec

from slipstream.bus.tracing import extract

if TYPE_CHECKING:
    from opentelemetry.context import Context

T = TypeVar("T", bound=msgspec.Struct)
Action = Literal["ack", "nak", "term", "release"]
log = logging.getLogger(__name__)


class Settler(Protocol):
    """The consumer that owns a delivery and talks to the server for it."""

    async def settle(self, delivery: Delivery[Any], action: Action, delay_s: float) -> None: ...

    async def progress(self, delivery: Delivery[Any]) -> None: ...


class Delivery(Generic[T]):
    """A decoded message plus its settlement handle (a NATS message or a memory-broker slot)."""

    __slots__ = (
        "_context",
        "_handle",
        "_settled",
        "_settler",
        "data",
        "headers",
        "msg",
        "num_delivered",
        "stream_seq",
        "subject",
    )

    def __init__(
        self,
        msg: T,
        subject: str,
        headers: dict[str, str],
        data: bytes,
        num_delivered: int,
        stream_seq: int,
        settler: Settler,
        handle: Any,
    ) -> None:
        self.msg = msg
        self.subject = subject
        self.headers = headers
        self.data = data
        self.num_delivered = num_delivered
        self.stream_seq = stream_seq
        self._settler = settler
        self._handle = handle
        self._settled: Action | None = None
        self._context: Context | None = None

    def __repr__(self) -> str:
        return (
            f"Delivery({type(self.msg).__name__}, subject={self.subject!r}, seq={self.stream_seq}, "
            f"delivered={self.num_delivered}, settled={self._settled})"
        )

    @property
    def context(self) -> Context:
        """The producer's trace context (extracted on first use: most handlers never ask)."""
        if self._context is None:
            self._context = extract(self.headers)
        return self._context

    @property
    def settled(self) -> Action | None:
        return self._settled

    async def ack(self) -> bool:
        """Done: the message leaves a work queue. False if it was already settled."""
        return await self._finish("ack", 0.0)

    async def nak(self, delay_s: float = 0.0) -> bool:
        """Not done: redeliver after `delay_s` (to the DLQ instead once max_deliver is used up)."""
        return await self._finish("nak", delay_s)

    async def term(self) -> bool:
        """Never redeliver (the message is dropped from a work queue)."""
        return await self._finish("term", 0.0)

    async def release(self) -> bool:
        """Hand back unprocessed (shutdown): redeliver now, never dead-letter for it."""
        return await self._finish("release", 0.0)

    async def in_progress(self) -> bool:
        """Still working: restart the ack-wait timer. False (and nothing sent) once settled."""
        if self._settled is not None:
            return False
        await self._settler.progress(self)
        return True

    async def _finish(self, action: Action, delay_s: float) -> bool:
        if self._settled is not None:
            log.debug("ignoring %s of %r: already %s", action, self, self._settled)
            return False
        # Mark first so two concurrent settlements cannot both reach the server.
        self._settled = action
        await self._settler.settle(self, action, delay_s)
        return True
