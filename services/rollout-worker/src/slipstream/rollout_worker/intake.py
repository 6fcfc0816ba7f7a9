"""The source: take tasks from the shared `rollout-worker` consumer, never more than there is room for.

Every replica binds the same durable, so JetStream splits the backlog between them. A replica
fetches only as many tasks as it has free slots (`max_tasks_in_flight`), so a busy replica does
not hoard tasks that an idle one could run: that is this intake's `ready` step of the bus's one
pull loop (`slipstream.bus.pull_loop`), which also backs off when a fetch fails. Each held task
gets an in-progress signal every `heartbeat_s`, so a long rollout (or a wait for a weight
version) never outlives ack_wait.

The handler settles each delivery itself (ack, nak, release, or dead-letter); intake only
guarantees that a delivery whose handler crashed is nak'd rather than left to time out. With
tracing on, each handler runs in a CONSUMER span, child of the task's publish (from its headers).
A pool worker runs the same intake over the `subagent-pool` durable (subagent_pool.py).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from typing import Any

from slipstream.bus import Consumer, Delivery
from slipstream.bus.pull_loop import pull_loop
from slipstream.bus.tracing import consumer_span, tracing_active
from slipstream.rollout_worker.instruments import FETCH_ERRORS, HEARTBEAT_ERRORS, INFLIGHT, TASKS
from slipstream.schemas import Task
from slipstream.telemetry.logs import get_logger

Handler = Callable[[Delivery[Any]], Awaitable[None]]
log = get_logger(__name__)


class TaskIntake:
    """Bounded fetching from one durable consumer, one asyncio task per held delivery."""

    def __init__(
        self,
        consumer: Consumer[Task] | Consumer[Any],
        *,
        max_in_flight: int,
        heartbeat_s: float,
        fetch_timeout_s: float = 1.0,
        error_delay_s: float = 2.0,
    ) -> None:
        if max_in_flight < 1:
            raise ValueError(f"max_in_flight must be >= 1, got {max_in_flight}")
        self.consumer = consumer
        self.max_in_flight = max_in_flight
        self.heartbeat_s = heartbeat_s
        self.fetch_timeout_s = fetch_timeout_s
        self.error_delay_s = error_delay_s
        self._running: set[asyncio.Task[None]] = set()
        self._slot_freed = asyncio.Event()
        self.taken = 0

    @property
    def in_flight(self) -> int:
        return len(self._running)

    async def run(self, handle: Handler, stop: asyncio.Event) -> None:
        """Fetch into free slots until `stop`; returns without waiting for the held tasks."""

        async def room() -> int:
            free = self.max_in_flight - len(self._running)
            if free <= 0:
                self._slot_freed.clear()
                await _first(self._slot_freed.wait(), stop.wait())
            return free

        async def take(batch: list[Delivery[Any]]) -> None:
            for i, delivery in enumerate(batch):
                if stop.is_set():
                    # Fetched but never started: hand back at once so another replica takes it.
                    for left in batch[i:]:
                        await _settle_quietly("release", left.release())
                        TASKS.add(outcome="released")
                    break
                self.taken += 1
                job = asyncio.create_task(self._hold(delivery, handle), name=f"task {_name(delivery.msg)}")
                self._running.add(job)
                job.add_done_callback(self._done)
            INFLIGHT.set(float(len(self._running)))

        await pull_loop(
            self.consumer,
            take,
            stop=stop,
            fetch_timeout_s=self.fetch_timeout_s,
            ready=room,
            on_fetch_error=lambda _exc: FETCH_ERRORS.add(),
        )

    def _done(self, job: asyncio.Task[None]) -> None:
        self._running.discard(job)
        self._slot_freed.set()
        INFLIGHT.set(float(len(self._running)))

    async def _hold(self, delivery: Delivery[Any], handle: Handler) -> None:
        beat = asyncio.create_task(self._heartbeat(delivery))
        try:
            if tracing_active():
                # Our own fetch loop, so the consumer span `consume` would open is opened here.
                with consumer_span(delivery, self.consumer.durable):
                    await handle(delivery)
            else:
                await handle(delivery)
        except Exception as exc:
            # The handler settles everything it expects; this is a bug path, reported and redelivered.
            TASKS.add(outcome="nak_error")
            log.error("task handler crashed; nak", delivery=repr(delivery), error=repr(exc), exc_info=True)
            if delivery.settled is None:
                await _settle_quietly("nak", delivery.nak(self.error_delay_s))
        finally:
            beat.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await beat

    async def _heartbeat(self, delivery: Delivery[Any]) -> None:
        while delivery.settled is None:
            await asyncio.sleep(self.heartbeat_s)
            try:
                await delivery.in_progress()
            except Exception as exc:  # nats-py raises its own hierarchy; the next beat may succeed
                HEARTBEAT_ERRORS.add()
                log.warning("in-progress signal failed", delivery=repr(delivery), error=repr(exc))

    async def wait_idle(self, timeout: float) -> bool:
        """Wait up to `timeout` for every held task to finish; True if none is left."""
        if self._running:
            await asyncio.wait(set(self._running), timeout=max(0.0, timeout))
        return not self._running


def _name(msg: Any) -> str:
    """A held message's id for its asyncio task's name: a task id, or a sub-agent request id."""
    return str(getattr(msg, "task_id", "") or getattr(msg, "request_id", ""))


async def _first(*aws: Awaitable[object]) -> None:
    """Wait until the first of `aws` completes; cancel the rest."""
    jobs = [asyncio.ensure_future(a) for a in aws]
    try:
        await asyncio.wait(jobs, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for j in jobs:
            j.cancel()
        await asyncio.gather(*jobs, return_exceptions=True)


async def _settle_quietly(what: str, op: Awaitable[bool]) -> None:
    # A settlement that cannot reach the server is not fatal: the task comes back after ack_wait.
    try:
        await op
    except Exception as exc:
        log.warning("could not settle a task; it comes back after ack_wait", action=what, error=repr(exc))
