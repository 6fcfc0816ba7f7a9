"""The `code` tool set: this replica's sandbox host, served as two tools (libs/envs code/service.py).

`sandbox_create` is served in the queue group like every tool (any replica may take an episode);
`sandbox_<route>` only here, so an episode's later operations reach the replica holding its
sandbox. A reaper closes sandboxes idle for `idle_ttl_s`; the drain closes the rest after the
last call is answered. Each process keeps its sandboxes in a directory of its own (named by its
route, with its pid in a file); at start a replica removes the directories of processes that no
longer run (a SIGKILLed replica's sandboxes), so nothing a crash left behind stays on disk.

Options (`[serve.options.code]`): `idle_ttl_s` (600), `max_sandboxes` (256, held at once),
`max_wall_s` (120: the longest command a caller may ask for), `root` (where sandboxes live;
default `<tmp>/slipstream-sandbox-host/<route>`), `reap_every_s` (how often idle ones are looked
for; default a quarter of the TTL, at most 30 s).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any

import msgspec

from slipstream.envs.code.service import create_tool, route_for, routed_tool
from slipstream.sandbox import Limits
from slipstream.sandbox.remote import SandboxHost
from slipstream.telemetry.logs import get_logger
from slipstream.telemetry.metrics import counter, gauge
from slipstream.toolcalls import Tool

log = get_logger(__name__)
Doc = msgspec.Meta

OPEN = gauge("tool-service/sandboxes/open", "Sandboxes this replica holds now (the code tool set).")
REAPED = counter("tool-service/sandboxes/reaped", "Sandboxes closed after being idle for idle_ttl_s.")


PID_FILE = ".pid"


def sweep_dead(root: Path) -> list[str]:
    """Remove the sandbox directories under `root` whose process no longer runs; their names."""
    swept: list[str] = []
    if not root.is_dir():
        return swept
    for home in root.iterdir():
        try:
            pid = int((home / PID_FILE).read_text().strip())
        except (OSError, ValueError):
            continue  # not a host's directory, or one being made: leave it
        try:
            os.kill(pid, 0)
            continue  # alive (or not ours to signal, so alive)
        except ProcessLookupError:
            pass
        except PermissionError:
            continue
        shutil.rmtree(home, ignore_errors=True)
        swept.append(home.name)
    return swept


class SandboxSetOptions(msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=True):
    idle_ttl_s: Annotated[float, Doc(description="Close a sandbox no call touched for this long.", gt=0)] = 600.0
    max_sandboxes: Annotated[int, Doc(description="Sandboxes this replica holds at once.", ge=1)] = 256
    max_wall_s: Annotated[float, Doc(description="Longest command a caller may ask for, seconds.", gt=0)] = 120.0
    root: Annotated[str, Doc(description="Where sandboxes live; empty: under the system temp directory.")] = ""
    reap_every_s: Annotated[float, Doc(description="How often idle sandboxes are looked for; 0: auto.", ge=0)] = 0.0


class SandboxSet:
    """One replica's sandboxes and the two tools that reach them."""

    def __init__(self, replica: str, options: Mapping[str, Any]) -> None:
        try:
            self.options = msgspec.convert(dict(options), SandboxSetOptions)
        except msgspec.ValidationError as exc:
            raise ValueError(f"tool set 'code': {exc}") from None
        o = self.options
        self.route = route_for(replica)
        root = Path(o.root) if o.root else Path(tempfile.gettempdir()) / "slipstream-sandbox-host"
        self.swept = sweep_dead(root)
        limits = Limits(wall_s=o.max_wall_s, cpu_s=max(1, int(o.max_wall_s)), memory_mb=2048, processes=256)
        self.host = SandboxHost(
            root / self.route, idle_ttl_s=o.idle_ttl_s, max_sessions=o.max_sandboxes, max_limits=limits
        )
        (self.host.root / PID_FILE).write_text(str(os.getpid()))
        self.reap_every_s = o.reap_every_s or min(30.0, o.idle_ttl_s / 4)
        self._reaper: asyncio.Task[None] | None = None

    def tools(self) -> list[Tool]:
        timeout_s = self.options.max_wall_s + 10.0
        return [create_tool(self.host, self.route, timeout_s), routed_tool(self.host, self.route, timeout_s)]

    def start(self) -> None:
        OPEN.set(0)
        if self.swept:
            log.info("removed the sandboxes of replicas that are gone", directories=self.swept)
        self._reaper = asyncio.create_task(self._reap_forever())

    async def _reap_forever(self) -> None:
        while True:
            await asyncio.sleep(self.reap_every_s)
            try:
                reaped = await self.host.reap()
            except Exception as exc:  # a failed removal must not stop the reaper
                log.error("reaping idle sandboxes failed", error=repr(exc))
                continue
            if reaped:
                REAPED.add(len(reaped))
                log.info("closed idle sandboxes", count=len(reaped), ttl_s=self.host.idle_ttl_s)
            OPEN.set(self.host.open)

    async def aclose(self) -> None:
        reaper, self._reaper = self._reaper, None
        if reaper is not None:
            reaper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await reaper
        await self.host.aclose()
        OPEN.set(0)

    def status(self) -> dict[str, Any]:
        return {"route": self.route, **self.host.status()}
