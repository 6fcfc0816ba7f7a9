"""Two weight-publishers, one per learner rank, against a real nats-server and a local object store.

Each rank's part of a version is staged into `<staging>/rank-<r>` (as the learner's rank actors
do); rank 0's publisher commits a signed manifest naming both parts and announces it. Asserted:
versions are announced in order and decode bit-exact (keyframes and deltas); a version whose
rank-1 part never arrives is abandoned after `part_timeout_s` (never announced, counted, its
rank-0 part dropped) and the next version, a delta on the last committed one, still decodes; a
rank-1 part staged after its version was abandoned is dropped by rank 1's publisher.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest
import torch
from test_weight_publisher import RUN, Announces, running, weights

from slipstream.bus import Bus, BusConfig, connect_bus
from slipstream.runtime.section import ServiceSection
from slipstream.stack import Server
from slipstream.store import LocalObjectStore
from slipstream.store.config import StoreConfig
from slipstream.trust import Keyring, generate_keypair
from slipstream.trust.config import TrustConfig
from slipstream.trust.signing import Check, check_manifest
from slipstream.weight_publisher.config import PublisherSection, WeightPublisherConfig
from slipstream.weight_publisher.parts import ABANDONED
from slipstream.weight_publisher.service import WeightPublisherService
from slipstream.weights import layout, load_version, manifest_key, read_manifest
from slipstream.weights.parts import fate, partition, split_parts
from slipstream.weights.staging import list_staged, rank_staging_dir, stage

pytestmark = pytest.mark.integration
RANKS = 2


def publisher(url: str, tmp_path: Path, rank: int) -> WeightPublisherService:
    return WeightPublisherService(
        WeightPublisherConfig(
            service=ServiceSection(run_id=RUN, replica=f"wp-{rank}"),
            bus=BusConfig(url=url),
            store=StoreConfig(root=str(tmp_path / "store")),
            publisher=PublisherSection(
                staging_dir=str(tmp_path / "staging"),
                poll_interval_s=0.02,
                shard_bytes=300,
                keyframe_every=3,
                ranks=RANKS,
                rank=rank,
                part_timeout_s=1.0,
            ),
            trust=TrustConfig(signing_key=str(tmp_path / "keys" / "signing.pem")),
        )
    )


NAMES = partition([(n, t.numel() * t.element_size()) for n, t in weights(0).items()], RANKS)


def stage_part(tmp_path: Path, version: int, rank: int) -> None:
    full = weights(version)
    stage(rank_staging_dir(tmp_path / "staging", rank, RANKS), version, {n: full[n] for n in NAMES[rank]})


def assert_decodes(store: LocalObjectStore, version: int) -> None:
    got = load_version(store, RUN, version)
    expected = weights(version)
    assert sorted(got) == sorted(expected)
    for name, t in expected.items():
        assert got[name].dtype == t.dtype and torch.equal(got[name], t), (version, name)


async def until(cond, timeout_s: float, what: str) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.02)


async def test_two_rank_publishers_commit_merged_versions_and_abandon_one_missing_a_part(
    nats_server: Server, tmp_path: Path
) -> None:
    key = generate_keypair(tmp_path / "keys" / "signing.pem")
    store = LocalObjectStore(tmp_path / "store")
    bus: Bus = await connect_bus(BusConfig(url=nats_server.url), name="ranks-test")
    await bus.ensure_streams()
    announces = Announces(bus)
    abandoned_before = ABANDONED.value(reason="missing")
    try:
        for v in range(3):
            for r in range(RANKS):
                stage_part(tmp_path, v, r)
        async with (
            running(publisher(nats_server.url, tmp_path, 0)) as (p0, _),
            running(publisher(nats_server.url, tmp_path, 1)) as (p1, _),
        ):
            got = await announces.wait(3)
            assert [a.policy_version for a in got] == [0, 1, 2]
            assert [a.keyframe for a in got] == [True, False, False]
            for v in range(3):
                m = read_manifest(store, manifest_key(RUN, v))
                assert [p.rank for p in m.parts] == [0, 1]
                assert check_manifest(m, Keyring.parse([key.public])) is Check.OK
                for part, (_, shards) in zip(m.parts, split_parts(m), strict=True):
                    assert all(f"/rank-{part.rank}/" in s.key for s in m.shards[shards])
                assert_decodes(store, v)
            await until(lambda: p1.publisher is not None and p1.publisher.latest_version == 2, 5, "rank 1 settled v2")
            assert all(not list_staged(rank_staging_dir(tmp_path / "staging", r, RANKS)) for r in range(RANKS))

            # Version 3: rank 1's part never comes. Rank 0 abandons it after part_timeout_s.
            stage_part(tmp_path, 3, 0)
            await until(lambda: fate(store, RUN, 3) == "abandoned", 10, "version 3 abandoned")
            await until(lambda: p0.abandoned == 1, 5, "rank 0 to drop its part of version 3")
            assert ABANDONED.value(reason="missing") == abandoned_before + 1
            assert not store.exists(manifest_key(RUN, 3))
            # Its part comes late: rank 1's publisher learns the fate and drops it too.
            stage_part(tmp_path, 3, 1)
            await until(lambda: p1.abandoned == 1, 10, "rank 1 to drop its late part of version 3")

            # Version 4 (a delta on 2, the last committed version) is committed and announced as usual.
            for r in range(RANKS):
                stage_part(tmp_path, 4, r)
            got = await announces.wait(4)
            assert [a.policy_version for a in got] == [0, 1, 2, 4]
            m4 = read_manifest(store, manifest_key(RUN, 4))
            assert (m4.keyframe, m4.base_version) == (False, 2)
            assert_decodes(store, 4)
            assert store.exists(layout.abandoned_key(RUN, 3))
            status = p0.status()
            assert (status["rank"], status["ranks"], status["abandoned"]) == (0, 2, 1)
        await asyncio.sleep(0.3)
        assert [a.policy_version for a in announces.got] == [0, 1, 2, 4]  # version 3: never, by anyone
    finally:
        await announces.close()
        await bus.close()
