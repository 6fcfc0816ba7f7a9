"""The weight-publisher service against a real nats-server and a local object store.

Versions are staged exactly as the learner stages them (`slipstream.weights.staging.stage`); the
service runs in-process and is observed from outside: manifests and shards in the store (verified
by `fetch_version`), announces on weights.announce (read with a fan-out subscription from the
start of the stream), staged files gone. The restart case stores a version without announcing it,
as a publisher killed between the two would, and checks the next publisher announces it.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import pytest
import torch

from slipstream.bus import Bus, BusConfig, connect_bus
from slipstream.runtime.section import ServiceSection
from slipstream.schemas import WeightAnnounce
from slipstream.schemas.subjects import WEIGHTS_ANNOUNCE
from slipstream.stack import Server
from slipstream.store import ObjectStore, setup_store
from slipstream.store.config import StoreConfig
from slipstream.weight_publisher.config import PublisherSection, WeightPublisherConfig
from slipstream.weight_publisher.publisher import ANNOUNCED, BYTES
from slipstream.weight_publisher.service import WeightPublisherService
from slipstream.weights import fetch_version, manifest_key, publish_snapshot, read_manifest
from slipstream.weights.staging import stage, staged_path

pytestmark = pytest.mark.integration
RUN = "wp-test"


def weights(version: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(version)
    return {
        "embed.weight": torch.randn(16, 8, generator=g).to(torch.bfloat16),
        "layer.0.w": torch.randn(8, 8, generator=g),
        "layer.0.b": torch.full((8,), float(version)),
        "step": torch.tensor([version], dtype=torch.int64),
    }


def config(url: str, tmp_path: Path) -> WeightPublisherConfig:
    return WeightPublisherConfig(
        service=ServiceSection(run_id=RUN, replica="wp-0"),
        bus=BusConfig(url=url),
        store=StoreConfig(root=str(tmp_path / "store")),
        # Small shards: every version is cut into several, uploaded in parallel.
        publisher=PublisherSection(staging_dir=str(tmp_path / "staging"), poll_interval_s=0.02, shard_bytes=300),
    )


class Announces:
    """Every weights.announce from the start of the stream, collected in the background."""

    def __init__(self, bus: Bus) -> None:
        self.got: list[WeightAnnounce] = []
        self._sub = bus.subscribe(WEIGHTS_ANNOUNCE, WeightAnnounce, deliver="all")
        self._task = asyncio.create_task(self._collect())

    async def _collect(self) -> None:
        async for d in self._sub:
            self.got.append(d.msg)

    async def wait(self, n: int, timeout_s: float = 15.0) -> list[WeightAnnounce]:
        deadline = time.monotonic() + timeout_s
        while len(self.got) < n and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        assert len(self.got) >= n, f"got {len(self.got)} announces, expected {n}: {self.got}"
        return self.got

    async def close(self) -> None:
        self._task.cancel()
        await asyncio.gather(self._task, return_exceptions=True)
        await self._sub.close()


@asynccontextmanager
async def running(svc: WeightPublisherService) -> AsyncIterator[tuple[WeightPublisherService, asyncio.Event]]:
    await svc.setup()
    stop = asyncio.Event()
    task = asyncio.create_task(svc.run(stop))
    try:
        yield svc, stop
    finally:
        stop.set()
        await asyncio.wait_for(task, 15)
        await svc.close()


def assert_stored(store: ObjectStore, version: int) -> None:
    manifest, tensors = fetch_version(store, manifest_key(RUN, version))  # verifies every shard's sha256
    assert manifest.policy_version == version
    # keyframes stand alone; deltas apply onto the previous version (keyframe every 10 by default)
    assert manifest.base_version == (None if manifest.keyframe else version - 1)
    assert len(manifest.shards) > 1
    expected = weights(version)
    assert sorted(tensors) == sorted(expected)
    for name, t in expected.items():
        assert tensors[name].dtype == t.dtype and torch.equal(tensors[name], t), name


async def test_staged_versions_are_stored_announced_in_order_and_removed(nats_server: Server, tmp_path: Path) -> None:
    cfg = config(nats_server.url, tmp_path)
    staging = Path(cfg.publisher.staging_dir)
    for v in (0, 1, 2):
        stage(staging, v, weights(v), step_finished_at=1000.0 + v)
    bus = await connect_bus(BusConfig(url=nats_server.url), name="test")
    await bus.ensure_streams()
    announces = Announces(bus)
    bytes_before = BYTES.value()
    store = setup_store(cfg.store)
    try:
        async with running(WeightPublisherService(cfg)) as (svc, _):
            got = await announces.wait(3)
            assert [a.policy_version for a in got] == [0, 1, 2]
            # A version staged while it runs is picked up too.
            stage(staging, 3, weights(3), step_finished_at=1003.0)
            got = await announces.wait(4)
            assert svc.status()["latest_version"] == 3 and svc.status()["published"] == 4
        assert [a.policy_version for a in got] == [0, 1, 2, 3]
        for a in got:
            v = a.policy_version
            assert a.manifest_key == manifest_key(RUN, v) and a.run_id == RUN
            assert a.keyframe is (v == 0) and a.base_version == (None if v == 0 else v - 1)
            assert a.step_finished_at == 1000.0 + v and a.announced_at >= a.step_finished_at
            assert_stored(store, v)
        manifests = [k for k in store.list(f"weights/{RUN}/") if k.endswith("manifest.json")]
        assert manifests == [manifest_key(RUN, v) for v in range(4)]
        assert list(staging.iterdir()) == []  # every staged file removed once announced
        stored = sum(read_manifest(store, manifest_key(RUN, v)).stored_bytes for v in range(4))
        assert BYTES.value() - bytes_before == stored
    finally:
        await announces.close()
        await bus.close()


async def test_restart_reannounces_a_stored_version_and_drains_staged_ones(nats_server: Server, tmp_path: Path) -> None:
    cfg = config(nats_server.url, tmp_path)
    staging = Path(cfg.publisher.staging_dir)
    store = setup_store(cfg.store)
    # A previous publisher stored version 5 (manifest committed) and died before announcing it.
    key, committed = publish_snapshot(
        store, run_id=RUN, version=5, tensors=weights(5), step_finished_at=1005.0, shard_bytes=300
    )
    stage(staging, 5, weights(5), step_finished_at=1005.0)
    stage(staging, 6, weights(6), step_finished_at=1006.0)
    bus = await connect_bus(BusConfig(url=nats_server.url), name="test")
    await bus.ensure_streams()
    announces = Announces(bus)
    existing_before = ANNOUNCED.value(stored="existing")
    try:
        async with running(WeightPublisherService(cfg)) as (_svc, stop):
            got = await announces.wait(2)
            assert [a.policy_version for a in got] == [5, 6]
            # Staged and stopped at once: the drain still publishes it before `run` returns.
            stage(staging, 7, weights(7), step_finished_at=1007.0)
            stop.set()
        assert not staged_path(staging, 7).exists()
        got = await announces.wait(3)
        assert [a.policy_version for a in got] == [5, 6, 7]
        assert got[0].manifest_key == key
        # The committed manifest was not rewritten (versions are write-once).
        assert read_manifest(store, key).created_at == committed.created_at
        assert ANNOUNCED.value(stored="existing") - existing_before == 1
        for v in (5, 6, 7):
            assert_stored(store, v)
        assert list(staging.iterdir()) == []
    finally:
        await announces.close()
        await bus.close()
