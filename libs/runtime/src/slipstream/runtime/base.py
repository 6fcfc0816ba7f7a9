"""`ServiceConfig`: the base every service's config class is built on.

It holds the four sections every service carries, each owned by the lib that uses it:
`[service]` (this runtime), `[bus]` (slipstream.bus), `[store]` (slipstream.store) and
`[telemetry]` (slipstream.telemetry). A service's class subclasses it and adds only its own
sections, which come after these four in `--help` and `--print-config`. A service that uses a
shared section for something particular says so in `section_docs` (the section's line in
`--help`) rather than declaring the section again.
"""

from __future__ import annotations

from typing import Annotated, ClassVar

import msgspec

from slipstream.bus.config import BusConfig
from slipstream.runtime.section import ServiceSection
from slipstream.store.config import StoreConfig
from slipstream.telemetry.config import TelemetryConfig

Doc = msgspec.Meta


class ServiceConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """The shared sections; subclass it and add the service's own (see the module docstring)."""

    # A class variable, not a config field: what a service keeps in a shared section, by section.
    section_docs: ClassVar[dict[str, str]] = {}

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
