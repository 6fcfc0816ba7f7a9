"""The weight-publisher service: stores new weight versions in the object store and announces them.

This version is the skeleton the runtime drives: `setup` connects the bus and provisions the
streams and durable consumers of the subject table (idempotent, so every replica may do it),
the service is ready while the bus is connected, and `run` waits for the stop signal. It
consumes and publishes nothing yet.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

from slipstream.bus import connect_bus
from slipstream.runtime.service import BaseService
from slipstream.weight_publisher.config import WeightPublisherConfig

if TYPE_CHECKING:
    from slipstream.bus import Bus


class WeightPublisherService(BaseService):
    name = "weight-publisher"

    def __init__(self, cfg: WeightPublisherConfig) -> None:
        self.cfg = cfg
        self.bus: Bus | None = None

    async def setup(self) -> None:
        self.bus = await connect_bus(self.cfg.bus, name=f"{self.name}/{self.cfg.service.replica}")
        await self.bus.ensure_streams()

    async def run(self, stop: asyncio.Event) -> None:
        await stop.wait()

    async def close(self) -> None:
        if self.bus is not None:
            await self.bus.close()

    def ready(self) -> bool:
        return self.bus is not None and self.bus.connected

    def status(self) -> dict[str, Any]:
        return {"bus": {"type": self.cfg.bus.type, "connected": self.bus is not None and self.bus.connected}}
