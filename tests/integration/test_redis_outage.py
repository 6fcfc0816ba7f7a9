"""Redis stopped mid-run and restarted on the same port (empty: the test Redis keeps no data).

1. A learner and a weight-publisher run under their real runtime (probes on HTTP), with the
   control plane on, while scripted groups keep arriving. Redis is stopped by PID for longer than
   the lease TTL, then started again on its port. While it is down both report the control plane
   degraded on /readyz and the learner pauses (no step, acks held); afterwards both recover by
   themselves: the learner takes its lapsed lease back (token + 1), restores the ledger from its
   checkpoints and trains on. No service exits; every published trajectory is trained exactly
   once; versions are announced once each, without a gap.
2. The task source's difficulty filter: always- and never-solved tasks are skipped and counted;
   while Redis is down tasks go out unfiltered (the source keeps working); after the restart the
   filter applies again.
"""

from __future__ import annotations

import asyncio
import json
import time
import urllib.error
import urllib.request
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest
from scored_trajectories import SUBJECT, eventually, group

from slipstream.bus import Bus, BusConfig, connect_bus
from slipstream.control import connect_control
from slipstream.learner.config import LearnerConfig
from slipstream.learner.outcomes import read_outcomes
from slipstream.learner.service import LearnerService
from slipstream.runtime.config import resolve
from slipstream.runtime.lifecycle import Runtime
from slipstream.runtime.service import Service
from slipstream.schemas import (
    LearnerStep,
    Task,
    WeightAnnounce,
)
from slipstream.schemas.subjects import LEARNER_STEP, WEIGHTS_ANNOUNCE
from slipstream.stack import Server, start_redis
from slipstream.task_source.config import TaskSourceConfig
from slipstream.task_source.generator import TaskGenerator
from slipstream.task_source.service import TaskSourceService
from slipstream.weight_publisher.config import WeightPublisherConfig
from slipstream.weight_publisher.service import WeightPublisherService

pytestmark = pytest.mark.integration

TTL_S = 3.0
GROUPS = 32  # 16 steps of 2 groups


class Running:
    """A service under its real runtime in this process: HTTP probes, lifecycle, exit code."""

    def __init__(self, service: Service, cfg: Any) -> None:
        self.service = service
        self.runtime = Runtime(service, cfg.service)
        self.task: asyncio.Task[int] | None = None
        self.readyz: dict[str, Any] = {}

    async def start(self) -> None:
        self.task = asyncio.create_task(self.runtime.run(handle_signals=False))
        await eventually(lambda: self.runtime.state.value == "running", 60, f"{self.service.name} running")

    @property
    def exited(self) -> bool:
        return self.task is not None and self.task.done()

    async def status(self) -> dict[str, Any]:
        """GET /readyz (200 or 503 alike) and return its `status` object."""

        def get() -> dict[str, Any]:
            url = f"http://127.0.0.1:{self.runtime.port}/readyz"
            try:
                with urllib.request.urlopen(url, timeout=5) as resp:
                    body = resp.read()
            except urllib.error.HTTPError as exc:
                body = exc.read()
            return json.loads(body)  # type: ignore[no-any-return]

        self.readyz = await asyncio.to_thread(get)
        return self.readyz["status"]  # type: ignore[no-any-return]

    async def stop(self) -> int:
        self.runtime.request_stop("test over")
        assert self.task is not None
        return await asyncio.wait_for(self.task, 60)


async def poll(run: Running, predicate: Callable[[dict[str, Any]], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate(await run.status()):
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout_s}s waiting for {what}; last /readyz: {run.readyz}")
        await asyncio.sleep(0.1)


@pytest.fixture
async def bus(nats_server: Server) -> AsyncIterator[Bus]:
    b = await connect_bus(BusConfig(url=nats_server.url), name="outage-test")
    await b.ensure_streams()
    yield b
    await b.close()


async def collect(bus: Bus, subject: str, cls: type[Any], into: list[Any]) -> None:
    reader = bus.subscribe(subject, cls, deliver="all")
    try:
        async for d in reader:
            into.append(d.msg)
    finally:
        await reader.close()


async def test_learner_and_publisher_ride_out_a_redis_restart_without_losing_or_double_counting(
    nats_server: Server, bus: Bus, tmp_path: Path
) -> None:
    run_id = "outage"
    redis = start_redis(tmp_path / "redis", tmp_path / "logs")
    common = {"bus": {"url": nats_server.url}, "store": {"root": str(tmp_path / "store")}}
    service = {"run_id": run_id, "redis_url": redis.url}
    learner_cfg = resolve(
        LearnerConfig,
        environ={},
        overrides={
            **common,
            "service": {**service, "replica": "learner-0"},
            "model": {"preset": "tiny", "seed": 0, "threads": 1},
            "learner": {
                "staging_dir": str(tmp_path / "staging"),
                "outcomes_path": str(tmp_path / "outcomes.jsonl"),
                "max_staleness": 100,
                "announce_timeout_s": 0.3,
                "groups_per_step": 2,
                "checkpoint_every": 1,
                "keep_checkpoints": 3,
                "group_timeout_s": 120.0,
                "lease_ttl_s": TTL_S,
                "control_timeout_s": 0.5,
            },
        },
    )
    publisher_cfg = resolve(
        WeightPublisherConfig,
        environ={},
        overrides={
            **common,
            "service": {**service, "replica": "publisher-0"},
            "publisher": {"staging_dir": str(tmp_path / "staging"), "retry_max_s": 0.5, "control_timeout_s": 0.5},
        },
    )
    learner = Running(LearnerService(learner_cfg), learner_cfg)
    publisher = Running(WeightPublisherService(publisher_cfg), publisher_cfg)
    announces: list[WeightAnnounce] = []
    steps: list[LearnerStep] = []
    watchers = [
        asyncio.create_task(collect(bus, WEIGHTS_ANNOUNCE, WeightAnnounce, announces)),
        asyncio.create_task(collect(bus, LEARNER_STEP, LearnerStep, steps)),
    ]
    published: list[str] = []

    async def feed() -> None:
        for i in range(GROUPS):
            for s in group(f"g{i}"):
                await bus.publish(SUBJECT, s, msg_id=s.trajectory.trajectory_id)
                published.append(s.trajectory.trajectory_id)
            await asyncio.sleep(0.3)

    feeder: asyncio.Task[None] | None = None
    try:
        await learner.start()
        await publisher.start()
        feeder = asyncio.create_task(feed())
        await poll(learner, lambda s: s["step"] >= 3 and s["control"]["redis"] == "ok", 60, "three steps")
        token = (await learner.status())["lease"]["token"]

        redis.stop()  # by PID
        down_at = time.monotonic()
        await poll(learner, lambda s: s["control"]["redis"] == "degraded", 10, "the learner to report degraded")
        await poll(publisher, lambda s: s["control"]["redis"] == "degraded", 10, "the publisher to report degraded")
        await poll(learner, lambda s: s["lease"].get("paused") is not None, 10, "training to pause")
        paused_step = (await learner.status())["step"]
        await asyncio.sleep(max(0.0, TTL_S + 1.0 - (time.monotonic() - down_at)))  # down for longer than the ttl
        status = await learner.status()
        assert status["step"] == paused_step, "the learner trained while it could not confirm its lease"
        assert not learner.exited and not publisher.exited

        redis = start_redis(tmp_path / "redis", tmp_path / "logs", port=redis.port)  # same port, no data
        await poll(learner, lambda s: s["control"]["redis"] == "ok" and s["step"] > paused_step, 30, "recovery")
        await poll(publisher, lambda s: s["control"]["redis"] == "ok", 10, "the publisher to recover")
        status = await learner.status()
        assert status["lease"]["token"] == token + 1 and "paused" not in status["lease"]

        await asyncio.wait_for(feeder, 60)
        outcomes = tmp_path / "outcomes.jsonl"
        await eventually(
            lambda: len(read_outcomes(outcomes)) >= len(published) and len(announces) >= GROUPS // 2 + 1,
            60,
            "every trajectory settled and every version announced",
        )
        assert not learner.exited and not publisher.exited, "a service exited during the outage"
        # What was trained after the restart is in the (new, empty at first) ledger and the task statistics.
        after = [o for o in read_outcomes(outcomes) if o.outcome == "trained" and o.step > paused_step]
        tasks = sorted({o.trajectory_id.rsplit("-", 1)[0] for o in after})
        assert len(after) == 4 * len(tasks) >= 8, "whole groups trained after the restart"
        control = await connect_control(redis.url, run_id)
        try:
            assert all(await control.ledger.counted([o.trajectory_id for o in after]))
            stats = await control.task_stats.get_many([f"arith/{t}" for t in tasks])
            assert [(s.attempts, s.solved) for s in stats] == [(4, 2)] * len(tasks)
        finally:
            await control.close()
    finally:
        if feeder is not None:
            feeder.cancel()
        codes = [await run.stop() for run in (learner, publisher) if run.task is not None]
        for w in watchers:
            w.cancel()
        redis.stop()
    assert codes == [0, 0]

    # Every published trajectory trained exactly once (one `trained` line each, nothing dropped).
    lines = read_outcomes(tmp_path / "outcomes.jsonl")
    assert sorted(o.trajectory_id for o in lines if o.outcome == "trained") == sorted(published)
    assert [o for o in lines if o.outcome != "trained"] == []
    # One step and one announce per version, no version twice and none skipped.
    assert [s.policy_version for s in steps] == list(range(1, GROUPS // 2 + 1))
    assert sorted(a.policy_version for a in announces) == list(range(GROUPS // 2 + 1))


def tasks_ahead(run_id: str, n: int) -> list[Task]:
    """The first `n` tasks the source will draw (its generator is deterministic)."""
    gen = TaskGenerator(["arith"], seed=3, group_size=2, run_id=run_id)
    return [gen.next(min_policy_version=0, now=0.0) for _ in range(n)]


async def take(bus: Bus, n: int) -> list[str]:
    """Take and ack `n` tasks on the rollout workers' durable; their problem keys."""
    consumer = await bus.consumer("rollout-worker", Task)
    out: list[str] = []
    deadline = time.monotonic() + 15
    while len(out) < n and time.monotonic() < deadline:
        for d in await consumer.fetch(batch=n - len(out), timeout=0.5):
            out.append(d.msg.metadata["key"])
            await d.ack()
    await consumer.close()
    assert len(out) == n, f"took {len(out)} tasks, wanted {n}"
    return out


async def test_task_source_skips_solved_tasks_and_keeps_publishing_while_redis_is_down(
    nats_server: Server, bus: Bus, tmp_path: Path
) -> None:
    run_id = "skips"
    keys = [f"arith/{t.metadata['key']}" for t in tasks_ahead(run_id, 12)]
    assert len(set(keys[:10])) == 10 and keys[9] not in keys[10:], "the test needs distinct problems"
    redis = start_redis(tmp_path / "redis", tmp_path / "logs")

    async def solved(indices: list[int], correct: bool) -> None:
        control = await connect_control(redis.url, run_id)
        try:
            await control.task_stats.record_many((keys[i], float(correct), correct) for i in indices for _ in range(3))
        finally:
            await control.close()

    await solved([0, 1, 5, 6], True)
    await solved([2], False)
    cfg = resolve(
        TaskSourceConfig,
        environ={},
        overrides={
            "service": {"run_id": run_id, "replica": "ts-0", "redis_url": redis.url},
            "bus": {"url": nats_server.url},
            "tasks": {
                "envs": ["arith"],
                "seed": 3,
                "group_size": 2,
                "groups_per_step": 2,
                "max_staleness": 0,  # a window of 2 tasks
                "poll_interval_s": 0.05,
                "skip_min_attempts": 3,
            },
        },
    )
    source = Running(TaskSourceService(cfg), cfg)
    try:
        await source.start()
        # Tasks 0 and 1 are always solved, 2 never: skipped; 3 and 4 fill the window.
        assert await take(bus, 2) == [keys[3].split("/", 1)[1], keys[4].split("/", 1)[1]]
        status = await source.status()
        assert status["skipped"] == {"always_solved": 2, "never_solved": 1} and status["filter"] == "on"

        redis.stop()
        await poll(source, lambda s: s["control"]["redis"] == "degraded", 10, "the source to report degraded")
        # 5 and 6 would be skipped: with Redis down they go out unfiltered, the source keeps working.
        assert await take(bus, 2) == [keys[5].split("/", 1)[1], keys[6].split("/", 1)[1]]
        status = await source.status()
        assert status["filter"].startswith("unfiltered") and status["skipped"] == {
            "always_solved": 2,
            "never_solved": 1,
        }
        assert not source.exited

        redis = start_redis(tmp_path / "redis", tmp_path / "logs", port=redis.port)  # empty again
        await solved([9], True)
        await poll(source, lambda s: s["control"]["redis"] == "ok", 10, "the source to recover")
        # 7 and 8 were drawn (unfiltered) while Redis was down; 9 is drawn now, and skipped.
        assert await take(bus, 2) == [keys[7].split("/", 1)[1], keys[8].split("/", 1)[1]]
        assert await take(bus, 2) == [keys[10].split("/", 1)[1], keys[11].split("/", 1)[1]]
        status = await source.status()
        assert status["filter"] == "on" and status["skipped"] == {"always_solved": 3, "never_solved": 1}
    finally:
        code = await source.stop() if source.task is not None else 0
        redis.stop()
    assert code == 0
