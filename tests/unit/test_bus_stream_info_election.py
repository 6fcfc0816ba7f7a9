"""`NatsBus.stream_info` in a clustered JetStream: while the meta group elects a leader (a node
killed, a host cut off, a partition healing) the server answers 503 "temporarily unavailable"; an
inspection waits that out (STREAM_INFO_WAIT_S) instead of failing the caller, and names the stream
when it gives up. Driven here by a stand-in JetStream context that answers 503 a given number of
times; tests/integration/test_hosts_cluster.py meets the real election."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import nats.js.errors
import pytest

from slipstream.bus import BusConfig, BusError
from slipstream.bus import jetstream as js_mod

pytestmark = pytest.mark.unit


class ElectingJetStream:
    """Answers 503 to the first `unavailable` info requests, then a one-node stream's info."""

    def __init__(self, unavailable: int) -> None:
        self.unavailable = unavailable
        self.calls = 0

    def _maybe_503(self) -> None:
        self.calls += 1
        if self.calls <= self.unavailable:
            raise nats.js.errors.ServiceUnavailableError(code=503, err_code=10008, description="temporarily")

    async def stream_info(self, name: str) -> Any:
        self._maybe_503()
        state = SimpleNamespace(messages=3, bytes=30, first_seq=1, last_seq=3, consumer_count=0)
        return SimpleNamespace(state=state, cluster=None)

    async def consumers_info(self, name: str) -> list[Any]:
        self._maybe_503()
        return []


def _bus(js: ElectingJetStream) -> js_mod.NatsBus:
    bus = js_mod.NatsBus(BusConfig(url="nats://127.0.0.1:1"), "test", js_mod.Topology())  # never connected
    bus._js = js  # type: ignore[assignment]
    return bus


async def test_an_election_is_waited_out() -> None:
    js = ElectingJetStream(unavailable=3)
    info = await _bus(js).stream_info("TRAJ")
    assert info["last_seq"] == 3 and info["leader"] == "" and js.calls == 5


async def test_an_election_that_outlasts_the_wait_names_the_stream(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(js_mod, "STREAM_INFO_WAIT_S", 0.3)
    with pytest.raises(BusError, match="stream 'TRAJ': JetStream still unavailable"):
        await _bus(ElectingJetStream(unavailable=10**6)).stream_info("TRAJ")
