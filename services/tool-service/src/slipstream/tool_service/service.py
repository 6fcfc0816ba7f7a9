"""The tool-service: tools with a shared, heavy backend, answered over NATS request/reply.

    tools.call.<tool> --(queue group "tool-service", one replica answers)--> ToolServer --> reply

`setup` builds the served registry from `[serve] sets` (a bad set or option fails setup, naming
it), connects to NATS (core only: requests are never stored) and subscribes one queue-group
subscription per tool. `run` waits for SIGTERM; `drain` unsubscribes (callers' next requests go
to the other replicas, or, with none left, fail fast as "no responders" and are retried), answers
what this replica already took, and waits for the calls it is running within the drain budget.
A replica killed without a drain (SIGKILL, OOM) leaves its in-flight calls unanswered: each
caller's attempt times out and is re-sent to a live replica (libs/toolcalls remote.py).
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

from slipstream.runtime.service import BaseService
from slipstream.telemetry.logs import get_logger
from slipstream.tool_service.config import ToolServiceConfig
from slipstream.tool_service.memory import CallMemory
from slipstream.tool_service.sandboxes import SandboxSet
from slipstream.tool_service.server import ToolServer
from slipstream.tool_service.toolsets import ToolSetError, build_registry
from slipstream.toolcalls import Tool
from slipstream.toolcalls.remote import connect

if TYPE_CHECKING:
    from nats.aio.client import Client

log = get_logger(__name__)


class ToolService(BaseService):
    name = "tool-service"

    def __init__(self, cfg: ToolServiceConfig) -> None:
        if cfg.bus.type != "nats":
            raise ValueError(f"tool-service needs [bus] type = 'nats' (request/reply), got {cfg.bus.type!r}")
        self.cfg = cfg
        self.replica = f"{self.name}/{cfg.service.replica or 'local'}"
        # Built here, so a bad tool set or option is a construction error that names it.
        self.sandboxes: SandboxSet | None = None
        made: dict[str, list[Tool]] = {}
        if "code" in cfg.serve.sets:
            try:
                self.sandboxes = SandboxSet(self.replica, cfg.serve.options.get("code", {}))
            except ValueError as exc:
                raise ToolSetError(str(exc)) from exc
            made["code"] = self.sandboxes.tools()
        self.registry = build_registry(cfg.serve.sets, cfg.serve.options, store=cfg.store, made=made)
        self.nc: Client | None = None
        self.server: ToolServer | None = None

    async def setup(self) -> None:
        t = self.cfg.serve
        self.nc = await connect(
            self.cfg.bus.url,
            name=self.replica,
            timeout_s=self.cfg.bus.connect_timeout_s,
            options=self.cfg.bus.nats_options(),
        )
        self.server = ToolServer(
            self.nc,
            self.registry,
            replica=self.replica,
            concurrency=t.concurrency,
            memory=CallMemory(t.remember_calls, t.remember_s),
        )
        if self.sandboxes is not None:
            self.sandboxes.start()
        await self.server.start()

    async def run(self, stop: asyncio.Event) -> None:
        await stop.wait()

    async def drain(self) -> None:
        if self.server is not None and self.nc is not None and self.nc.is_connected:
            await self.server.drain()
        if self.sandboxes is not None:
            # Every call is answered: the sandboxes' episodes can go no further here (their next
            # operation finds no responders and ends them as infrastructure errors).
            await self.sandboxes.aclose()

    async def close(self) -> None:
        if self.sandboxes is not None:
            await self.sandboxes.aclose()
        if self.nc is not None and not self.nc.is_closed:
            await self.nc.close()

    def ready(self) -> bool:
        return self.nc is not None and self.nc.is_connected and self.server is not None

    def in_flight(self) -> int:
        return self.server.in_flight if self.server is not None else 0

    def status(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "replica": self.replica,
            "tools": list(self.registry.names),
            "bus": {"connected": self.nc is not None and self.nc.is_connected},
        }
        if self.server is not None:
            out["inflight"] = self.server.in_flight
            out.update(self.server.counts)
        if self.sandboxes is not None:
            out["sandboxes"] = self.sandboxes.status()
        return out
