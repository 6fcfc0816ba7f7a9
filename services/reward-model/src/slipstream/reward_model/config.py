"""Configuration of the reward-model service: one typed class, its sections owned by the libs.

Resolved by `slipstream.runtime.config` from defaults, a TOML file (`--config`),
`SLIPSTREAM_<SECTION>__<FIELD>` variables and `--section.field` flags, in that order.
"""

from __future__ import annotations

from typing import Annotated, Any

import msgspec

from slipstream.bus.config import BusConfig
from slipstream.runtime.section import ServiceSection
from slipstream.store.config import StoreConfig
from slipstream.telemetry.config import TelemetryConfig

Doc = msgspec.Meta


class RewardSection(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """`[reward]`: how many trajectories are scored at once, and the environments' scoring options."""

    concurrency: Annotated[
        int, Doc(description="Trajectories scored and published at once by this replica.", ge=1, le=4096)
    ] = 16
    env_options: Annotated[
        dict[str, dict[str, Any]],
        Doc(
            description=(
                "Options per environment, {env: {option: value}} (e.g. {arith = {max_operand = 19}}); "
                "keep them equal to the task source's. Environments not named use their defaults."
            )
        ),
    ] = {}


class RewardModelConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    service: Annotated[ServiceSection, Doc(description="Process: run id, replica, probe port, drain budget.")] = (
        msgspec.field(default_factory=ServiceSection)
    )
    bus: Annotated[BusConfig, Doc(description="Message bus (NATS JetStream or in-memory).")] = msgspec.field(
        default_factory=BusConfig
    )
    store: Annotated[
        StoreConfig, Doc(description="Object store (local directory or S3): by-reference episode bodies.")
    ] = msgspec.field(default_factory=StoreConfig)
    telemetry: Annotated[TelemetryConfig, Doc(description="Logs and traces.")] = msgspec.field(
        default_factory=TelemetryConfig
    )
    reward: Annotated[RewardSection, Doc(description="Scoring: concurrency and per-environment options.")] = (
        msgspec.field(default_factory=RewardSection)
    )
