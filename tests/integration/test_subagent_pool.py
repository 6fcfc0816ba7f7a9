"""The sub-agent pool against a real nats-server, a local object store and the tiny model.

Pool replicas are `RolloutWorkerService`s with `[pool] subagents = true`, driven in-process by the
real runtime (as test_rollout_worker.py drives workers):

- pinned: a replica pinned to version 1 loads exactly version 1 from the store; while versions 2
  and 3 are announced it notes them (announced 3, 2 ignored as pinned) and its engine stays at
  version 1 with the same weight bytes (sha256 over every parameter);
- idempotent: the same request id sent twice (two messages) is played once; the second answer is
  the first one, replayed from the worker's memory;
- local: a task worker's frozen copy ([subagents] transport = "local") stays at version 0, bytes
  and all, while the live engine applies version 1; its engine is built by the first call;
- service path: a task worker with `[subagents] transport = "nats"` takes a task for the
  orchestrator env and publishes its episodes with every child merged in, frozen at the pin;
- wrong pin: an orchestrator that holds its sub-agents to version 0 rejects every reply of the
  pool pinned to version 1: each child becomes an infra error naming both versions (the episode
  is masked, no child sample merged), and the client counts them;
- unavailable: with no replica, a request is sent again after its timeout, then answered with an
  error (the parent masks the episode);
- spread: 2 replicas (2 requests in flight each) and an orchestrator-side harness whose episode
  spawns 8 frozen `lookup` sub-agents concurrently through `NatsSubagents`: both replicas serve
  some (worker ids in the replies), every child sample in the parent episode is trainable=False,
  role 'subagent', under its agent id and sampled at the pinned version, the root at its own.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any, ClassVar

import msgspec
import pytest
import torch

from slipstream.bus import Bus, BusConfig, connect_bus
from slipstream.engine import ByteTokenizer, SamplingParams
from slipstream.engine.interface import GenerationRequest
from slipstream.engine.presets import build_tiny
from slipstream.engine.source import ModelSource
from slipstream.envs import EpisodeContext, Outcome, Score, TaskSpec, get_env, registry
from slipstream.envs.base import Environment, Problem
from slipstream.harness import rollout_episodes
from slipstream.rollout_worker.config import PoolSection, RolloutWorkerConfig, SubagentsSection, WorkerSection
from slipstream.rollout_worker.follower import engine_digest
from slipstream.rollout_worker.service import RolloutWorkerService
from slipstream.rollout_worker.subagent_client import NatsSubagents
from slipstream.runtime.lifecycle import Runtime
from slipstream.runtime.section import ServiceSection
from slipstream.schemas import (
    Episode,
    SubagentReply,
    SubagentRequest,
    SubagentSampling,
    Task,
    WeightAnnounce,
    decode,
)
from slipstream.schemas.subagents import REPLY_TO_HEADER
from slipstream.schemas.subjects import WEIGHTS_ANNOUNCE, subagent_subject, tasks_subject
from slipstream.stack import Server
from slipstream.store import LocalObjectStore, StoreConfig
from slipstream.supervised import ScriptedEngine
from slipstream.weights import publish_snapshot

pytestmark = pytest.mark.integration

RUN = "pool-itest"
PIN = 1
N_CHILDREN = 8
TOK = ByteTokenizer()
LOOKUP = get_env("lookup")


@pytest.fixture(autouse=True)
def _one_thread() -> None:
    torch.set_num_threads(1)


@pytest.fixture
async def bus(nats_server: Server) -> AsyncIterator[Bus]:
    b = await connect_bus(BusConfig(url=nats_server.url, stream_storage="memory"), name="test")
    await b.ensure_streams()
    yield b
    await b.close()


def _version(v: int) -> dict[str, torch.Tensor]:
    """Version v of the tiny model: its seed-0 weights shifted by 0.01 * v (v = 0 is [model] itself)."""
    model, _ = build_tiny("tiny", seed=0)
    return {k: t.detach() + 0.01 * v for k, t in model.state_dict().items()}


async def _store_version(store: LocalObjectStore, v: int) -> str:
    key, _ = await asyncio.to_thread(publish_snapshot, store, run_id=RUN, version=v, tensors=_version(v))
    return key


async def _announce(bus: Bus, store: LocalObjectStore, v: int) -> None:
    key = await _store_version(store, v)
    announce = WeightAnnounce(policy_version=v, manifest_key=key, run_id=RUN, announced_at=time.time())
    await bus.publish(WEIGHTS_ANNOUNCE, announce, msg_id=f"{RUN}:{v}")


def _config(nats_url: str, store_root: Path, replica: str, *, max_in_flight: int) -> RolloutWorkerConfig:
    return RolloutWorkerConfig(
        service=ServiceSection(run_id=RUN, replica=replica, drain_timeout_s=5.0),
        bus=BusConfig(url=nats_url, stream_storage="memory", fetch_timeout_s=0.2),
        store=StoreConfig(type="local", root=str(store_root)),
        model=ModelSource(preset="tiny", seed=0, threads=1),
        worker=WorkerSection(max_batch=8, max_tokens=16, weights_digest=True),
        pool=PoolSection(subagents=True, pin_version=PIN, max_in_flight=max_in_flight, pin_wait_s=5.0),
    )


async def _until(predicate: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out after {timeout}s waiting for {what}"
        await asyncio.sleep(0.02)


@pytest.fixture
async def pool(
    nats_server: Server, tmp_path: Path, request: pytest.FixtureRequest
) -> AsyncIterator[list[RolloutWorkerService]]:
    """`request.param` pool replicas pinned to version PIN (stored first), ready."""
    replicas, max_in_flight = request.param
    await _store_version(LocalObjectStore(str(tmp_path / "store")), PIN)
    services = [
        RolloutWorkerService(_config(nats_server.url, tmp_path / "store", f"p{i}", max_in_flight=max_in_flight))
        for i in range(replicas)
    ]
    runtimes = [Runtime(s, s.cfg.service) for s in services]
    jobs = [asyncio.create_task(r.run(handle_signals=False)) for r in runtimes]
    try:
        for r in runtimes:
            await _until(lambda r=r: r.readiness()[0], 60.0, "a pool replica to become ready")  # type: ignore[misc]
        yield services
    finally:
        for r in runtimes:
            r.request_stop("test done")
        codes = await asyncio.wait_for(asyncio.gather(*jobs), 30.0)
        assert codes == [0] * len(codes)


@pytest.mark.parametrize("pool", [(1, 4)], indirect=True)
async def test_a_pinned_worker_never_applies_a_later_version(
    pool: list[RolloutWorkerService], bus: Bus, tmp_path: Path
) -> None:
    (service,) = pool
    engine, follower = service.engine, service.follower
    assert engine is not None and follower is not None
    assert engine.policy_version == PIN
    pinned = _version(PIN)
    params = dict(engine.named_parameters())
    assert all(torch.equal(params[k], pinned[k]) for k in params if k in pinned)
    digest = await asyncio.to_thread(engine_digest, engine)
    assert follower.weights_digest == digest

    store = LocalObjectStore(str(tmp_path / "store"))
    for v in (PIN + 1, PIN + 2):
        await _announce(bus, store, v)
    await _until(lambda: follower.status()["announced_version"] == PIN + 2, 20.0, "the announces to be seen")
    await asyncio.sleep(0.5)  # room for an (illegal) apply to land
    status = service.status()
    assert status["policy_version"] == PIN and engine.policy_version == PIN
    assert status["weights"]["pinned"] and status["weights"]["pinned_ignored"] == 2
    assert status["weights"]["applied_versions"] == [PIN]
    assert await asyncio.to_thread(engine_digest, engine) == digest


@pytest.mark.parametrize("pool", [(1, 4)], indirect=True)
async def test_the_same_request_id_is_played_once(pool: list[RolloutWorkerService], bus: Bus) -> None:
    (service,) = pool
    assert service.pool is not None
    task = LOOKUP.generate("train", 1, seed=5)[0]
    request = SubagentRequest(
        request_id="ep/0/sub0",
        run_id=RUN,
        agent_id="sub0",
        env="lookup",
        task_id=task.task_id,
        prompt=task.prompt,
        reference=task.reference,
        split="train",
        sampling=SubagentSampling(max_tokens=16),
        seed=3,
    )
    nc = bus.nc  # type: ignore[attr-defined]
    replies: list[SubagentReply] = []

    async def on_reply(msg: Any) -> None:
        replies.append(decode(msg.data, SubagentReply))

    inbox = nc.new_inbox()
    sub = await nc.subscribe(inbox, cb=on_reply)
    try:
        for attempt in (1, 2):
            again = msgspec.structs.replace(request, attempt=attempt)
            await bus.publish(
                subagent_subject("lookup"),
                again,
                msg_id=f"{request.request_id}#{attempt}",
                headers={REPLY_TO_HEADER: inbox},
            )
        await _until(lambda: len(replies) == 2, 30.0, "two replies")
    finally:
        await sub.unsubscribe()
    assert sorted(r.replayed for r in replies) == [False, True]
    first, second = replies if not replies[0].replayed else replies[::-1]
    assert first.error == "" and first.samples and second.samples == first.samples
    assert first.policy_version == PIN and first.worker_id == "rollout-worker/p0"
    assert service.pool.outcomes["ok"] == 1 and service.pool.outcomes["replayed"] == 1


class _Orchestrator(Environment[msgspec.Struct]):
    """One turn, then N_CHILDREN `lookup` sub-agents at once; their answers come back as one observation.

    Registered only inside the test that runs a worker on it (other tests list the registry)."""

    name: ClassVar[str] = "t-pool-orchestrator"

    class Options(msgspec.Struct, frozen=True):
        pass

    components: ClassVar[tuple[str, ...]] = ("correct",)
    children: ClassVar[list[TaskSpec]] = LOOKUP.generate("train", N_CHILDREN, seed=9)

    def sample(self, rng: Any) -> Problem:
        return Problem(key="k", prompt="plan:", reference="")

    def grade(self, task: TaskSpec, completion: str) -> Score:
        return Score.of({"correct": 0.0}, correct=False, parse_ok=True, reason="")

    async def run(self, ctx: EpisodeContext) -> Outcome:
        root = ctx.open(ctx.task.prompt)
        await ctx.generate(root, max_tokens=8)
        outcomes = await asyncio.gather(
            *(ctx.spawn(LOOKUP, t, agent_id=f"sub{i}") for i, t in enumerate(self.children))
        )
        ctx.observe(root, "|".join(o.finish_reason for o in outcomes))
        last = await ctx.generate(root, max_tokens=8)
        return Outcome(final_text=root.completion_text(), finish_reason=last.finish_reason)


@pytest.mark.parametrize("pool", [(2, 2)], indirect=True)
async def test_two_pool_replicas_share_concurrent_subagents(pool: list[RolloutWorkerService], bus: Bus) -> None:
    client = NatsSubagents(bus, timeout_s=60.0, retries=1, caller="orchestrator", pin_version=PIN)
    env = _Orchestrator()
    task = env.generate("train", 1, seed=0)[0]
    live = ScriptedEngine(TOK, lambda _r, _c: "go\n", policy_version=7)  # the orchestrator's own, newer weights
    (episode,) = await rollout_episodes(
        live,
        TOK,
        env,
        task,
        group_size=1,
        params=SamplingParams(temperature=1.0, max_tokens=16),
        run_id=RUN,
        worker_id="orchestrator",
        subagents=client,
    )
    assert episode.infra_error == "" and client.stats["unavailable"] == 0
    root, *children = episode.samples
    assert root.trainable and root.versions() == [7]
    assert sorted({s.agent_id for s in children}) == sorted(f"sub{i}" for i in range(N_CHILDREN))
    for s in children:
        assert (s.role, s.trainable) == ("subagent", False), s.sample_id
        assert s.versions() == [PIN], (s.sample_id, s.segments)
        assert s.n_sampled() > 0
    assert [s.sample_id for s in episode.samples] == [episode.episode_id] + [
        f"{episode.episode_id}/s{i}" for i in range(1, len(episode.samples))
    ]
    assert episode.counts["subagents"] == N_CHILDREN
    # Both replicas served, each at the pinned version, and together they served every child once.
    assert set(client.served_by) == {"rollout-worker/p0", "rollout-worker/p1"}, client.served_by
    assert all(n >= 1 for n in client.served_by.values()) and sum(client.served_by.values()) == N_CHILDREN
    assert dict(client.versions) == {PIN: N_CHILDREN}
    served = [s.pool.outcomes["ok"] for s in pool if s.pool is not None]
    assert sorted(served) == sorted(client.served_by.values())


@pytest.mark.parametrize("pool", [(1, 4)], indirect=True)
async def test_a_reply_from_a_pool_pinned_to_another_version_is_rejected_and_counted(
    pool: list[RolloutWorkerService], bus: Bus
) -> None:
    client = NatsSubagents(bus, timeout_s=60.0, retries=1, caller="orchestrator", pin_version=0)
    env = _Orchestrator()
    task = env.generate("train", 1, seed=0)[0]
    live = ScriptedEngine(TOK, lambda _r, _c: "go\n", policy_version=0)
    (episode,) = await rollout_episodes(
        live,
        TOK,
        env,
        task,
        group_size=1,
        params=SamplingParams(temperature=1.0, max_tokens=16),
        run_id=RUN,
        worker_id="orchestrator",
        subagents=client,
    )
    # The pool played every child (at its pin, 1); the orchestrator refused each reply.
    assert sum(s.pool.outcomes["ok"] for s in pool if s.pool is not None) == N_CHILDREN
    assert client.stats["wrong_version"] == N_CHILDREN and client.stats["errors"] == 0
    assert dict(client.versions) == {PIN: N_CHILDREN}
    assert [s.role for s in episode.samples] == ["policy"]  # no child sample merged: nothing trains on them
    assert episode.counts["infra_error"] == N_CHILDREN and episode.counts["subagent_errors"] == N_CHILDREN
    assert "version(s) [1]" in episode.infra_error and "pinned to version 0" in episode.infra_error
    assert episode.infra_error.startswith("subagent: sub-agent pool worker rollout-worker/p0")


async def test_a_task_worker_keeps_a_frozen_local_copy_that_announces_never_touch(
    nats_server: Server, bus: Bus, tmp_path: Path
) -> None:
    """`[subagents] transport = "local"` (the default): the frozen engine stays at its first version."""
    cfg = msgspec.structs.replace(
        _config(nats_server.url, tmp_path / "store", "w0", max_in_flight=1), pool=PoolSection()
    )
    service = RolloutWorkerService(cfg)
    runtime = Runtime(service, cfg.service)
    job = asyncio.create_task(runtime.run(handle_signals=False))
    try:
        await _until(lambda: runtime.readiness()[0], 60.0, "the worker to become ready")
        engine, frozen = service.engine, service.frozen_engine
        assert engine is not None and frozen is not None and frozen is not engine
        before = await asyncio.to_thread(engine_digest, frozen)
        assert before == await asyncio.to_thread(engine_digest, engine)  # a copy of the same version 0
        await _announce(bus, LocalObjectStore(str(tmp_path / "store")), 1)
        await _until(lambda: engine.policy_version == 1, 20.0, "the live engine to apply version 1")
        assert frozen.policy_version == 0
        assert await asyncio.to_thread(engine_digest, frozen) == before
        assert await asyncio.to_thread(engine_digest, engine) != before
        # Its engine (and KV cache) exist only once a sub-agent runs; it samples at version 0.
        assert service.status()["subagents"] == {"transport": "local", "frozen_version": 0, "frozen_started": False}
        request = GenerationRequest(
            request_id="sub/0", prompt_ids=[1, 2, 3], params=SamplingParams(max_tokens=4, ignore_eos=True)
        )
        result = await frozen.generate(request)
        assert [tuple(s) for s in result.segments] == [(0, 4)]
        assert service.status()["subagents"]["frozen_started"] is True
        assert await asyncio.to_thread(engine_digest, frozen) == before
    finally:
        runtime.request_stop("test done")
        assert await asyncio.wait_for(job, 30.0) == 0


@pytest.mark.parametrize("pool", [(2, 4)], indirect=True)
async def test_a_task_worker_with_nats_transport_sends_its_episodes_subagents_to_the_pool(
    pool: list[RolloutWorkerService], bus: Bus, nats_server: Server, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The whole service path: a task on tasks.<env> -> a worker with [subagents] transport = "nats"
    -> the pool -> one Episode on traj.raw.<env> with the children merged in, frozen at the pin."""
    cfg = msgspec.structs.replace(
        _config(nats_server.url, tmp_path / "store", "w0", max_in_flight=1),
        pool=PoolSection(),
        subagents=SubagentsSection(transport="nats", timeout_s=60.0, pin_version=PIN),
    )
    monkeypatch.setitem(registry.ENVIRONMENTS, _Orchestrator.name, _Orchestrator)
    worker = RolloutWorkerService(cfg)
    runtime = Runtime(worker, cfg.service)
    job = asyncio.create_task(runtime.run(handle_signals=False))
    reader = await bus.consumer("reward-model", Episode)
    try:
        await _until(lambda: runtime.readiness()[0], 60.0, "the orchestrator's worker to become ready")
        assert worker.frozen_engine is None and worker.subagents is not None
        task = Task(task_id="orch-0", env="t-pool-orchestrator", prompt="plan:", reference="", run_id=RUN, group_size=2)
        await bus.publish(tasks_subject(task.env), task, msg_id=task.task_id)
        episodes: list[Episode] = []
        deadline = time.monotonic() + 60.0
        while len(episodes) < 2:
            assert time.monotonic() < deadline, f"got {len(episodes)} of 2 episodes"
            for d in await reader.fetch(2, 0.5):
                episodes.append(d.msg)
                await d.ack()
        for e in episodes:
            assert e.infra_error == "" and e.worker_id == "rollout-worker/w0"
            root, *children = e.samples
            assert root.trainable and root.versions() == [0]
            assert len(children) == N_CHILDREN
            assert all((s.role, s.trainable, s.versions()) == ("subagent", False, [PIN]) for s in children)
            assert e.counts["subagents"] == N_CHILDREN
        status = worker.status()["subagents"]
        assert status["transport"] == "nats" and status["requests"] == 2 * N_CHILDREN and status["unavailable"] == 0
        assert sum(s.pool.outcomes["ok"] for s in pool if s.pool is not None) == 2 * N_CHILDREN
    finally:
        runtime.request_stop("test done")
        assert await asyncio.wait_for(job, 30.0) == 0


async def test_no_pool_replica_means_retries_then_an_infra_error(bus: Bus) -> None:
    """No replica takes the request: sent again once after the timeout, then an error reply (never raised)."""
    client = NatsSubagents(bus, timeout_s=0.3, retries=1, retry_backoff_s=0.05, caller="orchestrator")
    request = SubagentRequest(request_id="ep/0/sub0", agent_id="sub0", env="lookup", prompt="key 1?\n")
    t0 = time.monotonic()
    reply = await client.run(request)
    assert time.monotonic() - t0 >= 0.6
    assert reply.request_id == request.request_id and reply.samples == []
    assert (
        reply.error.startswith("sub-agent pool unavailable after 2 attempt(s)")
        and "no reply within 0.3 s" in reply.error
    )
    assert client.stats == {"requests": 1, "retries": 1, "unavailable": 1, "errors": 0, "wrong_version": 0}
    # Both attempts are in the work queue (distinct message ids), for a pool to skip once past their deadline.
    assert (await bus.stream_info("SUBAGENTS"))["messages"] == 2
