"""The probe HTTP server: GET /healthz, /readyz and /metrics on asyncio, no web framework.

Three fixed read-only endpoints do not need more than HTTP/1.1 with `Connection: close`:
kubelet probes and Prometheus scrapes open a connection per request anyway. The answers come
from callbacks, so this module knows nothing about lifecycle states or services.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from typing import Any

import structlog

from slipstream.telemetry.metrics import REGISTRY

PROMETHEUS_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
JSON_CONTENT_TYPE = "application/json"
# A probe that has not sent its request head by then is stuck or hostile; drop it.
HEAD_TIMEOUT_S = 5.0
MAX_HEAD_LINES = 100
_REASONS = {200: "OK", 400: "Bad Request", 404: "Not Found", 405: "Method Not Allowed", 503: "Service Unavailable"}

log = structlog.get_logger("slipstream.runtime.probes")

Response = tuple[int, str, bytes]


class ProbeServer:
    """Serves liveness, readiness and metrics for one service process.

    `healthy()` -> liveness; `readiness()` -> (ready, JSON-able body); `metrics()` -> Prometheus text.
    """

    def __init__(
        self,
        service: str,
        host: str,
        port: int,
        *,
        healthy: Callable[[], bool],
        readiness: Callable[[], tuple[bool, dict[str, Any]]],
        metrics: Callable[[], str],
    ) -> None:
        self.host = host
        self.requested_port = port
        self.port = 0
        self._healthy = healthy
        self._readiness = readiness
        self._metrics = metrics
        self._server: asyncio.Server | None = None
        self._requests = REGISTRY.counter(f"{service}/http/requests", "Probe HTTP requests by path and status code.")
        self._dropped = REGISTRY.counter(
            f"{service}/http/dropped_connections", "Probe connections dropped before a response (bad or slow request)."
        )

    async def start(self) -> int:
        """Bind and listen; returns the bound port (a free one when the requested port is 0)."""
        self._server = await asyncio.start_server(self._handle, self.host, self.requested_port, limit=16 * 1024)
        self.port = int(self._server.sockets[0].getsockname()[1])
        return self.port

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
            self._server = None

    def route(self, method: str, path: str) -> Response:
        """The response (status, content type, body) for one request; public for unit tests."""
        path = path.split("?", 1)[0]
        if path not in ("/healthz", "/readyz", "/metrics"):
            return 404, "text/plain", b"not found\n"
        if method not in ("GET", "HEAD"):
            return 405, "text/plain", b"method not allowed\n"
        if path == "/healthz":
            ok = self._healthy()
            return (200, "text/plain", b"ok\n") if ok else (503, "text/plain", b"failed\n")
        if path == "/readyz":
            ready, body = self._readiness()
            return 200 if ready else 503, JSON_CONTENT_TYPE, json.dumps(body, default=str).encode() + b"\n"
        return 200, PROMETHEUS_CONTENT_TYPE, self._metrics().encode()

    async def _read_head(self, reader: asyncio.StreamReader) -> tuple[str, str]:
        async with asyncio.timeout(HEAD_TIMEOUT_S):
            request_line = (await reader.readline()).decode("latin-1").strip()
            for _ in range(MAX_HEAD_LINES):
                line = await reader.readline()
                if line in (b"\r\n", b"\n", b""):
                    break
            else:
                raise ValueError("too many header lines")
        parts = request_line.split()
        if len(parts) != 3 or not parts[2].startswith("HTTP/"):
            raise ValueError(f"malformed request line {request_line[:80]!r}")
        return parts[0], parts[1]

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            try:
                method, path = await self._read_head(reader)
            except ValueError as exc:
                status, ctype, body = 400, "text/plain", f"{exc}\n".encode()
                method, path = "GET", "invalid"
            else:
                status, ctype, body = self.route(method, path)
            head = (
                f"HTTP/1.1 {status} {_REASONS.get(status, '')}\r\n"
                f"Content-Type: {ctype}\r\nContent-Length: {len(body)}\r\nConnection: close\r\n\r\n"
            )
            writer.write(head.encode() + (b"" if method == "HEAD" else body))
            await writer.drain()
            self._requests.add(path=path.split("?", 1)[0] if status != 404 else "other", code=str(status))
        except (TimeoutError, ConnectionError, asyncio.LimitOverrunError, asyncio.IncompleteReadError) as exc:
            self._dropped.add()
            log.debug("probe connection dropped", reason=type(exc).__name__)
        finally:
            writer.close()
            try:
                await writer.wait_closed()
            except ConnectionError:
                pass
