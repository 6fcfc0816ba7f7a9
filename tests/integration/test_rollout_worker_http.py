"""A rollout worker whose engine is an inference server over HTTP (`[engine] type = "http"`).

Real nats-server, local object store, and Slipstream's inference server on a free loopback port
serving the tiny preset; the worker holds only the tokenizer. Tasks become trajectories, a
version announced while a long group is generating reaches the server between two decode steps
(a trajectory spans versions [0, 1]), and the server's weights are then exactly the announced
ones. A worker pointed at a port nobody listens on fails setup naming the URL.

Frozen sub-agents (issue 32): the server's weights are live, so the worker keeps its own frozen
copy of [model]; with the server at version 1 (other weights), a probe episode's sub-agent
completes exactly as version 0 does greedily, and not as version 1, while the orchestrator's turn
runs on the server at version 1.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import ClassVar

import msgspec
import pytest
import torch

from slipstream.bus import Bus, BusConfig, Consumer, connect_bus
from slipstream.engine import ByteTokenizer, EngineError, TorchEngine, build_tiny
from slipstream.engine.backend import EngineBackend
from slipstream.engine.interface import GenerationRequest, SamplingParams
from slipstream.engine.source import ModelSource
from slipstream.envs import EpisodeContext, Outcome, Score, TaskSpec, registry
from slipstream.envs.base import Environment, Problem
from slipstream.harness.rollout import trajectory_of
from slipstream.rollout_worker.config import RolloutWorkerConfig, WorkerSection
from slipstream.rollout_worker.service import RolloutWorkerService
from slipstream.runtime.lifecycle import Runtime
from slipstream.runtime.section import ServiceSection
from slipstream.schemas import Episode, Task, Trajectory, WeightAnnounce
from slipstream.schemas.packing import unpack_ids
from slipstream.schemas.subjects import WEIGHTS_ANNOUNCE, tasks_subject
from slipstream.serve.config import InferenceSection
from slipstream.serve.http_engine import HttpEngine
from slipstream.serve.inference_server import InferenceServer
from slipstream.stack import Server, free_port
from slipstream.store import LocalObjectStore, StoreConfig
from slipstream.weights import publish_snapshot

pytestmark = pytest.mark.integration

RUN = "itest-http"
MAX_TOKENS = 300


@pytest.fixture(autouse=True)
def _one_thread() -> None:
    torch.set_num_threads(1)


@pytest.fixture
async def bus(nats_server: Server) -> AsyncIterator[Bus]:
    b = await connect_bus(BusConfig(url=nats_server.url, stream_storage="memory"), name="test")
    await b.ensure_streams()
    yield b
    await b.close()


@pytest.fixture
async def server() -> AsyncIterator[InferenceServer]:
    model, _ = build_tiny("tiny", seed=0)
    engine = TorchEngine(model, ByteTokenizer(), device="cpu", max_batch=16)
    s = InferenceServer(engine, InferenceSection(host="127.0.0.1", port=0))
    await s.start()
    yield s
    await s.close()


def _config(nats_url: str, store_root: Path, url: str) -> RolloutWorkerConfig:
    return RolloutWorkerConfig(
        service=ServiceSection(run_id=RUN, replica="h0", drain_timeout_s=10.0),
        bus=BusConfig(url=nats_url, stream_storage="memory", fetch_timeout_s=0.2),
        store=StoreConfig(type="local", root=str(store_root)),
        model=ModelSource(preset="tiny", seed=0, threads=1),
        engine=EngineBackend(type="http", url=url, connect_timeout_s=2.0),
        worker=WorkerSection(max_tasks_in_flight=4, max_tokens=MAX_TOKENS, ignore_eos=True, stop_at_terminator=False),
    )


def _task(i: int, group_size: int) -> Task:
    return Task(task_id=f"t{i}", env="arith", prompt=f"{i}+1=", reference=str(i + 1), run_id=RUN, group_size=group_size)


async def _until(predicate: object, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():  # type: ignore[operator]
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.05)


async def _collect(consumer: Consumer[Episode], n: int, timeout: float = 60.0) -> list[Trajectory]:
    out: list[Trajectory] = []
    deadline = time.monotonic() + timeout
    while len(out) < n:
        assert time.monotonic() < deadline, f"got {len(out)} of {n} trajectories"
        for d in await consumer.fetch(n - len(out), 0.5):
            out.append(trajectory_of(d.msg))
            await d.ack()
    return out


async def test_a_worker_drives_the_inference_server_and_follows_weights(
    bus: Bus, nats_server: Server, server: InferenceServer, tmp_path: Path
) -> None:
    cfg = _config(nats_server.url, tmp_path / "store", server.url)
    service = RolloutWorkerService(cfg)
    runtime = Runtime(service, cfg.service)
    running = asyncio.create_task(runtime.run(handle_signals=False))
    reader = await bus.consumer("reward-model", Episode)
    store = LocalObjectStore(str(tmp_path / "store"))
    try:
        await _until(lambda: runtime.readiness()[0], 60.0, "the worker to become ready")
        assert isinstance(service.engine, HttpEngine)
        for i in range(2):
            await bus.publish(tasks_subject("arith"), _task(i, 2), msg_id=f"t{i}")
        first = await _collect(reader, 4)
        assert all(t.versions() == [0] and t.completion_len() == MAX_TOKENS for t in first)

        # Version 1 announced while a group generates on the server: it lands between two decode steps.
        before = server.engine.stats()["tokens_generated"]
        await bus.publish(tasks_subject("arith"), _task(10, 2), msg_id="t10")
        await _until(lambda: server.engine.stats()["tokens_generated"] >= before + 20, 60.0, "generation to start")
        v1 = {k: v + 0.01 for k, v in server.engine.state_dict().items()}
        finished = time.time()
        key, _ = await asyncio.to_thread(
            publish_snapshot, store, run_id=RUN, version=1, tensors=v1, step_finished_at=finished
        )
        announce = WeightAnnounce(
            policy_version=1, manifest_key=key, run_id=RUN, step_finished_at=finished, announced_at=time.time()
        )
        await bus.publish(WEIGHTS_ANNOUNCE, announce, msg_id=f"{RUN}:1")
        spanned = await _collect(reader, 2)
        assert any(t.versions() == [0, 1] for t in spanned), [t.segments for t in spanned]
        assert all(sum(s.n_tokens for s in t.segments) == MAX_TOKENS for t in spanned)
        await _until(lambda: service.status()["policy_version"] == 1, 30.0, "the worker to report version 1")
        assert server.engine.policy_version == 1
        for name, value in v1.items():
            assert torch.equal(server.engine.state_dict()[name], value), name
        assert service.status()["weights"]["fetch_failures"] == 0
    finally:
        runtime.request_stop("test")
        code = await asyncio.wait_for(running, 30.0)
        await reader.close()
    assert code == 0


async def test_a_worker_pointed_at_nothing_fails_setup_naming_the_url(nats_server: Server, tmp_path: Path) -> None:
    url = f"http://127.0.0.1:{free_port()}"
    service = RolloutWorkerService(_config(nats_server.url, tmp_path / "store", url))
    try:
        with pytest.raises(EngineError, match=f"{url} is unreachable"):
            await service.setup()
    finally:
        await service.close()


class _Probe(Environment[msgspec.Struct]):
    """One orchestrator turn, then one frozen sub-agent's turn; the answer is the sub-agent's."""

    name: ClassVar[str] = "t-http-frozen-probe"

    class Options(msgspec.Struct, frozen=True):
        pass

    components: ClassVar[tuple[str, ...]] = ("correct",)

    def sample(self, rng: random.Random) -> Problem:
        return Problem(key=f"k{rng.randrange(10**9)}", prompt="plan:", reference="")

    def grade(self, task: TaskSpec, completion: str) -> Score:
        return Score.of({"correct": 0.0}, correct=False, parse_ok=True, reason="")

    async def run(self, ctx: EpisodeContext) -> Outcome:
        thread = ctx.open(ctx.task.prompt)
        gen = await ctx.generate(thread, max_tokens=8)
        if ctx.task.metadata.get("child"):
            return Outcome(final_text=gen.text, finish_reason=gen.finish_reason)
        child = msgspec.structs.replace(
            ctx.task, task_id=f"{ctx.task.task_id}/c", prompt="sub:", metadata={"child": True}
        )
        out = await ctx.spawn(self, child, agent_id="c0", trainable=False)
        return Outcome(final_text=out.final_text, finish_reason="stop")


async def _greedy(seed: int, prompt: list[int], n: int) -> list[int]:
    """What the tiny model of `seed` completes greedily: the fingerprint of a set of weights."""
    model, _ = build_tiny("tiny", seed=seed)
    engine = TorchEngine(model, ByteTokenizer(), device="cpu", max_batch=1)
    await engine.start()
    try:
        params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
        result = await engine.generate(GenerationRequest(request_id="fp", prompt_ids=prompt, params=params))
        return list(result.completion_ids)
    finally:
        await engine.stop()


async def test_sub_agents_of_an_http_worker_run_on_its_frozen_copy_not_the_live_server(
    bus: Bus, nats_server: Server, server: InferenceServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(registry.ENVIRONMENTS, _Probe.name, _Probe)
    cfg = _config(nats_server.url, tmp_path / "store", server.url)
    cfg = msgspec.structs.replace(
        cfg, worker=msgspec.structs.replace(cfg.worker, temperature=0.0, max_tokens=8, max_tasks_in_flight=1)
    )
    service = RolloutWorkerService(cfg)
    runtime = Runtime(service, cfg.service)
    running = asyncio.create_task(runtime.run(handle_signals=False))
    reader = await bus.consumer("reward-model", Episode)
    store = LocalObjectStore(str(tmp_path / "store"))
    try:
        await _until(lambda: runtime.readiness()[0], 60.0, "the worker to become ready")
        assert service.frozen_engine is not None and service.frozen_engine.policy_version == 0
        # Version 1: other weights altogether (the tiny model of seed 1), applied to the server.
        other, _ = build_tiny("tiny", seed=1)
        v1 = {k: v.detach() for k, v in other.state_dict().items()}
        key, _ = await asyncio.to_thread(publish_snapshot, store, run_id=RUN, version=1, tensors=v1)
        announce = WeightAnnounce(policy_version=1, manifest_key=key, run_id=RUN, announced_at=time.time())
        await bus.publish(WEIGHTS_ANNOUNCE, announce, msg_id=f"{RUN}:1")
        await _until(lambda: server.engine.policy_version == 1, 60.0, "the server to apply version 1")
        task = Task(task_id="probe-0", env=_Probe.name, prompt="plan:", reference="", run_id=RUN, group_size=1)
        await bus.publish(tasks_subject(task.env), task, msg_id=task.task_id)
        (delivery,) = await reader.fetch(1, 60.0)
        await delivery.ack()
        root, child = delivery.msg.samples
        assert (root.trainable, root.versions()) == (True, [1])
        assert (child.role, child.trainable, child.versions()) == ("subagent", False, [0])
        ids = unpack_ids(child.token_ids)
        prompt, completion = ids[: child.prompt_len], ids[child.prompt_len :]
        # The sub-agent's tokens are version 0's greedy completion, and not version 1's.
        v0_says, v1_says = await _greedy(0, prompt, len(completion)), await _greedy(1, prompt, len(completion))
        assert v0_says != v1_says
        assert completion == v0_says
        assert service.status()["subagents"]["frozen_started"] is True
    finally:
        runtime.request_stop("test")
        code = await asyncio.wait_for(running, 30.0)
        await reader.close()
    assert code == 0
