"""Configuration of the rollout-worker service: one typed class, its sections owned by the libs.

Resolved by `slipstream.runtime.config` from defaults, a TOML file (`--config`),
`SLIPSTREAM_<SECTION>__<FIELD>` variables and `--section.field` flags, in that order.
"""

from __future__ import annotations

from typing import Annotated

import msgspec

from slipstream.bus.config import BusConfig
from slipstream.runtime.section import ServiceSection
from slipstream.store.config import StoreConfig
from slipstream.telemetry.config import TelemetryConfig

Doc = msgspec.Meta


class RolloutWorkerConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    service: Annotated[ServiceSection, Doc(description="Process: run id, replica, probe port, drain budget.")] = (
        msgspec.field(default_factory=ServiceSection)
    )
    bus: Annotated[BusConfig, Doc(description="Message bus (NATS JetStream or in-memory).")] = msgspec.field(
        default_factory=BusConfig
    )
    store: Annotated[StoreConfig, Doc(description="Object store (local directory or S3).")] = msgspec.field(
        default_factory=StoreConfig
    )
    telemetry: Annotated[TelemetryConfig, Doc(description="Logs and traces.")] = msgspec.field(
        default_factory=TelemetryConfig
    )
