"""Two learners for one run, under the Redis leader lease, against real nats-server and redis-server.

1. Two `python -m slipstream.learner` processes start together for one run, sharing the object
   store and the staging directory of one weight-publisher (in-process, with its real runtime).
   Exactly one leads and trains; the other logs that it waits for the leader, named. The leader is
   killed with SIGKILL after step 5 (checkpoint at step 4): the standby takes the lease within
   about one TTL, resumes from step 4, redoes step 5 as version 6 and runs to max_steps. A third
   learner started with lease_wait = false meanwhile exits 1 naming the holder. Across the run
   no version is announced twice, every trajectory is trained exactly once (checkpoints, ledger,
   task statistics agree), and the fencing token grew by one at the take-over.
2. The publisher's fence on its own: a version staged by a learner that does not hold the lease
   is discarded, one staged by the holder is announced, and with the lease vacant it waits.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
import torch
from scored_trajectories import eventually, group, publish, read_steps

from slipstream.bus import Bus, BusConfig, connect_bus
from slipstream.control import connect_control
from slipstream.learner.checkpoint import CheckpointMeta, Pointer
from slipstream.runtime.config import resolve
from slipstream.runtime.lifecycle import Runtime
from slipstream.schemas import (
    WeightAnnounce,
)
from slipstream.schemas.subjects import WEIGHTS_ANNOUNCE
from slipstream.stack import ManagedProcess, Server
from slipstream.store import LocalObjectStore
from slipstream.weight_publisher.config import WeightPublisherConfig
from slipstream.weight_publisher.service import WeightPublisherService
from slipstream.weights.staging import stage

pytestmark = pytest.mark.integration

RUN = "lease"
TTL_S = 2.0


def records(proc: ManagedProcess) -> list[dict[str, Any]]:
    return [json.loads(line) for line in proc.log_path.read_text().splitlines() if line.startswith("{")]


def first(proc: ManagedProcess, event: str) -> dict[str, Any] | None:
    return next((r for r in records(proc) if r.get("event") == event), None)


def learner(tmp_path: Path, nats_url: str, redis_url: str, name: str, **learner_fields: Any) -> ManagedProcess:
    settings: dict[str, dict[str, Any]] = {
        "service": {"run_id": RUN, "replica": name, "redis_url": redis_url},
        "bus": {"url": nats_url},
        "store": {"root": str(tmp_path / "store")},
        "model": {"preset": "tiny", "seed": 0, "threads": 1},
        "telemetry": {"log_format": "json", "traces": "none"},
        "learner": {
            "staging_dir": str(tmp_path / "staging"),
            "outcomes_path": str(tmp_path / "outcomes.jsonl"),
            "max_staleness": 100,
            "announce_timeout_s": 0.3,
            "max_steps": 8,
            "groups_per_step": 2,
            "checkpoint_every": 2,
            "keep_checkpoints": 20,
            "group_timeout_s": 60.0,
            "ack_wait_s": 3.0,  # the killed leader's deliveries come back after 3 s
            "lease_ttl_s": TTL_S,
            "control_timeout_s": 0.5,
            **learner_fields,
        },
    }
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLIPSTREAM_", "OTEL_"))}
    for section, fields in settings.items():
        for key, value in fields.items():
            text = str(value).lower() if isinstance(value, bool) else str(value)
            env[f"SLIPSTREAM_{section.upper()}__{key.upper()}"] = text
    argv = [sys.executable, "-m", "slipstream.learner"]
    return ManagedProcess(name, argv, tmp_path / "logs" / f"{name}.log", env=env)


@pytest.fixture
async def bus(nats_server: Server) -> AsyncIterator[Bus]:
    b = await connect_bus(BusConfig(url=nats_server.url), name="lease-test")
    await b.ensure_streams()
    yield b
    await b.close()


class Publisher:
    """The weight-publisher in this process, under its real runtime (probes, drain), and what it announced."""

    def __init__(self, tmp_path: Path, nats_url: str, redis_url: str, run_id: str = RUN) -> None:
        cfg = resolve(
            WeightPublisherConfig,
            environ={},
            overrides={
                "service": {"run_id": run_id, "replica": "publisher", "redis_url": redis_url},
                "bus": {"url": nats_url},
                "store": {"root": str(tmp_path / "store")},
                "publisher": {"staging_dir": str(tmp_path / "staging"), "retry_max_s": 0.5, "control_timeout_s": 0.5},
            },
        )
        self.service = WeightPublisherService(cfg)
        self.runtime = Runtime(self.service, cfg.service)
        self.task: asyncio.Task[int] | None = None

    async def __aenter__(self) -> Publisher:
        self.task = asyncio.create_task(self.runtime.run(handle_signals=False))
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.runtime.request_stop("test over")
        assert self.task is not None
        assert await asyncio.wait_for(self.task, 30) == 0


async def announced(bus: Bus, run_id: str, into: list[int], tokens: list[int] | None = None) -> None:
    reader = bus.subscribe(WEIGHTS_ANNOUNCE, WeightAnnounce, deliver="all")
    try:
        async for d in reader:
            if d.msg.run_id == run_id:
                into.append(d.msg.policy_version)
                if tokens is not None:
                    tokens.append(d.msg.fence_token)
    finally:
        await reader.close()


async def test_one_of_two_learners_trains_and_the_standby_takes_over_from_the_checkpoint(
    nats_server: Server, redis_server: Server, bus: Bus, tmp_path: Path
) -> None:
    first_groups = [group(f"a{i}") for i in range(10)]  # steps 1-5
    partial = group("p")  # half before the kill, half after
    later = [group(f"b{i}") for i in range(5)]  # with the partial group and step 5's groups: steps 5-8
    published = [s.trajectory.trajectory_id for g in [*first_groups, partial, *later] for s in g]
    await publish(bus, [s for g in first_groups for s in g] + partial[:2])
    versions: list[int] = []
    watcher = asyncio.create_task(announced(bus, RUN, versions))
    procs = []
    async with Publisher(tmp_path, nats_server.url, redis_server.url):
        try:
            procs = [learner(tmp_path, nats_server.url, redis_server.url, n) for n in ("learner-a", "learner-b")]
            await eventually(lambda: any(first(p, "leading the run") for p in procs), 90, "a leader")
            leader, standby = procs if first(procs[0], "leading the run") else procs[::-1]
            led = first(leader, "leading the run")
            assert led is not None and led["holder"].startswith(leader.name + ":") and led["token"] == 1

            # Exactly one trains; the other names the one it waits for.
            await eventually(lambda: first(standby, "waiting for the leader lease") is not None, 60, "the standby")
            waiting = first(standby, "waiting for the leader lease")
            assert waiting is not None and waiting["holder"] == led["holder"], waiting
            await eventually(
                lambda: any(r.get("event") == "step" and r["step"] == 5 for r in records(leader)), 90, "step 5"
            )
            await eventually(lambda: 5 in versions, 15, "version 5 announced")
            assert first(standby, "step") is None and first(standby, "resumed") is None

            leader.send(signal.SIGKILL)
            killed_at = time.monotonic()
            leader.proc.wait(10)
            await eventually(lambda: first(standby, "leading the run") is not None, 30, "the take-over")
            took_s = time.monotonic() - killed_at
            assert took_s < TTL_S + 2.0, f"the standby took {took_s:.1f}s to take over a {TTL_S}s lease"
            took = first(standby, "leading the run")
            assert took is not None and took["token"] == led["token"] + 1

            # A third learner that must not wait exits 1, naming the new holder.
            third = learner(tmp_path, nats_server.url, redis_server.url, "learner-c", lease_wait=False)
            procs.append(third)
            rc = await asyncio.to_thread(third.proc.wait, 60)
            assert rc == 1, third.tail()
            refused = next((r for r in records(third) if r.get("holder") and r.get("level") == "error"), None)
            assert refused is not None and refused["holder"] == took["holder"], third.tail()
            assert first(third, "resumed") is None and first(third, "started") is None

            await publish(bus, partial[2:] + [s for g in later for s in g])
            rc = await asyncio.to_thread(standby.proc.wait, 90)
            assert rc == 0, standby.tail()
            await eventually(lambda: 9 in versions, 15, "version 9 announced")
        finally:
            for p in procs:
                p.stop(5)
            watcher.cancel()

    resumed = first(standby, "resumed")
    assert resumed is not None and (resumed["step"], resumed["policy_version"]) == (4, 5)
    steps = await read_steps(bus, 9, 10)
    assert [(s.step, s.policy_version) for s in steps] == [
        (1, 1), (2, 2), (3, 3), (4, 4), (5, 5),  # the leader; its step 5 is lost with it
        (5, 6), (6, 7), (7, 8), (8, 9),  # the standby redoes step 5 from the checkpoint, as a new version
    ]  # fmt: skip
    assert sorted(versions) == list(range(10)), f"announced {versions}: a version twice, or one missing"

    # Trained exactly once: checkpoints, the Redis ledger and the task statistics agree.
    store = LocalObjectStore(tmp_path / "store")
    pointer = msgspec.json.decode(store.get(f"checkpoints/{RUN}/latest.json"), type=Pointer)
    assert pointer.fence_token == took["token"]
    metas = [msgspec.json.decode(store.get(f"{p}/meta.json"), type=CheckpointMeta) for p in pointer.chain]
    in_checkpoints = [tid for m in metas for tid in m.trained_ids]
    assert sorted(in_checkpoints) == sorted(published) and len(in_checkpoints) == 64
    control = await connect_control(redis_server.url, RUN)
    try:
        assert all(await control.ledger.counted(published))
        names = [f"a{i}" for i in range(10)] + ["p"] + [f"b{i}" for i in range(5)]
        stats = await control.task_stats.get_many([f"arith/{n}" for n in names])
        assert [(s.attempts, s.solved) for s in stats] == [(4, 2)] * len(names)
        assert await control.lease("observer").current() is None  # released by the standby's clean exit
    finally:
        await control.close()


def staged_file(tmp_path: Path, version: int, fence: dict[str, str] | None) -> Path:
    return stage(tmp_path / "staging", version, {"w": torch.full((4,), float(version))}, extra=fence)


async def test_the_publisher_announces_only_what_the_lease_holder_staged(
    nats_server: Server, redis_server: Server, bus: Bus, tmp_path: Path
) -> None:
    run = "fence"
    versions: list[int] = []
    tokens: list[int] = []
    watcher = asyncio.create_task(announced(bus, run, versions, tokens))
    control = await connect_control(redis_server.url, run)
    holder = control.lease("learner-b", ttl_s=30.0)
    try:
        async with Publisher(tmp_path, nats_server.url, redis_server.url, run_id=run) as pub:
            svc = pub.service
            # Nobody leads: a fenced version waits, it is not announced (and not discarded).
            old = staged_file(tmp_path, 0, {"fence_token": "1", "lease_holder": "learner-a"})
            await eventually(lambda: "held_back" in svc.status(), 10, "the fence to hold version 0 back")
            assert svc.status()["held_back"]["reason"].endswith("lease_vacant") and old.exists()
            # Another learner takes the lease: version 0 was not staged by it, so it is discarded.
            token = await holder.acquire()
            await eventually(lambda: svc.fenced == 1, 10, "version 0 fenced")
            assert not old.exists() and versions == []
            # The holder's own version, and an unfenced one (a learner without Redis), go out.
            staged_file(tmp_path, 1, {"fence_token": str(token), "lease_holder": "learner-b"})
            staged_file(tmp_path, 2, None)
            await eventually(lambda: versions == [1, 2], 15, "versions 1 and 2 announced")
            assert tokens == [token, 0]  # the announce carries the staged token for followers to compare
            assert svc.status()["control"]["redis"] == "ok" and svc.status()["fenced"] == 1
            # The holder lets go: its next version waits again.
            await holder.release()
            staged_file(tmp_path, 3, {"fence_token": str(token), "lease_holder": "learner-b"})
            await eventually(lambda: svc.status().get("held_back", {}).get("policy_version") == 3, 10, "v3 held")
            await asyncio.sleep(0.5)
            assert versions == [1, 2]
    finally:
        watcher.cancel()
        await control.close()
