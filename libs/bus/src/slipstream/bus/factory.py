"""`connect_bus`: the one way services get a bus, backend chosen by `[bus] type`."""

from __future__ import annotations

from collections.abc import Sequence

from slipstream.bus.base import Bus
from slipstream.bus.config import BusConfig
from slipstream.bus.jetstream import NatsBus
from slipstream.bus.memory import MemoryBus
from slipstream.bus.topology import Topology
from slipstream.schemas.subjects import STREAMS, StreamSpec


async def connect_bus(cfg: BusConfig, *, name: str, streams: Sequence[StreamSpec] = STREAMS) -> Bus:
    """A connected bus. `name` identifies the client to the server (service and replica).

    `streams` replaces the subject table's stream list, for tests that need, say, a short ack
    wait; subjects still come from `slipstream.schemas.subjects.SUBJECTS` by stream name.
    Raises `BusUnavailable` when NATS cannot be reached within `cfg.connect_budget_s`.
    """
    topology = Topology(streams)
    bus: MemoryBus | NatsBus
    if cfg.type == "memory":
        bus = MemoryBus(cfg, name, topology)
    elif cfg.type == "nats":
        bus = NatsBus(cfg, name, topology)
    else:
        raise ValueError(f"[bus] type must be 'nats' or 'memory', not {cfg.type!r}")
    await bus.start()
    return bus
