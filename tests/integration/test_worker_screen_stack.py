"""The rollout worker's task screen (`[worker] screen_target`) against a real nats-server.

An untrained tiny model writes an arith answer with a probability of about 1e-5 or less, so every
arith group it would sample is uniform (all wrong): with the screen on, each arith task is acked
with no group (outcome `screened`, TASKS ends empty, nothing reaches TRAJ_RAW) and /readyz's
status counts them. A `lookup` task (multi-turn: the screen cannot judge it) is sampled as usual.
With the screen off the same arith tasks are sampled (the control).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import torch

from slipstream.bus import Bus, BusConfig, connect_bus
from slipstream.engine.source import ModelSource
from slipstream.envs import get_env
from slipstream.rollout_worker.config import RolloutWorkerConfig, WorkerSection
from slipstream.rollout_worker.service import RolloutWorkerService
from slipstream.runtime.lifecycle import Runtime
from slipstream.runtime.section import ServiceSection
from slipstream.schemas import Task
from slipstream.schemas.subjects import tasks_subject
from slipstream.stack import Server
from slipstream.store import StoreConfig

pytestmark = pytest.mark.integration

RUN = "screen"
GROUP = 4


@pytest.fixture(autouse=True)
def _one_thread() -> None:
    torch.set_num_threads(1)


@pytest.fixture
async def bus(nats_server: Server) -> AsyncIterator[Bus]:
    b = await connect_bus(BusConfig(url=nats_server.url, stream_storage="memory"), name="test")
    await b.ensure_streams()
    yield b
    await b.close()


def _arith(i: int) -> Task:
    return Task(task_id=f"a{i}", env="arith", prompt=f"{i}+3=", reference=str(i + 3), run_id=RUN, group_size=GROUP)


async def _until(predicate: object, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():  # type: ignore[operator]
        assert time.monotonic() < deadline, f"timed out after {timeout}s waiting for {what}"
        await asyncio.sleep(0.02)


async def _run_worker(bus: Bus, url: str, store: Path, screen_target: float, tasks: list[Task]) -> tuple[dict, int]:
    """Run a worker over `tasks`; (its pipeline outcomes and status once all are settled, episodes on TRAJ_RAW)."""
    cfg = RolloutWorkerConfig(
        service=ServiceSection(run_id=RUN, replica="w0", drain_timeout_s=10.0),
        bus=BusConfig(url=url, stream_storage="memory", fetch_timeout_s=0.2),
        store=StoreConfig(type="local", root=str(store)),
        model=ModelSource(preset="tiny", seed=0, threads=1),
        worker=WorkerSection(max_batch=16, max_tasks_in_flight=4, max_tokens=8, screen_target=screen_target),
    )
    service = RolloutWorkerService(cfg)
    runtime = Runtime(service, cfg.service)
    running = asyncio.create_task(runtime.run(handle_signals=False))
    try:
        await _until(lambda: runtime.readiness()[0], 60.0, "the worker to become ready")
        pipeline = service.pipeline
        assert pipeline is not None
        for t in tasks:
            await bus.publish(tasks_subject(t.env), t, msg_id=f"{t.task_id}-{screen_target}")
        await _until(lambda: sum(pipeline.outcomes.values()) == len(tasks), 60.0, "every task settled")
        status = service.status()
    finally:
        runtime.request_stop("test")
        assert await asyncio.wait_for(running, 30.0) == 0
    raw = await bus.stream_info("TRAJ_RAW")
    return status, int(raw["messages"])


async def test_a_screened_task_is_acked_without_a_group_and_a_multi_turn_one_is_sampled(
    bus: Bus, nats_server: Server, tmp_path: Path
) -> None:
    lookup = get_env("lookup").generate("train", 1, seed=0)[0].to_task(run_id=RUN, group_size=GROUP)
    status, episodes = await _run_worker(
        bus, nats_server.url, tmp_path / "store", 1.0, [_arith(i) for i in range(6)] + [lookup]
    )
    assert {k: v for k, v in status["tasks"].items() if k in ("acked", "screened")} == {"acked": 1, "screened": 6}
    assert status["screen"]["screened"] == 6 and status["screen"]["kept"] == 0
    assert status["screen"]["not_judged"] == 1  # the lookup task
    assert status["screen"]["mean_p_mixed"] < 1e-3
    assert episodes == GROUP  # only the lookup group was sampled
    assert await _tasks_drained(bus)


async def test_without_the_screen_the_same_tasks_are_sampled(bus: Bus, nats_server: Server, tmp_path: Path) -> None:
    status, episodes = await _run_worker(bus, nats_server.url, tmp_path / "store", 0.0, [_arith(i) for i in range(3)])
    assert status["tasks"]["acked"] == 3 and "screened" not in status["tasks"] and "screen" not in status
    assert episodes == 3 * GROUP


async def _tasks_drained(bus: Bus, timeout: float = 10.0) -> bool:
    """TASKS empties once the acks reach the server (an ack is sent without waiting for its reply)."""
    deadline = time.monotonic() + timeout
    while (await bus.stream_info("TASKS"))["messages"]:
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(0.05)
    return True
