"""The task source against a real nats-server: the window, min_policy_version, and the stop at max_steps.

The first test runs the service in-process and plays the rest of the pipeline by hand: it takes
and acks tasks on the workers' durable, publishes raw trajectories, learner steps and announces,
and watches what the source publishes. The second runs it as `python -m slipstream.task_source`
configured by environment variables only, as a deployment would, and checks the exit at
max_steps (and that a restarted source of a finished run publishes nothing).
"""

from __future__ import annotations

import asyncio
import inspect
import os
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest

from slipstream.bus import Bus, BusConfig, connect_bus
from slipstream.control import connect_control
from slipstream.runtime.section import ServiceSection
from slipstream.schemas import LearnerStep, Task, Trajectory, WeightAnnounce, WeightManifest, to_json
from slipstream.schemas.subjects import LEARNER_STEP, WEIGHTS_ANNOUNCE
from slipstream.stack import ManagedProcess, Server
from slipstream.store import LocalObjectStore, StoreConfig
from slipstream.task_source.config import TaskSourceConfig, TasksSection
from slipstream.task_source.service import TaskSourceService

pytestmark = pytest.mark.integration
RUN = "ts-test"


async def until(cond: Callable[[], bool | Awaitable[bool]], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        got = cond()
        if await got if inspect.isawaitable(got) else got:
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")


async def stored(bus: Bus, stream: str) -> int:
    return int((await bus.stream_info(stream))["messages"])


async def take(bus: Bus, n: int) -> list[Task]:
    """Take and ack `n` tasks on the rollout workers' durable (a worker that finished them)."""
    consumer = await bus.consumer("rollout-worker", Task)
    out: list[Task] = []
    deadline = time.monotonic() + 10
    while len(out) < n and time.monotonic() < deadline:
        for d in await consumer.fetch(batch=n - len(out), timeout=0.5):
            out.append(d.msg)
            await d.ack()
    await consumer.close()
    assert len(out) == n, f"took {len(out)} tasks, wanted {n}"
    return out


async def steady(bus: Bus, expected: int, settle_s: float = 0.6) -> None:
    """TASKS reaches `expected` stored tasks and stays there for several polls."""
    await until(lambda: _eq(stored(bus, "TASKS"), expected), 10, f"{expected} tasks stored")
    await asyncio.sleep(settle_s)
    assert await stored(bus, "TASKS") == expected


async def _eq(value: Awaitable[int], expected: int) -> bool:
    return await value == expected


async def test_window_min_policy_version_and_stop(nats_server: Server, tmp_path: Path) -> None:
    group_size, gps, staleness, max_steps = 2, 2, 1, 3
    window = gps * (staleness + 1)
    cfg = TaskSourceConfig(
        service=ServiceSection(run_id=RUN, replica="ts-0"),
        bus=BusConfig(url=nats_server.url),
        store=StoreConfig(type="local", root=str(tmp_path / "store")),
        tasks=TasksSection(
            envs=["arith", "reverse"],
            group_size=group_size,
            groups_per_step=gps,
            max_staleness=staleness,
            max_steps=max_steps,
            seed=5,
            poll_interval_s=0.05,
        ),
    )
    bus = await connect_bus(BusConfig(url=nats_server.url), name="test")
    await bus.ensure_streams()
    svc = TaskSourceService(cfg)
    await svc.setup()
    stop = asyncio.Event()
    run = asyncio.create_task(svc.run(stop))
    try:
        # Nobody consumes: exactly one window of tasks, then nothing more.
        await steady(bus, window)
        first = await take(bus, window)
        assert [t.env for t in first] == ["arith", "reverse", "arith", "reverse"]
        assert [t.task_id for t in first][:2] == [f"{RUN}:arith-train-5000000-0", f"{RUN}:reverse-train-5000000-0"]
        assert all(t.run_id == RUN and t.group_size == group_size and t.split == "train" for t in first)
        assert {t.min_policy_version for t in first} == {0}  # nothing known yet
        # The four were taken and acked (rolled out): four new ones refill the window.
        await steady(bus, window)

        # The learner reports version 3: new tasks need at least 3 - max_staleness = 2.
        await bus.publish(LEARNER_STEP, LearnerStep(step=1, policy_version=3, run_id=RUN, n_trajectories=4))
        await until(lambda: svc.progress.latest_version == 3, 5, "the learner step seen")
        # Steps of another run change nothing.
        await bus.publish(LEARNER_STEP, LearnerStep(step=99, policy_version=99, run_id="other"))
        second = await take(bus, 2)
        assert {t.min_policy_version for t in second} == {0}  # published before the step
        await steady(bus, window)

        # A worker's group counts until it is scored: the worker publishes its trajectories, then
        # acks the task; the group (2 trajectories at group_size 2) keeps the window full.
        consumer = await bus.consumer("rollout-worker", Task)
        (d,) = await consumer.fetch(batch=1, timeout=5)
        for i in range(group_size):
            tr = Trajectory(trajectory_id=f"{d.msg.task_id}/g/{i}", task_id=d.msg.task_id, env="arith")
            await bus.publish("traj.raw.arith", tr, msg_id=tr.trajectory_id)
        await d.ack()
        await consumer.close()
        await steady(bus, window - 1)
        assert svc.published == 2 * window + 2
        assert svc.status()["outstanding"] == window

        # An announce of a version far ahead without a manifest is refused: min_policy_version stays.
        await bus.publish(WEIGHTS_ANNOUNCE, WeightAnnounce(policy_version=500, manifest_key="nowhere", run_id=RUN))
        await until(lambda: svc.status()["announces"]["refused"] == {"missing_manifest": 1}, 5, "the forgery refused")
        # An announce of version 5, its manifest stored, moves min_policy_version to 4.
        LocalObjectStore(tmp_path / "store").put("m5", to_json(WeightManifest(policy_version=5, run_id=RUN)))
        await bus.publish(WEIGHTS_ANNOUNCE, WeightAnnounce(policy_version=5, manifest_key="m5", run_id=RUN))
        await until(lambda: svc.progress.latest_version == 5, 5, "the announce seen")
        fresh = await take(bus, window - 1)
        # The one left from before step 1, and the two refilled after it.
        assert sorted(t.min_policy_version for t in fresh) == [0, 2, 2]
        await steady(bus, window - 1)
        latest = await take(bus, window - 1)
        assert {t.min_policy_version for t in latest} == {4}
        ids = [t.task_id for t in [*first, *second, d.msg, *fresh, *latest]]
        assert len(set(ids)) == len(ids) == window + 2 + 1 + 2 * (window - 1)

        # The learner reaches max_steps: the source stops publishing and `run` returns by itself.
        await bus.publish(LEARNER_STEP, LearnerStep(step=max_steps, policy_version=6, run_id=RUN))
        await asyncio.wait_for(run, 5)
        assert svc.status()["finished"] is True
        count = svc.published
        await asyncio.sleep(0.3)
        assert svc.published == count
    finally:
        stop.set()
        await asyncio.wait_for(run, 5)
        await svc.close()
        await bus.close()


async def test_pass_rate_sampler_serves_the_informative_task_again(
    nats_server: Server, redis_server: Server, tmp_path: Path
) -> None:
    """Through NATS and Redis: of two tasks, the one whose group was mixed goes out again, the solved one never."""
    run_id = f"{RUN}-sampler"
    cfg = TaskSourceConfig(
        service=ServiceSection(run_id=run_id, replica="ts-0", redis_url=redis_server.url),
        bus=BusConfig(url=nats_server.url),
        store=StoreConfig(type="local", root=str(tmp_path / "store")),
        tasks=TasksSection(
            envs=["reverse"],
            group_size=4,
            groups_per_step=2,
            max_staleness=0,  # a window of 2 tasks
            seed=4,
            poll_interval_s=0.05,
            sampler="pass_rate",
            sampler_revisit_share=1.0,  # every slot a revisit while one is ready
        ),
    )
    bus = await connect_bus(BusConfig(url=nats_server.url), name="test")
    await bus.ensure_streams()
    control = await connect_control(redis_server.url, run_id)
    svc = TaskSourceService(cfg)
    await svc.setup()
    stop = asyncio.Event()
    run = asyncio.create_task(svc.run(stop))
    consumer = await bus.consumer("rollout-worker", Task)
    try:
        await steady(bus, 2)
        first = list(await consumer.fetch(batch=2, timeout=5))
        mixed, solved = (d.msg for d in first)
        assert mixed.task_id == f"{run_id}:reverse-train-4000000-0" and "~" not in solved.task_id
        # Their groups come back (the learner records each group's attempts): 2 of 4 and 4 of 4 solved.
        # A fresh task is then worth (1 + 1) / (2 + 2) = 0.5; the mixed one 1 - 2 / 16 = 0.875.
        await control.task_stats.record_many(
            [(f"reverse/{mixed.metadata['key']}", r, bool(r)) for r in (0.0, 1.0, 0.0, 1.0)]
            + [(f"reverse/{solved.metadata['key']}", 1.0, True)] * 4
        )
        for d in first:
            await d.ack()
        await steady(bus, 2)
        again = [d.msg for d in await consumer.fetch(batch=2, timeout=5)]
        # The mixed task first (a revisit under a new id, same problem), then a fresh task: the
        # solved one is retired, so the second slot finds no revisit ready.
        assert [t.task_id for t in again] == [f"{mixed.task_id}~r2", f"{run_id}:reverse-train-4000000-2"]
        assert again[0].prompt == mixed.prompt and again[0].metadata == mixed.metadata
        status = svc.status()["sampler"]
        assert {k: status[k] for k in ("pool", "ready", "revisits", "left")} == {
            "pool": 2,
            "ready": 0,
            "revisits": 1,
            "left": {"retired": 1},
        }
        assert status["results"] == {"fresh": 2, "fresh_informative": 1, "revisit": 0, "revisit_informative": 0}
    finally:
        await consumer.close()
        stop.set()
        await asyncio.wait_for(run, 5)
        await svc.close()
        await control.close()
        await bus.close()


def env_only(url: str, **tasks: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLIPSTREAM_", "OTEL_"))}
    env.update(
        {
            "SLIPSTREAM_BUS__URL": url,
            "SLIPSTREAM_SERVICE__RUN_ID": RUN,
            "SLIPSTREAM_TELEMETRY__LOG_FORMAT": "json",
            **{f"SLIPSTREAM_TASKS__{k.upper()}": v for k, v in tasks.items()},
        }
    )
    return env


async def test_process_with_env_only_config_exits_0_at_max_steps(nats_server: Server, tmp_path: Path) -> None:
    env = env_only(
        nats_server.url, envs='["arith"]', group_size="4", groups_per_step="3", max_staleness="0", max_steps="2"
    )
    argv = [sys.executable, "-m", "slipstream.task_source"]
    bus = await connect_bus(BusConfig(url=nats_server.url), name="test")
    await bus.ensure_streams()
    proc = ManagedProcess("task-source", argv, tmp_path / "logs" / "ts1.log", env=env)
    try:
        await steady(bus, 3, settle_s=0.3)  # window = 3 × (0 + 1)
        assert proc.alive()
        await bus.publish(LEARNER_STEP, LearnerStep(step=2, policy_version=2, run_id=RUN))
        await until(lambda: not proc.alive(), 10, f"the source to exit; log:\n{proc.tail()}")
        assert proc.proc.returncode == 0, proc.tail()
        assert await stored(bus, "TASKS") == 3

        # A source started again for the finished run reads the last step and publishes nothing.
        await take(bus, 3)
        again = ManagedProcess("task-source", argv, tmp_path / "logs" / "ts2.log", env=env)
        try:
            await until(lambda: not again.alive(), 15, f"the second source to exit; log:\n{again.tail()}")
            assert again.proc.returncode == 0, again.tail()
        finally:
            again.stop(timeout_s=5)
        assert await stored(bus, "TASKS") == 0
    finally:
        proc.stop(timeout_s=5)
        await bus.close()
