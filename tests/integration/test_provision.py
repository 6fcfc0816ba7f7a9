"""`python -m slipstream.bus.provision` creates the whole topology (the deploy Job's command)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from slipstream.bus import BusConfig, connect_bus
from slipstream.schemas.subjects import STREAMS
from slipstream.stack import Server, free_port

pytestmark = pytest.mark.integration


async def test_provision_creates_every_stream_and_durable(nats_server: Server) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "slipstream.bus.provision", "--bus.url", nats_server.url],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    bus = await connect_bus(BusConfig(url=nats_server.url), name="check")
    try:
        for spec in STREAMS:
            info = await bus.stream_info(spec.name)
            assert set(info["consumers"]) >= {c.durable for c in spec.consumers}
    finally:
        await bus.close()


def test_provision_fails_clearly_without_a_server() -> None:
    url = f"nats://127.0.0.1:{free_port()}"
    out = subprocess.run(
        [sys.executable, "-m", "slipstream.bus.provision", "--bus.url", url, "--bus.connect-budget-s", "1"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 1
    assert url in out.stderr
