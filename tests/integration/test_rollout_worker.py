"""The rollout worker against a real nats-server, a local object store and the tiny model.

In-process (the service driven by the runtime, so its lifecycle is the real one):
- 4 tasks -> 4 x group_size trajectories on traj.raw.arith (read on the `reward-model` durable),
  each group complete and consistent, and the TASKS stream ends empty;
- a version 1 snapshot published and announced while a long task is generating: a trajectory
  carries versions [0, 1] and the worker reports version 1 and a time-to-policy;
- a task with min_policy_version 2 waits for version 2 and is sampled only under it;
- a task for an unknown environment goes to dlq.TASKS with the reason;
- SIGTERM-equivalent stop: exit code 0, nothing left in flight.
As a subprocess (`python -m slipstream.rollout_worker`, env-only config): it becomes ready,
rolls out a task, and exits 0 on SIGTERM; SIGKILLed while it holds tasks (waiting for a version
that never comes), the tasks it held for longer than the durable's ack wait (kept with
in-progress signals) come back to another consumer within seconds of its death.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections import defaultdict
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import torch

from slipstream.bus import Bus, BusConfig, Consumer, connect_bus
from slipstream.engine.source import ModelSource
from slipstream.harness.rollout import trajectory_of
from slipstream.rollout_worker.config import RolloutWorkerConfig, WorkerSection
from slipstream.rollout_worker.service import RolloutWorkerService
from slipstream.runtime.lifecycle import Runtime
from slipstream.runtime.section import ServiceSection
from slipstream.schemas import Episode, Task, Trajectory, WeightAnnounce
from slipstream.schemas.subjects import WEIGHTS_ANNOUNCE, tasks_subject
from slipstream.stack import Server, free_port
from slipstream.store import LocalObjectStore, StoreConfig
from slipstream.weights import publish_snapshot

pytestmark = pytest.mark.integration

RUN = "itest"
GROUP = 3
MAX_TOKENS = 300


@pytest.fixture(autouse=True)
def _one_thread() -> None:
    torch.set_num_threads(1)


def _task(i: int, *, env: str = "arith", group_size: int = GROUP, min_version: int = 0) -> Task:
    return Task(
        task_id=f"t{i}",
        env=env,
        prompt=f"{i}+1=",
        reference=str(i + 1),
        run_id=RUN,
        group_size=group_size,
        min_policy_version=min_version,
    )


async def _publish_tasks(bus: Bus, tasks: list[Task]) -> None:
    for t in tasks:
        await bus.publish(tasks_subject(t.env), t, msg_id=t.task_id)


async def _collect(consumer: Consumer[Episode], n: int, timeout: float = 40.0) -> list[Trajectory]:
    """The worker publishes Episodes; arith's are one-sample, checked here in their v1 view."""
    out: list[Trajectory] = []
    deadline = time.monotonic() + timeout
    while len(out) < n:
        assert time.monotonic() < deadline, f"got {len(out)} of {n} trajectories in {timeout}s"
        for d in await consumer.fetch(n - len(out), 0.5):
            assert len(d.msg.samples) == 1 and not d.msg.is_stub()
            out.append(trajectory_of(d.msg))
            await d.ack()
    return out


async def _until(predicate: object, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():  # type: ignore[operator]
        assert time.monotonic() < deadline, f"timed out after {timeout}s waiting for {what}"
        await asyncio.sleep(0.02)


async def _tasks_stream_empty(bus: Bus, timeout: float = 10.0) -> None:
    """TASKS holds nothing once the worker's acks reach the server: an ack is sent without waiting for
    the server's reply, so the count the worker keeps can run ahead of the stream (seen at load ~5)."""
    deadline = time.monotonic() + timeout
    while (left := (await bus.stream_info("TASKS"))["messages"]) != 0:
        assert time.monotonic() < deadline, f"TASKS still holds {left} message(s) {timeout}s after the acks"
        await asyncio.sleep(0.05)


async def _announce(bus: Bus, store: LocalObjectStore, version: int, tensors: dict[str, torch.Tensor]) -> None:
    finished = time.time()
    key, _ = await asyncio.to_thread(
        publish_snapshot, store, run_id=RUN, version=version, tensors=tensors, step_finished_at=finished
    )
    announce = WeightAnnounce(
        policy_version=version, manifest_key=key, run_id=RUN, step_finished_at=finished, announced_at=time.time()
    )
    await bus.publish(WEIGHTS_ANNOUNCE, announce, msg_id=f"{RUN}:{version}")


@pytest.fixture
async def bus(nats_server: Server) -> AsyncIterator[Bus]:
    b = await connect_bus(BusConfig(url=nats_server.url, stream_storage="memory"), name="test")
    await b.ensure_streams()
    yield b
    await b.close()


def _config(
    nats_url: str, store_root: Path, *, drain_timeout_s: float = 10.0, max_tokens: int = MAX_TOKENS
) -> RolloutWorkerConfig:
    return RolloutWorkerConfig(
        service=ServiceSection(run_id=RUN, replica="w0", drain_timeout_s=drain_timeout_s),
        bus=BusConfig(url=nats_url, stream_storage="memory", fetch_timeout_s=0.2),
        store=StoreConfig(type="local", root=str(store_root)),
        model=ModelSource(preset="tiny", seed=0, threads=1),
        worker=WorkerSection(
            max_batch=16,
            max_tasks_in_flight=4,
            max_tokens=max_tokens,
            ignore_eos=True,  # every completion is MAX_TOKENS long, so a weight update lands inside one
            stop_at_terminator=False,
            version_wait_timeout_s=30.0,
        ),
    )


def _check(t: Trajectory) -> None:
    n = t.completion_len()
    assert n == MAX_TOKENS
    assert len(t.behaviour_logprobs()) == n == len(t.mask())
    assert sum(s.n_tokens for s in t.segments) == n


async def test_worker_rolls_out_tasks_follows_weights_and_drains(bus: Bus, nats_server: Server, tmp_path: Path) -> None:
    cfg = _config(nats_server.url, tmp_path / "store")
    service = RolloutWorkerService(cfg)
    runtime = Runtime(service, cfg.service)
    running = asyncio.create_task(runtime.run(handle_signals=False))
    reader = await bus.consumer("reward-model", Episode)
    store = LocalObjectStore(str(tmp_path / "store"))
    try:
        await _until(lambda: runtime.readiness()[0], 60.0, "the worker to become ready")
        engine, pipeline = service.engine, service.pipeline
        assert engine is not None and pipeline is not None

        # 1. Four tasks -> four complete groups, all under version 0; TASKS ends empty.
        await _publish_tasks(bus, [_task(i) for i in range(4)])
        trajs = await _collect(reader, 4 * GROUP)
        groups: dict[str, list[Trajectory]] = defaultdict(list)
        for t in trajs:
            groups[t.group_id].append(t)
            _check(t)
            assert t.versions() == [0] and t.run_id == RUN and t.worker_id == "rollout-worker/w0"
            assert t.trajectory_id == f"{t.group_id}/{t.group_index}"
        assert sorted(g.split("/")[0] for g in groups) == ["t0", "t1", "t2", "t3"]
        assert all(sorted(t.group_index for t in g) == [0, 1, 2] for g in groups.values())
        await _until(lambda: pipeline.outcomes["acked"] == 4, 10.0, "4 acks")
        await _tasks_stream_empty(bus)

        # 2. Version 1 lands while a long task is generating: its trajectories span both versions.
        before = engine.stats()["tokens_generated"]
        await _publish_tasks(bus, [_task(10, group_size=2)])
        await _until(lambda: engine.stats()["tokens_generated"] >= before + 20, 20.0, "generation to start")
        v1 = {k: v + 0.01 for k, v in engine.state_dict().items()}
        await _announce(bus, store, 1, v1)
        spanned = await _collect(reader, 2)
        for t in spanned:
            _check(t)
        assert any(t.versions() == [0, 1] for t in spanned), [t.segments for t in spanned]
        # The worker notes time-to-policy once it has published the rollouts that used the version:
        # the reader can have them a moment before that bookkeeping runs (seen at load ~5).
        await _until(
            lambda: service.status()["weights"]["last_time_to_policy_s"] is not None, 10.0, "time-to-policy noted"
        )
        status = service.status()
        assert status["policy_version"] == 1
        assert status["weights"]["fetch_failures"] == 0
        ttp = status["weights"]["last_time_to_policy_s"]
        assert ttp is not None and 0.0 <= ttp < 20.0
        assert torch.equal(dict(engine.named_parameters())["model.norm.weight"], v1["model.norm.weight"])

        # 3. A task that needs version 2 waits for it and is sampled only under it.
        await _publish_tasks(bus, [_task(20, group_size=2, min_version=2)])
        await _until(lambda: service.in_flight() == 1, 10, "the gated task to be taken")
        await asyncio.sleep(0.3)  # and held: not sampled under version 1
        assert engine.policy_version == 1 and service.in_flight() == 1
        await _announce(bus, store, 2, {k: v + 0.01 for k, v in v1.items()})
        gated = await _collect(reader, 2)
        assert [t.versions() for t in gated] == [[2], [2]]

        # 4. An unknown environment cannot be rolled out: it goes to the DLQ with the reason.
        await _publish_tasks(bus, [_task(30, env="nosuchenv")])
        await _until(lambda: pipeline.outcomes["rejected"] == 1, 10.0, "the rejection")
        dead = await bus.dead_letters("TASKS")
        assert len(dead) == 1 and "nosuchenv" in dead[0].reason

        await _tasks_stream_empty(bus)
        assert (await bus.stream_info("TRAJ_RAW"))["messages"] == 0  # every trajectory was read above
        assert dict(pipeline.outcomes) == {"acked": 6, "rejected": 1}
    finally:
        runtime.request_stop("test")
        code = await asyncio.wait_for(running, 30.0)
        await reader.close()
    assert code == 0
    assert service.in_flight() == 0


async def test_drain_hands_back_a_task_that_cannot_finish_in_the_budget(
    bus: Bus, nats_server: Server, tmp_path: Path
) -> None:
    # 2 x 2000 tokens take seconds on a CPU; the drain budget is 1.5 s (1.125 s to finish, 0.375 s grace).
    cfg = _config(nats_server.url, tmp_path / "store", drain_timeout_s=1.5, max_tokens=2000)
    service = RolloutWorkerService(cfg)
    runtime = Runtime(service, cfg.service)
    running = asyncio.create_task(runtime.run(handle_signals=False))
    try:
        await _until(lambda: runtime.readiness()[0], 60.0, "the worker to become ready")
        engine, pipeline = service.engine, service.pipeline
        assert engine is not None and pipeline is not None
        await _publish_tasks(bus, [_task(1, group_size=2)])
        await _until(lambda: engine.stats()["tokens_generated"] >= 10, 20.0, "generation to start")
    finally:
        runtime.request_stop("test")
        code = await asyncio.wait_for(running, 30.0)
    assert code == 0
    assert dict(pipeline.outcomes) == {"released": 1}
    assert (await bus.stream_info("TRAJ_RAW"))["messages"] == 0
    # Handed back, not left to time out: the next worker gets it at once (not after the 10 s ack_wait).
    taker = await bus.consumer("rollout-worker", Task)
    again = await taker.fetch(4, 2.0)
    assert [(d.msg.task_id, d.num_delivered) for d in again] == [("t1", 2)]
    await again[0].ack()
    await taker.close()
    assert await bus.dead_letters("TASKS") == []


async def test_a_worker_that_cannot_advance_says_so_on_readyz(bus: Bus, nats_server: Server, tmp_path: Path) -> None:
    cfg = _config(nats_server.url, tmp_path / "store")
    cfg = RolloutWorkerConfig(
        service=ServiceSection(run_id=RUN, replica="w0", drain_timeout_s=5.0, stall_after_s=1.5),
        bus=cfg.bus,
        store=cfg.store,
        model=cfg.model,
        worker=cfg.worker,
    )
    service = RolloutWorkerService(cfg)
    runtime = Runtime(service, cfg.service)
    running = asyncio.create_task(runtime.run(handle_signals=False))
    store = LocalObjectStore(str(tmp_path / "store"))
    reader = await bus.consumer("reward-model", Episode)
    try:
        await _until(lambda: runtime.readiness()[0], 60.0, "the worker to become ready")
        assert service.engine is not None
        # Nothing to do for longer than the budget is not a stall.
        await asyncio.sleep(2.0)
        assert runtime.readiness()[0]
        # A task wanting version 1, which nobody announces: held, and nothing advances.
        await _publish_tasks(bus, [_task(40, group_size=2, min_version=1)])
        await _until(lambda: not runtime.readiness()[0], 10.0, "readiness to report the stall")
        progress = runtime.readiness()[1]["status"]["progress"]
        assert progress["stalled"] and progress["reason"].startswith("1 task(s) held; nothing advanced for")
        # Version 1 arrives: the task goes through and readiness comes back by itself.
        await _announce(bus, store, 1, {k: v + 0.01 for k, v in service.engine.state_dict().items()})
        await _collect(reader, 2)
        await _until(lambda: runtime.readiness()[0], 10.0, "readiness back")
    finally:
        runtime.request_stop("test")
        code = await asyncio.wait_for(running, 30.0)
        await reader.close()
    assert code == 0


def _http_json(port: int, path: str) -> tuple[int, dict[str, object]]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=2) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def _worker_env(nats_url: str, port: int, tmp_path: Path) -> dict[str, str]:
    return {
        **os.environ,
        "SLIPSTREAM_SERVICE__RUN_ID": RUN,
        "SLIPSTREAM_SERVICE__HTTP_PORT": str(port),
        "SLIPSTREAM_SERVICE__DRAIN_TIMEOUT_S": "10",
        "SLIPSTREAM_BUS__URL": nats_url,
        "SLIPSTREAM_BUS__STREAM_STORAGE": "memory",
        "SLIPSTREAM_STORE__ROOT": str(tmp_path / "store"),
        "SLIPSTREAM_MODEL__THREADS": "1",
        "SLIPSTREAM_WORKER__MAX_TOKENS": "8",
        "SLIPSTREAM_WORKER__ENV_OPTIONS": '{"arith": {"max_operand": 9}}',
        "SLIPSTREAM_TELEMETRY__LOG_FORMAT": "json",
    }


async def _start_worker(nats_url: str, tmp_path: Path, **env: str) -> tuple[subprocess.Popen[bytes], int, Path]:
    """`python -m slipstream.rollout_worker` configured by env only, once its /readyz answers 200."""
    port = free_port()
    log_path = tmp_path / "worker.log"
    with log_path.open("wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "slipstream.rollout_worker"],
            env={**os.environ, **_worker_env(nats_url, port, tmp_path), **env},
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    deadline = time.monotonic() + 60.0
    while True:
        assert proc.poll() is None, log_path.read_text()[-3000:]
        if time.monotonic() > deadline:
            proc.kill()
            proc.wait()
            raise AssertionError("worker not ready in 60 s:\n" + log_path.read_text()[-3000:])
        try:
            code, _ = await asyncio.to_thread(_http_json, port, "/readyz")
            if code == 200:
                return proc, port, log_path
        except OSError:
            pass
        await asyncio.sleep(0.2)


async def test_worker_as_a_process_with_env_only_config(bus: Bus, nats_server: Server, tmp_path: Path) -> None:
    proc, port, log_path = await _start_worker(nats_server.url, tmp_path)
    try:
        reader = await bus.consumer("reward-model", Episode)
        await _publish_tasks(bus, [_task(1, group_size=2)])
        got = await _collect(reader, 2)
        assert {t.group_index for t in got} == {0, 1} and all(t.completion_len() <= 8 for t in got)
        await reader.close()
        await _until(lambda: _http_json(port, "/readyz")[1]["status"]["tasks"]["acked"] == 1, 10.0, "the ack")  # type: ignore[index]
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as resp:
            metrics = resp.read().decode()
        assert 'worker_trajectories_published_total{env="arith"} 2' in metrics
        proc.send_signal(signal.SIGTERM)
        assert await asyncio.to_thread(proc.wait, 30) == 0, log_path.read_text()[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


async def test_a_sigkilled_workers_tasks_come_back_within_seconds(
    bus: Bus, nats_server: Server, tmp_path: Path
) -> None:
    """The table's own ack wait (10 s, not an override): held past it by heartbeats, freed by death."""
    from slipstream.schemas.subjects import consumer

    ack_wait = consumer("rollout-worker")[1].ack_wait_s
    proc, _, log_path = await _start_worker(nats_server.url, tmp_path)
    try:
        # Version 1 never comes: the worker holds each task, waiting for it, and keeps it with heartbeats.
        await _publish_tasks(bus, [_task(i, group_size=2, min_version=1) for i in range(3)])

        async def held() -> dict[str, int]:
            return dict((await bus.stream_info("TASKS"))["consumers"]["rollout-worker"])

        deadline = time.monotonic() + 20
        while (await held())["num_ack_pending"] < 3:
            assert time.monotonic() < deadline, f"the worker did not take the tasks: {await held()}"
            await asyncio.sleep(0.1)
        await asyncio.sleep(ack_wait + 2)  # past the ack wait: only the heartbeats keep the tasks
        state = await held()
        assert state["num_ack_pending"] == 3 and state["num_redelivered"] == 0, state
        proc.send_signal(signal.SIGKILL)
        killed_at = time.monotonic()
        proc.wait()

        taker = await bus.consumer("rollout-worker", Task)
        back: dict[str, float] = {}
        while len(back) < 3 and time.monotonic() - killed_at < 60:
            for d in await taker.fetch(3, 0.5):
                back.setdefault(d.msg.task_id, time.monotonic() - killed_at)
                await d.ack()
        await taker.close()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert sorted(back) == ["t0", "t1", "t2"], (back, log_path.read_text()[-2000:])
    slowest = max(back.values())
    print(f"tasks of the SIGKILLed worker back after {slowest:.1f} s (ack wait {ack_wait:.0f} s)")
    # Before: a 300 s ack wait. Now: the 10 s wait since the worker's last heartbeat, plus a fetch.
    assert slowest < 15.0, back
