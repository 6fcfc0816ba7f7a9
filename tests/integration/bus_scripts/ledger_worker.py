"""A consumer process on the shared `rollout-worker` durable that stops cleanly on SIGTERM.

Each handled task is acked by the handler and then appended to a ledger file ("<pid> <task_id>"),
so the test can check that every task was processed and acked exactly once across restarts.
The signal handler only sets the stop event, as the service runtime does.
Usage: ledger_worker.py NATS_URL LEDGER_FILE WORK_MS CONCURRENCY
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from pathlib import Path

from slipstream.bus import BusConfig, Delivery, connect_bus, consume
from slipstream.schemas import Task


async def main(url: str, ledger: Path, work_s: float, concurrency: int) -> None:
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    bus = await connect_bus(BusConfig(url=url, fetch_timeout_s=0.5), name=f"ledger-{os.getpid()}")
    consumer = await bus.consumer("rollout-worker", Task)
    pid = os.getpid()
    with ledger.open("a", buffering=1) as out:

        async def handle(d: Delivery[Task]) -> None:
            await asyncio.sleep(work_s)
            await d.ack()
            out.write(f"{pid} {d.msg.task_id}\n")

        stats = await consume(consumer, handle, stop=stop, concurrency=concurrency, batch=16)
    await bus.close()
    print(f"stats handled={stats.handled} failed={stats.failed} released={stats.released}", flush=True)


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], Path(sys.argv[2]), float(sys.argv[3]) / 1000, int(sys.argv[4])))
