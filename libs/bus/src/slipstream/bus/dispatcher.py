"""The consume loop services run: fetch a batch, hand each delivery to a handler, settle it.

Fetching (and its backoff when a fetch fails) is the one pull loop, `slipstream.bus.pull_loop`;
this module is what it does with each batch.

On `stop` (SIGTERM flips it) the loop fetches no more, lets the handlers already running finish,
and hands back every fetched-but-unstarted delivery at once (a nak without delay), so a replica
that is shutting down loses nothing and delays nothing. A handler that raises gets its delivery
nak'd with a delay and counted; it never ends the loop. A handler that returns normally has its
delivery acked unless it settled it itself (`auto_ack=False` leaves settlement to the handler,
as the learner does when it acks after the step commits).

Every delivery the loop holds (fetched and waiting for a slot, or in its handler) gets an
in-progress signal every `heartbeat_s` (default: a third of the consumer's ack_wait), so the
ack waits in the subject table can stay short: they only decide how soon a *dead* replica's
messages come back, never whether a slow live one loses them.

With a tracer provider installed, each handler runs inside a CONSUMER span whose parent is the
producer's context from the message headers (`tracing.consumer_span`), so whatever the handler
publishes continues the same trace. Without one, the loop does not touch trace context at all.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import msgspec

from slipstream.bus.base import BusError, Consumer
from slipstream.bus.delivery import Delivery
from slipstream.bus.instruments import CONSUME_ERRORS
from slipstream.bus.pull_loop import pull_loop
from slipstream.bus.tracing import consumer_span, tracing_active

T = TypeVar("T", bound=msgspec.Struct)
Handler = Callable[[Delivery[T]], Awaitable[Any]]
log = logging.getLogger(__name__)


@dataclass
class ConsumeStats:
    handled: int = 0  # handler returned normally
    failed: int = 0  # handler raised; delivery nak'd with a delay
    released: int = 0  # fetched but not started when stop came; handed back
    fetch_errors: int = 0


async def _settle_quietly(what: str, op: Awaitable[bool]) -> None:
    # A settlement that cannot reach the server is not fatal: the message comes back after ack_wait.
    try:
        await op
    except Exception as exc:  # nats-py raises its own hierarchy; report it, never end the loop
        CONSUME_ERRORS.add(1, reason="settle")
        log.warning("could not %s a delivery: %r (it will be redelivered after ack_wait)", what, exc)


async def consume(
    consumer: Consumer[T],
    handler: Handler[T],
    *,
    stop: asyncio.Event,
    concurrency: int = 1,
    batch: int | None = None,
    fetch_timeout_s: float | None = None,
    auto_ack: bool = True,
    error_delay_s: float = 1.0,
    heartbeat_s: float | None = None,
) -> ConsumeStats:
    """Run until `stop` is set; returns what happened. See the module docstring.

    `heartbeat_s`: interval of in-progress signals on held deliveries; None = a third of the
    consumer's ack_wait, 0 = none.
    """
    if concurrency < 1:
        raise ValueError(f"concurrency must be >= 1, not {concurrency}")
    stats = ConsumeStats()
    durable = getattr(consumer, "durable", "")
    slots = asyncio.Semaphore(concurrency)
    running: set[asyncio.Task[None]] = set()
    fetched: list[Delivery[T]] = []
    held: set[Delivery[T]] = set()
    interval = default_heartbeat(consumer) if heartbeat_s is None else heartbeat_s
    beats = asyncio.create_task(_heartbeats(held, interval)) if interval > 0 else None

    async def run(d: Delivery[T]) -> None:
        try:
            await handle(d)
        finally:
            held.discard(d)

    async def handle(d: Delivery[T]) -> None:
        try:
            if tracing_active():
                with consumer_span(d, durable):
                    await handler(d)
            else:
                await handler(d)
        except Exception as exc:
            stats.failed += 1
            CONSUME_ERRORS.add(1, reason="handler")
            log.warning("handler failed on %r: %r; nak with %.1fs delay", d, exc, error_delay_s, exc_info=True)
            if d.settled is None:
                await _settle_quietly("nak", d.nak(error_delay_s))
            return
        stats.handled += 1
        if auto_ack and d.settled is None:
            await _settle_quietly("ack", d.ack())

    def done(task: asyncio.Task[None]) -> None:
        running.discard(task)
        slots.release()

    async def dispatch(batch_: list[Delivery[T]]) -> None:
        fetched[:] = batch_  # what is left of it when stop comes is handed back below
        held.update(batch_)
        while fetched and not stop.is_set():
            if concurrency == 1:
                await run(fetched.pop(0))
                continue
            await slots.acquire()
            if stop.is_set():
                slots.release()
                break
            task = asyncio.create_task(run(fetched.pop(0)))
            running.add(task)
            task.add_done_callback(done)

    def fetch_failed(exc: BusError) -> None:
        stats.fetch_errors += 1
        CONSUME_ERRORS.add(1, reason="fetch")

    try:
        await pull_loop(
            consumer, dispatch, stop=stop, batch=batch, fetch_timeout_s=fetch_timeout_s, on_fetch_error=fetch_failed
        )
    finally:
        if running:
            await asyncio.gather(*running, return_exceptions=True)
        for d in fetched:
            if d.settled is None:
                stats.released += 1
                await _settle_quietly("release", d.release())
        fetched.clear()
        held.clear()
        if beats is not None:
            beats.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await beats
    return stats


def default_heartbeat(consumer: object) -> float:
    """A third of the consumer's ack_wait (0 when it has none: no heartbeats)."""
    spec = getattr(consumer, "spec", None)
    ack_wait = getattr(spec, "ack_wait_s", 0.0) or 0.0
    return float(ack_wait) / 3.0


async def _heartbeats(held: set[Delivery[Any]], interval: float) -> None:
    while True:
        await asyncio.sleep(interval)
        for d in list(held):
            try:
                await d.in_progress()  # a no-op once settled
            except Exception as exc:  # nats-py raises its own hierarchy; the next beat may get through
                CONSUME_ERRORS.add(1, reason="heartbeat")
                log.warning("in-progress signal failed on %r: %r", d, exc)
