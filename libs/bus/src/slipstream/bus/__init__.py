"""Slipstream's message bus: NATS JetStream (or an in-process stand-in) behind one small API.

    bus = await connect_bus(cfg.bus, name="reward-model-0")
    await bus.ensure_streams()                       # streams + durables from the subject table
    seq = await bus.publish("traj.raw.arith", episode, msg_id=episode.episode_id)
    consumer = await bus.consumer("reward-model", Episode)
    await consume(consumer, handle, stop=stop_event)  # ack on success, nak on error, hand back on stop
    async for d in bus.subscribe("weights.announce", WeightAnnounce, deliver="last"): ...

Guarantees (both backends, held by tests/contract/test_bus.py): work-queue delivery to one
replica; redelivery after nak or ack_wait; dedup by msg id; undecodable, unknown-schema and
out-of-deliveries messages go to `dlq.<STREAM>` with their original bytes; oversized messages
are refused before sending; W3C trace context travels in headers.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

# Imported on first use (PEP 562): every service config imports `slipstream.bus.config`, and
# `--help` must not pay for the NATS client.
_EXPORTS: dict[str, str] = {
    "Bus": "base",
    "BusError": "base",
    "BusUnavailable": "base",
    "Consumer": "base",
    "DeliverFrom": "base",
    "PayloadTooLarge": "base",
    "PublishError": "base",
    "Subscription": "base",
    "BusConfig": "config",
    "Delivery": "delivery",
    "ConsumeStats": "dispatcher",
    "consume": "dispatcher",
    "connect_bus": "factory",
    "reset_memory_brokers": "memory_broker",
}

__all__ = [
    "Bus",
    "BusConfig",
    "BusError",
    "BusUnavailable",
    "ConsumeStats",
    "Consumer",
    "DeliverFrom",
    "Delivery",
    "PayloadTooLarge",
    "PublishError",
    "Subscription",
    "connect_bus",
    "consume",
    "reset_memory_brokers",
]

if TYPE_CHECKING:
    from slipstream.bus.base import (
        Bus,
        BusError,
        BusUnavailable,
        Consumer,
        DeliverFrom,
        PayloadTooLarge,
        PublishError,
        Subscription,
    )
    from slipstream.bus.config import BusConfig
    from slipstream.bus.delivery import Delivery
    from slipstream.bus.dispatcher import ConsumeStats, consume
    from slipstream.bus.factory import connect_bus
    from slipstream.bus.memory_broker import reset_brokers as reset_memory_brokers


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'slipstream.bus' has no attribute {name!r}")
    attr = "reset_brokers" if name == "reset_memory_brokers" else name
    value = getattr(importlib.import_module(f"slipstream.bus.{module}"), attr)
    globals()[name] = value
    return value
