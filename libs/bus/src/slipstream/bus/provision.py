"""`python -m slipstream.bus.provision`: create every stream and durable consumer, then exit.

The NATS Helm chart creates no streams; the deploy's provisioning Job runs this once per rollout
(services also provision idempotently at start-up, so it is a convenience for ordering, not a
requirement). Config comes from the `[bus]` section: `SLIPSTREAM_BUS__URL`, `--bus.url`, or
`--config FILE`. Exit 0 on success, 1 with the reason when the server cannot be reached or
refuses the topology, so a Job retries.
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Sequence
from typing import Annotated

import msgspec

from slipstream.bus.config import BusConfig

Doc = msgspec.Meta


class ProvisionConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    bus: Annotated[BusConfig, Doc(description="The NATS server to provision.")] = msgspec.field(
        default_factory=BusConfig
    )


async def provision(cfg: BusConfig) -> list[str]:
    """Create/update the topology; returns the stream names now present."""
    from slipstream.bus.factory import connect_bus
    from slipstream.schemas.subjects import STREAMS

    bus = await connect_bus(cfg, name="provision")
    try:
        await bus.ensure_streams()
        return [s.name for s in STREAMS]
    finally:
        await bus.close()


def main(argv: Sequence[str] | None = None) -> int:
    from slipstream.runtime.config import parse_cli

    cfg = parse_cli(ProvisionConfig, argv, prog="python -m slipstream.bus.provision", description=__doc__ or "")
    try:
        names = asyncio.run(provision(cfg.bus))
    except Exception as exc:  # report and fail the Job; it retries
        print(f"provisioning {cfg.bus.url} failed: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    print(f"provisioned streams on {cfg.bus.url}: {', '.join(names)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
