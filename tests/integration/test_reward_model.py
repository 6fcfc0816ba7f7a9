"""The reward-model service against a real nats-server: scores, components, dead letters, counts, replicas.

The service runs in-process (its Service class, setup -> run(stop) -> close, as the runtime
drives it); the test talks to it only over NATS: raw trajectories (v1 producers) and episodes in
on traj.raw.<env>, scored episodes read back from traj.scored.<env> on the learner's durable,
dead letters from dlq.TRAJ_RAW; by-reference bodies lie in a local object store.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path

import pytest

from slipstream.bus import Bus, BusConfig, connect_bus
from slipstream.reward_model.config import RewardModelConfig, RewardSection
from slipstream.reward_model.service import PARSE_FAILURES, SCORED, RewardModelService
from slipstream.runtime.section import ServiceSection
from slipstream.schemas import (
    Episode,
    PolicySegment,
    Sample,
    ScoredEpisode,
    ToolEvent,
    Trajectory,
    decode,
    pack_floats,
    pack_ids,
    pack_mask,
)
from slipstream.stack import Server
from slipstream.store import LocalObjectStore
from slipstream.store.config import StoreConfig
from slipstream.store.episodes import HEADROOM, load_scored, offload

pytestmark = pytest.mark.integration


def traj(tid: str, completion: str, *, env: str = "arith", reference: str = "8", split: str = "train") -> Trajectory:
    return Trajectory(
        trajectory_id=tid,
        task_id=f"t:{tid}",
        env=env,
        group_id=f"t:{tid}/g",
        completion_text=completion,
        reference=reference,
        split=split,
    )


def config(url: str, tmp_path: Path, replica: str, **bus: object) -> RewardModelConfig:
    return RewardModelConfig(
        service=ServiceSection(run_id="test", replica=replica),
        bus=BusConfig(url=url, fetch_timeout_s=0.2, **bus),  # type: ignore[arg-type]
        store=StoreConfig(root=str(tmp_path / "store")),
        reward=RewardSection(concurrency=4),
    )


@asynccontextmanager
async def running(svc: RewardModelService) -> AsyncIterator[RewardModelService]:
    await svc.setup()
    stop = asyncio.Event()
    task = asyncio.create_task(svc.run(stop))
    try:
        yield svc
    finally:
        stop.set()
        await asyncio.wait_for(task, 10)
        await svc.close()


async def until(cond: Callable[[], Awaitable[bool]], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if await cond():
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")


async def read_scored(bus: Bus, n: int, timeout_s: float = 15.0) -> list[ScoredEpisode]:
    consumer = await bus.consumer("learner", ScoredEpisode)
    got: list[ScoredEpisode] = []
    deadline = time.monotonic() + timeout_s
    while len(got) < n and time.monotonic() < deadline:
        for d in await consumer.fetch(batch=64, timeout=0.5):
            got.append(d.msg)
            await d.ack()
    await consumer.close()
    return got


async def messages(bus: Bus, stream: str) -> int:
    return int((await bus.stream_info(stream))["messages"])


async def test_scores_components_dead_letters_and_counts(nats_server: Server, tmp_path: Path) -> None:
    bus = await connect_bus(BusConfig(url=nats_server.url), name="test")
    await bus.ensure_streams()
    parse_before = PARSE_FAILURES.value(env="arith")
    scored_before = SCORED.value(env="arith")
    cases = {
        "right": (traj("right", "8\n"), 1.1, {"correct": 1.0, "format": 0.1}, True),
        "trailing": (traj("trailing", "8 apples"), 1.0, {"correct": 1.0, "format": 0.0}, True),
        "wrong": (traj("wrong", "7"), 0.1, {"correct": 0.0, "format": 0.1}, False),
        "garbage": (traj("garbage", "eight"), 0.0, {"correct": 0.0, "format": 0.0}, False),
        "empty": (traj("empty", ""), 0.0, {"correct": 0.0, "format": 0.0}, False),
        "negative": (traj("negative", "-3\n", reference="-3"), 1.1, {"correct": 1.0, "format": 0.1}, True),
    }
    try:
        async with running(RewardModelService(config(nats_server.url, tmp_path, "rm-0"))) as svc:
            for t, *_ in cases.values():
                await bus.publish(f"traj.raw.{t.env}", t, msg_id=t.trajectory_id)
            unknown = traj("unknown", "8", env="nope")
            bad_split = traj("badsplit", "8", split="validation")
            await bus.publish("traj.raw.nope", unknown, msg_id=unknown.trajectory_id)
            await bus.publish("traj.raw.arith", bad_split, msg_id=bad_split.trajectory_id)
            # The same trajectory again under a new raw msg id (a worker retry that was not deduped):
            # its scored copy reuses msg_id = trajectory_id, so the learner still sees it once.
            await bus.publish("traj.raw.arith", cases["right"][0], msg_id="retry-of-right")

            scored = await read_scored(bus, len(cases))
            # A raw message is acked only after its scored copy was stored: an empty TRAJ_RAW means all done.
            await until(lambda: _zero(bus, "TRAJ_RAW"), 10, "TRAJ_RAW empty")
            assert svc.status()["scored"] == len(cases) + 1  # the retry was scored too, and deduped on publish
            assert svc.status()["dead_lettered"] == 2
            assert svc.status()["parse_failures"] == 2

        by_id = {s.episode.episode_id: s for s in scored}
        assert sorted(by_id) == sorted(cases) and len(scored) == len(cases)
        for name, (_, reward, components, correct) in cases.items():
            s = by_id[name]
            assert s.reward == pytest.approx(reward), name
            assert s.components == pytest.approx(components), name
            assert s.correct is correct, name
            assert s.scorer_version == "arith@1"
            assert s.scored_at > 0
            assert s.episode.group_id == f"t:{name}/g"  # the v1 trajectory arrives as a one-sample episode
            assert len(s.episode.samples) == 1
        assert await messages(bus, "TRAJ_SCORED") == 0  # the test's consumer acked them all, no extra copy

        letters = {decode(dl.data, Trajectory).trajectory_id: dl for dl in await bus.dead_letters("TRAJ_RAW")}
        assert sorted(letters) == ["badsplit", "unknown"]
        assert letters["unknown"].reason.startswith("unknown_env: unknown environment 'nope'")
        assert letters["badsplit"].reason.startswith("bad_split:") and "'validation'" in letters["badsplit"].reason
        assert letters["unknown"].subject == "traj.raw.nope" and letters["unknown"].consumer == "reward-model"
        assert letters["unknown"].headers["Slipstream-Dlq-Msg-Id"] == "unknown"  # the original msg id is kept

        assert PARSE_FAILURES.value(env="arith") - parse_before == 2
        assert SCORED.value(env="arith") - scored_before == len(cases) + 1
    finally:
        await bus.close()


async def _zero(bus: Bus, stream: str) -> bool:
    return await messages(bus, stream) == 0


async def test_replicas_share_the_backlog(nats_server: Server, tmp_path: Path) -> None:
    bus = await connect_bus(BusConfig(url=nats_server.url), name="test")
    await bus.ensure_streams()
    n = 40
    try:
        a = RewardModelService(config(nats_server.url, tmp_path, "rm-a", fetch_batch=2))
        b = RewardModelService(config(nats_server.url, tmp_path, "rm-b", fetch_batch=2))
        async with running(a), running(b):
            # Both are waiting on the shared durable before the backlog arrives.
            for i in range(n):
                t = traj(f"t{i:03d}", str(i % 10), reference=str(i % 5))
                await bus.publish("traj.raw.arith", t, msg_id=t.trajectory_id)
            scored = await read_scored(bus, n)
            await until(lambda: _zero(bus, "TRAJ_RAW"), 10, "TRAJ_RAW empty")
        ids = [s.episode.episode_id for s in scored]
        assert len(ids) == n and len(set(ids)) == n
        assert sum(s.correct for s in scored) == sum(1 for i in range(n) if i % 10 == i % 5)
        # Both replicas took part, and together they scored each trajectory once.
        assert a.status()["scored"] > 0 and b.status()["scored"] > 0
        assert a.status()["scored"] + b.status()["scored"] == n
    finally:
        await bus.close()


def agentic(eid: str, final_text: str, **fields: object) -> Episode:
    """Two samples (a root and a summary branch) and a tool log; the answer is in final_text."""
    root = Sample(
        sample_id=f"{eid}/0",
        prompt_len=2,
        token_ids=pack_ids([1, 2] + [3] * 3000),  # ~12 KB of ids: well over the forced limit below
        logprobs=pack_floats([-0.5] * 3000),
        loss_mask=pack_mask([1] * 3000),
        segments=[PolicySegment(0, 3000)],
    )
    branch = Sample(
        sample_id=f"{eid}/1",
        role="summary",
        prompt_len=2,
        token_ids=pack_ids([1, 2, 4]),
        logprobs=pack_floats([-0.5]),
        loss_mask=pack_mask([1]),
        segments=[PolicySegment(0, 1)],
        branch_of=f"{eid}/0",
        edit="summary",
    )
    return Episode(
        episode_id=eid,
        task_id=f"t:{eid}",
        env="arith",
        run_id="test",
        group_id=f"t:{eid}/g",
        reference="8",
        samples=[root, branch],
        tool_log=[ToolEvent(sample_id=f"{eid}/0", name="calc", arguments='{"x": "4+4"}', result="8")],
        final_text=final_text,
        **fields,  # type: ignore[arg-type]
    )


async def test_episodes_by_reference_and_infra_errors(nats_server: Server, tmp_path: Path) -> None:
    bus = await connect_bus(BusConfig(url=nats_server.url), name="test")
    await bus.ensure_streams()
    store = LocalObjectStore(tmp_path / "store")
    big = agentic("big", "8\n")
    stub = offload(store, big, limit=HEADROOM + 1024)  # forced by reference: its body is ~12 KB
    assert stub.is_stub() and stub.body_ref is not None and stub.body_ref.n_samples == 2
    inline = agentic("inline", "7")
    inline.samples[0] = inline.samples[1]  # small: goes inline
    inline.samples = inline.samples[:1]
    spoiled = agentic("spoiled", "8\n", infra_error="calculator backend unreachable")
    spoiled.samples = spoiled.samples[1:]
    lost = offload(store, agentic("lost", "8\n"), limit=HEADROOM + 1024)
    assert lost.body_ref is not None
    store.delete(lost.body_ref.key)  # its body is gone: can never be scored
    try:
        async with running(RewardModelService(config(nats_server.url, tmp_path, "rm-e"))) as svc:
            for e in (stub, inline, spoiled, lost):
                await bus.publish("traj.raw.arith", e, msg_id=e.episode_id)
            scored = {s.episode.episode_id: s for s in await read_scored(bus, 3)}
            await until(lambda: _zero(bus, "TRAJ_RAW"), 10, "TRAJ_RAW empty")
            assert svc.status()["scored"] == 2 and svc.status()["infra_errors"] == 1
            assert svc.status()["dead_lettered"] == 1
        assert sorted(scored) == ["big", "inline", "spoiled"]
        # The by-reference episode was scored on its body and passed on as the same stub.
        assert scored["big"].reward == pytest.approx(1.1) and scored["big"].correct
        assert scored["big"].episode == stub
        assert load_scored(store, scored["big"]).episode == big
        assert scored["inline"].reward == pytest.approx(0.1) and scored["inline"].episode == inline
        # Infrastructure failure: passed on unjudged with reward 0, for the learner to drop.
        assert scored["spoiled"].reward == 0.0 and scored["spoiled"].components == {}
        assert scored["spoiled"].episode.infra_error == "calculator backend unreachable"
        (letter,) = await bus.dead_letters("TRAJ_RAW")
        assert decode(letter.data, Episode).episode_id == "lost" and letter.reason.startswith("bad_body:")
    finally:
        await bus.close()
