"""A test service for the runtime's integration tests: no bus, behaviour chosen by `[probe]`.

Run as a script (`python lifecycle_service.py --probe.mode slow_drain ...`); it goes through the
same `service_main` as the real services, so the tests see real signals, probes and exit codes.
Modes: `ok` (ready until SIGTERM), `setup_fails` (setup raises after `setup_delay_s`),
`run_fails` (run raises once running), `slow_drain` (`in_flight` units of work that each take
`work_s` and are waited for on stop).
"""

from __future__ import annotations

import asyncio
import sys
from typing import Annotated, Any, Literal

import msgspec

from slipstream.runtime import BaseService, ServiceSection, service_main
from slipstream.telemetry.config import TelemetryConfig

Doc = msgspec.Meta


class ProbeSection(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    mode: Annotated[
        Literal["ok", "setup_fails", "run_fails", "slow_drain"], Doc(description="Which behaviour to show.")
    ] = "ok"
    setup_delay_s: Annotated[float, Doc(description="Time setup takes before it returns or raises.")] = 0.0
    in_flight: Annotated[int, Doc(description="Units of work started once running (slow_drain).")] = 3
    work_s: Annotated[float, Doc(description="Duration of one unit of work (slow_drain).")] = 30.0


class LifecycleConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    service: ServiceSection = msgspec.field(default_factory=ServiceSection)
    telemetry: TelemetryConfig = msgspec.field(default_factory=TelemetryConfig)
    probe: ProbeSection = msgspec.field(default_factory=ProbeSection)


class LifecycleService(BaseService):
    name = "lifecycle-test"

    def __init__(self, cfg: LifecycleConfig) -> None:
        self.cfg = cfg.probe
        self.work: list[asyncio.Task[None]] = []

    async def setup(self) -> None:
        await asyncio.sleep(self.cfg.setup_delay_s)
        if self.cfg.mode == "setup_fails":
            try:
                raise ConnectionRefusedError("nothing listens on the fake dependency")
            except ConnectionRefusedError as exc:
                raise RuntimeError("setup exploded: fake dependency unreachable") from exc

    async def run(self, stop: asyncio.Event) -> None:
        if self.cfg.mode == "run_fails":
            await asyncio.sleep(0.2)
            raise ValueError("run exploded on purpose")
        if self.cfg.mode == "slow_drain":
            self.work = [asyncio.create_task(asyncio.sleep(self.cfg.work_s)) for _ in range(self.cfg.in_flight)]
        await stop.wait()
        # Finish what was taken before returning: this is what outlasts the drain budget.
        if self.work:
            await asyncio.gather(*self.work)

    def in_flight(self) -> int:
        return sum(1 for t in self.work if not t.done())

    def status(self) -> dict[str, Any]:
        return {"mode": self.cfg.mode, "in_flight": self.in_flight()}


if __name__ == "__main__":
    sys.exit(service_main("lifecycle-test", LifecycleConfig, "__main__:LifecycleService"))
