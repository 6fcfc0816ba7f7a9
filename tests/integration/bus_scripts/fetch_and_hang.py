"""Fetch tasks from the shared durable, report their ids, then hang without settling them.

The integration test SIGKILLs this process to show that un-acked work comes back after ack_wait.
Usage: fetch_and_hang.py NATS_URL ACK_WAIT_S COUNT MARKER_FILE
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import msgspec

from slipstream.bus import BusConfig, connect_bus
from slipstream.schemas import Task
from slipstream.schemas.subjects import STREAMS


def streams(ack_wait_s: float) -> tuple:
    out = []
    for s in STREAMS:
        if s.name == "TASKS":
            s = msgspec.structs.replace(s, consumers=(msgspec.structs.replace(s.consumers[0], ack_wait_s=ack_wait_s),))
        out.append(s)
    return tuple(out)


async def main(url: str, ack_wait_s: float, count: int, marker: Path) -> None:
    bus = await connect_bus(BusConfig(url=url), name="fetch-and-hang", streams=streams(ack_wait_s))
    consumer = await bus.consumer("rollout-worker", Task)
    got: list[str] = []
    while len(got) < count:
        got.extend(d.msg.task_id for d in await consumer.fetch(batch=count - len(got), timeout=1.0))
    tmp = marker.with_suffix(".tmp")
    tmp.write_text("\n".join(got) + "\n")
    tmp.rename(marker)
    await asyncio.Event().wait()  # hang until killed


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], float(sys.argv[2]), int(sys.argv[3]), Path(sys.argv[4])))
