"""The one pull loop: fetch from a durable consumer, hand each batch over, back off when fetching fails.

Every consumer of the bus fetches through it: `dispatcher.consume` (a handler per delivery, for
the reward model and the learner), the rollout worker's task intake and the eval gate's intake.
What differs between them is a parameter, not a second loop:

- `ready()`, awaited before each fetch: how many deliveries to ask for now, or 0 to skip this
  round after waiting for something itself (free slots in the worker; Redis answering in the
  gate); the loop then checks `stop` and asks again. Without it every fetch asks for `batch`.
- `on_batch(deliveries)`: handles one fetch's deliveries; settling them (ack, nak, release) is
  its business, and a `stop` that comes meanwhile is its to honour.
- `on_fetch_error(exc)`: counts a failed fetch in the caller's own metrics.
- `backoff`: the waits after failed fetches in a row (`RETRY_INITIAL_S` doubling up to
  `RETRY_MAX_S` unless given), back to the first after a fetch that succeeds.

A fetch that raises `BusError` is logged, counted and retried after the next delay, cut short by
`stop`; anything else it raises ends the loop (a bug: the caller's runtime reports it). The loop
returns once `stop` is set, after the batch in hand (if any) was handed over.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import TypeVar

import msgspec

from slipstream.bus.base import BusError, Consumer
from slipstream.bus.delivery import Delivery
from slipstream.runtime.backoff import Backoff, sleep_or_stop

T = TypeVar("T", bound=msgspec.Struct)
log = logging.getLogger(__name__)
RETRY_INITIAL_S = 0.1
RETRY_MAX_S = 5.0


async def pull_loop(
    consumer: Consumer[T],
    on_batch: Callable[[list[Delivery[T]]], Awaitable[None]],
    *,
    stop: asyncio.Event,
    batch: int | None = None,
    fetch_timeout_s: float | None = None,
    ready: Callable[[], Awaitable[int]] | None = None,
    on_fetch_error: Callable[[BusError], None] | None = None,
    backoff: Backoff | None = None,
) -> None:
    """Fetch and hand over until `stop` is set (see the module docstring)."""
    retry = backoff or Backoff(RETRY_INITIAL_S, max_s=RETRY_MAX_S)
    durable = getattr(consumer, "durable", "")
    while not stop.is_set():
        size = batch
        if ready is not None:
            size = await ready()
            if size <= 0:
                continue
        try:
            fetched = await consumer.fetch(size, fetch_timeout_s)
        except BusError as exc:
            if on_fetch_error is not None:
                on_fetch_error(exc)
            delay = next(retry)
            log.warning("fetch from %s failed: %s; retrying in %.1fs", durable, exc, delay)
            await sleep_or_stop(stop, delay)
            continue
        retry.reset()
        await on_batch(fetched)
