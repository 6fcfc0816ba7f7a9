"""The processes of a local stack: a server (NATS, Redis) and a service, each with its health checks.

Its own module because the stack (local.py) starts and stops them and its report (state.py)
reads them.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from slipstream.stack import ManagedProcess, Server
from slipstream.stack.probe import HOST, probe_tcp, url_endpoint


@dataclass
class ServerHandle:
    """NATS or Redis: started here (`server` set, stopped by us) or given by URL (left alone)."""

    name: str
    url: str
    server: Server | None

    @property
    def managed(self) -> bool:
        return self.server is not None

    @property
    def pid(self) -> int | None:
        return self.server.pid if self.server else None

    @property
    def log_path(self) -> Path | None:
        return self.server.process.log_path if self.server else None

    def alive(self) -> bool:
        return self.server.process.alive() if self.server else True

    def reachable(self) -> bool:
        return probe_tcp(*url_endpoint(self.url, 4222 if self.name == "nats" else 6379))


@dataclass
class ServiceProcess:
    name: str
    port: int
    process: ManagedProcess
    traces_file: Path | None
    ready_after_s: float | None = None
    host: str = HOST
    """The address its HTTP port listens on: loopback, or its namespace host's address (multihost.py)."""

    @property
    def pid(self) -> int:
        return self.process.pid

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def alive(self) -> bool:
        return self.process.alive()

    @property
    def returncode(self) -> int | None:
        return self.process.proc.poll()
