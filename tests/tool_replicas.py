"""Tool-service replicas as real child processes, for the tool tests (contract and fail-over).

Each replica is `python -m slipstream.tool_service` against a test's own nats-server, with its
own probe port (written to a port file) and log; the tests stop them by PID (SIGTERM, or
SIGKILL to play a crash).
"""

from __future__ import annotations

import http.client
import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

from slipstream.stack.process import ManagedProcess


def child_env() -> dict[str, str]:
    # Only the flags count: no SLIPSTREAM_*/OTEL_* leaks in from whoever runs the tests.
    return {k: v for k, v in os.environ.items() if not k.startswith(("SLIPSTREAM_", "OTEL_"))}


class ToolReplica:
    """One tool-service process serving `sets` (with `options`) on `nats_url`."""

    def __init__(
        self,
        name: str,
        nats_url: str,
        root: Path,
        *,
        sets: list[str],
        options: dict[str, dict[str, Any]] | None = None,
        concurrency: int = 64,
        drain_timeout_s: float = 10.0,
        extra: tuple[str, ...] = (),
    ) -> None:
        self.name = name
        self.port_file = root / "ports" / name
        argv = [
            sys.executable,
            "-m",
            "slipstream.tool_service",
            "--bus.url",
            nats_url,
            "--service.replica",
            name,
            "--service.port-file",
            str(self.port_file),
            "--service.drain-timeout-s",
            str(drain_timeout_s),
            "--serve.sets",
            json.dumps(sets),
            "--serve.options",
            json.dumps(options or {}),
            "--serve.concurrency",
            str(concurrency),
            *extra,
        ]
        self.proc = ManagedProcess(name, argv, root / "logs" / f"{name}.log", env=child_env())
        self.port = 0

    @property
    def served_by(self) -> str:
        """The replica id its replies carry."""
        return f"tool-service/{self.name}"

    def wait_ready(self, timeout_s: float = 30.0) -> ToolReplica:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if not self.proc.alive():
                raise RuntimeError(f"{self.name} exited with {self.proc.proc.returncode}:\n{self.proc.tail()}")
            if not self.port and self.port_file.exists() and (text := self.port_file.read_text().strip()):
                self.port = int(text)
            if self.port:
                try:
                    code, _ = self.get("/readyz")
                except OSError:
                    code = 0
                if code == 200:
                    return self
            time.sleep(0.05)
        raise RuntimeError(f"{self.name} not ready in {timeout_s}s:\n{self.proc.tail()}")

    def get(self, path: str) -> tuple[int, bytes]:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=5)
        try:
            conn.request("GET", path)
            resp = conn.getresponse()
            return resp.status, resp.read()
        finally:
            conn.close()

    def status(self) -> dict[str, Any]:
        _, body = self.get("/readyz")
        return json.loads(body)["status"]  # type: ignore[no-any-return]

    def kill(self) -> None:
        """SIGKILL: no drain, no goodbye; the server notices the dropped connection."""
        self.proc.send(signal.SIGKILL)
        self.proc.proc.wait(timeout=10)

    def stop(self, timeout_s: float = 15.0) -> int | None:
        return self.proc.stop(timeout_s)
