"""What the runtime runs: the `Service` protocol and `BaseService`, its do-nothing defaults.

A service is the wiring of its loops; the runtime owns the process around it (signals, probes,
the drain budget, exit codes). The contract, in the order the runtime calls it:

- `setup()` connects what the service needs (bus, store, engine). An exception here is fatal.
- `run(stop)` does the work until `stop` is set (SIGTERM) or the work is done, then returns.
  It should stop taking new work as soon as `stop` is set.
- `drain()` finishes or hands back in-flight work (ack what is done, nak what is not).
- `close()` releases connections; called once, also after a failure.
- `ready()` answers the readiness probe (e.g. "the bus is connected"); `status()` is extra JSON
  for /readyz; `in_flight()` is how many units of work are not finished, logged when the drain
  budget runs out.
"""

from __future__ import annotations

import asyncio
from typing import Any, Protocol, runtime_checkable


@runtime_checkable
class Service(Protocol):
    """A long-running service, driven by `slipstream.runtime.lifecycle.serve`."""

    name: str

    async def setup(self) -> None: ...

    async def run(self, stop: asyncio.Event) -> None: ...

    async def drain(self) -> None: ...

    async def close(self) -> None: ...

    def ready(self) -> bool: ...

    def status(self) -> dict[str, Any]: ...

    def in_flight(self) -> int: ...


class BaseService:
    """Defaults for every hook: nothing to set up, drain or close; always ready; `run` waits for stop."""

    name: str = "service"

    async def setup(self) -> None:
        return None

    async def run(self, stop: asyncio.Event) -> None:
        await stop.wait()

    async def drain(self) -> None:
        return None

    async def close(self) -> None:
        return None

    def ready(self) -> bool:
        return True

    def status(self) -> dict[str, Any]:
        return {}

    def in_flight(self) -> int:
        return 0
