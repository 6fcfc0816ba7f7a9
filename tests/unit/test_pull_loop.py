"""`slipstream.bus.pull_loop`: the one loop consume(), the worker's intake and the gate's intake fetch through.

Runs over the in-memory bus. Fetch failures, which that bus never has, are injected by a thin
wrapper around its real consumer that raises `BusError` on the first N fetches.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from typing import Any

import pytest

from slipstream.bus import Bus, BusConfig, BusError, Delivery, connect_bus
from slipstream.bus.pull_loop import pull_loop
from slipstream.runtime.backoff import Backoff
from slipstream.schemas import Task

pytestmark = pytest.mark.unit


@pytest.fixture
async def bus() -> AsyncIterator[Bus]:
    b = await connect_bus(BusConfig(type="memory", url=f"memory://{uuid.uuid4().hex}", fetch_timeout_s=0.05), name="t")
    await b.ensure_streams()
    yield b
    await b.close()


async def publish(bus: Bus, n: int) -> None:
    for i in range(n):
        task = Task(task_id=f"t{i}", env="arith", prompt=f"{i}+{i}=", reference=str(2 * i), run_id="r")
        await bus.publish("tasks.arith", task, msg_id=f"task-{i}")


class Flaky:
    """The real consumer, except that its first `failures` fetches raise BusError; records each fetch's size."""

    def __init__(self, inner: Any, failures: int) -> None:
        self.inner = inner
        self.durable = inner.durable
        self.failures = failures
        self.sizes: list[int | None] = []

    async def fetch(self, batch: int | None = None, timeout: float | None = None) -> list[Delivery[Task]]:
        self.sizes.append(batch)
        if self.failures > 0:
            self.failures -= 1
            raise BusError("injected: server unreachable")
        out: list[Delivery[Task]] = await self.inner.fetch(batch, timeout)
        return out

    async def close(self) -> None:
        await self.inner.close()


async def test_failed_fetches_back_off_then_the_first_good_one_resets_the_backoff(bus: Bus) -> None:
    await publish(bus, 3)
    consumer = Flaky(await bus.consumer("rollout-worker", Task), failures=3)
    stop = asyncio.Event()
    retry = Backoff(0.01, max_s=0.03)
    errors: list[tuple[str, int]] = []
    got: list[str] = []
    attempts_at_batch: list[int] = []

    async def on_batch(batch: list[Delivery[Task]]) -> None:
        attempts_at_batch.append(retry.attempts)
        for d in batch:
            got.append(d.msg.task_id)
            await d.ack()
        if len(got) == 3:
            stop.set()

    await asyncio.wait_for(
        pull_loop(
            consumer,  # type: ignore[arg-type]  # the real consumer behind a fault injector
            on_batch,
            stop=stop,
            batch=8,
            fetch_timeout_s=0.05,
            on_fetch_error=lambda exc: errors.append((str(exc), retry.attempts)),
            backoff=retry,
        ),
        10,
    )
    # Each failure in a row takes the next delay (0.01, 0.02, 0.03 s); the good fetch resets them.
    assert errors == [("injected: server unreachable", n) for n in range(3)]
    assert attempts_at_batch[0] == 0
    assert sorted(got) == ["t0", "t1", "t2"]
    assert consumer.sizes[:4] == [8, 8, 8, 8]
    await consumer.close()


async def test_ready_sets_each_fetch_size_and_zero_skips_a_round(bus: Bus) -> None:
    await publish(bus, 5)
    consumer = Flaky(await bus.consumer("rollout-worker", Task), failures=0)
    stop = asyncio.Event()
    answers = [0, 0, 2, 3]
    sizes: list[int] = []

    async def ready() -> int:
        size = answers.pop(0) if answers else 0
        if not answers and size == 0:
            stop.set()  # nothing more to ask for
        return size

    async def on_batch(batch: list[Delivery[Task]]) -> None:
        sizes.append(len(batch))
        for d in batch:
            await d.ack()

    await asyncio.wait_for(pull_loop(consumer, on_batch, stop=stop, fetch_timeout_s=0.05, ready=ready), 10)  # type: ignore[arg-type]
    # Two rounds skipped without a fetch; then fetches of at most 2 and 3 deliveries.
    assert consumer.sizes == [2, 3]
    assert sizes == [2, 3]
    await consumer.close()


async def test_stop_during_a_backoff_ends_the_loop_at_once(bus: Bus) -> None:
    consumer = Flaky(await bus.consumer("rollout-worker", Task), failures=10**6)
    stop = asyncio.Event()
    errors: list[BusError] = []

    def failed(exc: BusError) -> None:
        errors.append(exc)
        asyncio.get_running_loop().call_later(0.05, stop.set)

    async def on_batch(batch: list[Delivery[Task]]) -> None:
        raise AssertionError("no fetch succeeds")

    # A 60 s backoff: only `stop` can end the wait in time.
    loop = pull_loop(consumer, on_batch, stop=stop, on_fetch_error=failed, backoff=Backoff(60.0))  # type: ignore[arg-type]
    await asyncio.wait_for(loop, 10)
    assert len(errors) == 1
    await consumer.close()
