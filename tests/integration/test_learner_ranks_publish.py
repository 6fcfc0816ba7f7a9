"""Weights published per rank, end to end in one process tree: a 2-rank learner and one publisher per rank.

The learner (a Ray driver with 2 FSDP2 rank actors) trains on scored groups from a real
nats-server; each rank actor stages its own part of every version into `<staging>/rank-<r>`, the
two weight-publishers store their parts and rank 0's commits and announces one signed manifest
naming both. A reader that follows every announce (as a rollout worker does: verified shards,
deltas applied onto the version it holds) ends bit-identical to the learner's gathered weights.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from scored_trajectories import group, publish
from test_learner_ranks_service import settings
from test_weight_publisher import Announces, running

from slipstream.bus import Bus, BusConfig, connect_bus
from slipstream.learner.config import LearnerConfig
from slipstream.learner.ranks import RankGroup
from slipstream.learner.service import LearnerService
from slipstream.learner.version_state import unique_state
from slipstream.runtime.config import resolve
from slipstream.runtime.section import ServiceSection
from slipstream.stack import Server
from slipstream.store import LocalObjectStore
from slipstream.store.config import StoreConfig
from slipstream.trust import Keyring, generate_keypair
from slipstream.trust.config import TrustConfig
from slipstream.trust.signing import Check, check_manifest
from slipstream.weight_publisher.config import PublisherSection, WeightPublisherConfig
from slipstream.weight_publisher.service import WeightPublisherService
from slipstream.weights import load_version, read_manifest
from slipstream.weights.tensors import as_bytes_view

pytestmark = [
    pytest.mark.integration,
    pytest.mark.slow,
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
    pytest.mark.filterwarnings("ignore::ResourceWarning"),
    pytest.mark.filterwarnings("ignore::FutureWarning"),
    pytest.mark.filterwarnings("ignore::UserWarning"),
]
RUN = "ranks"  # the run id `settings` gives the learner
STEPS = 3


@pytest.fixture
async def bus(nats_server: Server) -> AsyncIterator[Bus]:
    b = await connect_bus(BusConfig(url=nats_server.url), name="ranks-publish-test")
    await b.ensure_streams()
    yield b
    await b.close()


def publisher(url: str, tmp_path: Path, rank: int) -> WeightPublisherService:
    return WeightPublisherService(
        WeightPublisherConfig(
            service=ServiceSection(run_id=RUN, replica=f"wp-{rank}"),
            bus=BusConfig(url=url),
            store=StoreConfig(root=str(tmp_path / "store")),
            publisher=PublisherSection(
                staging_dir=str(tmp_path / "staging"),
                poll_interval_s=0.02,
                keyframe_every=2,
                ranks=2,
                rank=rank,
                part_timeout_s=60.0,
            ),
            trust=TrustConfig(signing_key=str(tmp_path / "signing.pem")),
        )
    )


@pytest.mark.timeout(300)
async def test_two_ranks_publish_their_parts_and_a_follower_ends_bit_identical(
    nats_server: Server, bus: Bus, tmp_path: Path
) -> None:
    key = generate_keypair(tmp_path / "signing.pem")
    await publish(bus, [s for g in [group(f"g{i}") for i in range(2 * STEPS)] for s in g])
    announces = Announces(bus)
    learner = LearnerService(
        resolve(
            LearnerConfig,
            environ={},
            overrides=settings(tmp_path, nats_server.url, ranks=2, max_steps=STEPS, weights_dtype="bfloat16"),
        )
    )
    store = LocalObjectStore(tmp_path / "store")
    try:
        async with running(publisher(nats_server.url, tmp_path, 0)), running(publisher(nats_server.url, tmp_path, 1)):
            await learner.setup()
            stop = asyncio.Event()
            run = asyncio.create_task(learner.run(stop))
            await asyncio.wait_for(asyncio.shield(run), 180)
            got = await announces.wait(STEPS + 1, timeout_s=60)
            assert [a.policy_version for a in got] == list(range(STEPS + 1))
            assert [a.keyframe for a in got] == [v % 2 == 0 for v in range(STEPS + 1)]
            # The follower: every announced version in order, each delta decoded onto the version held.
            held = None
            for a in got:
                m = read_manifest(store, a.manifest_key)
                assert check_manifest(m, Keyring.parse([key.public])) is Check.OK
                assert [p.rank for p in m.parts] == [0, 1]
                held = await asyncio.to_thread(
                    load_version,
                    store,
                    RUN,
                    a.policy_version,
                    have=None if held is None else (a.policy_version - 1, held),
                )
            assert held is not None
            assert isinstance(learner.ranks, RankGroup)
            gathered = learner.ranks.full_state()
            names = unique_state(learner.ranks.mirror)
            expected = {n: gathered[n].to("cpu") for n in names}
            expected = {n: t.bfloat16() if t.is_floating_point() else t for n, t in expected.items()}
            assert sorted(held) == sorted(expected)
            for name, t in expected.items():
                assert held[name].dtype == t.dtype and bytes(as_bytes_view(held[name])) == bytes(as_bytes_view(t)), name
            stop.set()
            await run
    finally:
        await announces.close()
        await learner.close()
