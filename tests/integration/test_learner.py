"""The learner against a real nats-server with the tiny model.

1. In process: synthetic scored groups go in; the learner makes N steps, stages versions 0..N,
   publishes N LearnerStep messages, counts every drop by reason, and leaves TRAJ_SCORED empty.
2. Crash and resume: `python -m slipstream.learner` (env-only config) is killed with SIGKILL after
   a checkpoint, mid-run, and started again. Across both runs every published trajectory is
   trained exactly once (the committed checkpoints' ids and the outcome log agree), nothing is
   left in the stream, and version numbers continue without reuse.
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
from scored_trajectories import SUBJECT, UNIFORM_LOGPROB, eventually, group, publish, read_steps, trajectory

from slipstream.bus import Bus, BusConfig, connect_bus
from slipstream.learner.checkpoint import CheckpointMeta, Pointer
from slipstream.learner.config import LearnerConfig
from slipstream.learner.outcomes import read_outcomes
from slipstream.learner.service import LearnerService
from slipstream.runtime.config import resolve
from slipstream.schemas import (
    PolicySegment,
    ScoredEpisode,
    ScoredTrajectory,
    ToolEvent,
    episode_from_trajectory,
    pack_floats,
    pack_mask,
    sample_from_trajectory,
)
from slipstream.stack import ManagedProcess, Server
from slipstream.store import LocalObjectStore
from slipstream.store.episodes import HEADROOM, offload
from slipstream.weights.staging import list_staged

pytestmark = pytest.mark.integration


async def scored_backlog(bus: Bus) -> tuple[int, int, int]:
    """(messages in TRAJ_SCORED, pending for the learner, ack-pending at the learner)."""
    info = await bus.stream_info("TRAJ_SCORED")
    c = info["consumers"]["learner"]
    return info["messages"], c["num_pending"], c["num_ack_pending"]


@pytest.fixture
async def bus(nats_server: Server) -> AsyncIterator[Bus]:
    b = await connect_bus(BusConfig(url=nats_server.url), name="learner-test")
    await b.ensure_streams()
    yield b
    await b.close()


def learner_settings(tmp_path: Path, **learner: Any) -> dict[str, dict[str, Any]]:
    return {
        "service": {"run_id": "it", "replica": "learner-0"},
        "store": {"root": str(tmp_path / "store")},
        "model": {"preset": "tiny", "seed": 0, "threads": 1},
        "learner": {
            "staging_dir": str(tmp_path / "staging"),
            "outcomes_path": str(tmp_path / "outcomes.jsonl"),
            "max_staleness": 100,
            "announce_timeout_s": 0.3,
            **learner,
        },
    }


async def test_learner_trains_n_steps_stages_every_version_and_accounts_for_every_trajectory(
    nats_server: Server, bus: Bus, tmp_path: Path
) -> None:
    overrides = learner_settings(
        tmp_path, max_steps=3, groups_per_step=2, checkpoint_every=2, group_timeout_s=1.0, commit_when_idle_s=0.0
    )
    overrides["bus"] = {"url": nats_server.url}
    svc = LearnerService(resolve(LearnerConfig, environ={}, overrides=overrides))
    await svc.setup()
    assert (svc.step, svc.version) == (0, 0)
    assert [s.version for s in list_staged(tmp_path / "staging")] == [0]  # a fresh run stages its initial weights
    stop = asyncio.Event()
    run = asyncio.create_task(svc.run(stop))
    try:
        # What must be dropped, one reason each.
        await publish(
            bus,
            [
                trajectory("bad", "m/1", size=1, reward=1.0, segments=[PolicySegment(0, 2)]),  # covers 2 of 3
                trajectory("masked", "n/1", size=1, reward=1.0, mask=[0, 0, 0]),
                trajectory("eval", "h/1", size=1, reward=1.0, split="heldout"),
                trajectory("ahead", "a/1", size=1, reward=1.0, version=7),  # no version 7 exists yet
                *[trajectory(f"uni-{i}", "u/1", size=2, reward=1.0) for i in range(2)],
                trajectory("lonely", "inc/1", size=3, reward=1.0),
            ],
        )
        expected = {"malformed": 2, "no_trained_tokens": 1, "heldout": 1, "uniform_group": 2, "incomplete_group": 1}
        await eventually(lambda: svc.intake is not None and svc.intake.dropped == expected, 15, "the drops")
        # Two steps' worth of groups; once their checkpoint commits, a redelivered one is a duplicate.
        groups = [group(f"g{i}") for i in range(6)]
        await publish(bus, [s for g in groups[:4] for s in g])
        await eventually(lambda: svc.committed_step == 2, 30, "the checkpoint of step 2")
        await publish(bus, [groups[0][1]], msg_id_suffix=":again")  # a new msg id: the stream keeps it
        await eventually(lambda: svc.intake is not None and svc.intake.dropped.get("duplicate") == 1, 10, "dup")
        await publish(bus, [s for g in groups[4:] for s in g])
        await asyncio.wait_for(run, 60)  # max_steps reached: run returns by itself
    finally:
        stop.set()
        if not run.done():
            await asyncio.wait_for(run, 30)
        await svc.close()

    steps = await read_steps(bus, 3, 10)
    assert [(s.step, s.policy_version, s.n_groups, s.n_trajectories, s.n_tokens) for s in steps] == [
        (1, 1, 2, 8, 24),
        (2, 2, 2, 8, 24),
        (3, 3, 2, 8, 24),
    ]
    assert [s.reward_mean for s in steps] == [0.5, 0.5, 0.5] and [s.accuracy for s in steps] == [0.5, 0.5, 0.5]
    assert steps[0].staleness == {"0": 8} and steps[1].staleness == {"1": 8}  # groups 2-3 came at version 0
    assert steps[-1].dropped == {**expected, "duplicate": 1}
    assert all(s.run_id == "it" and s.grad_norm > 0 and s.step_time_s > 0 for s in steps)
    assert [s.version for s in list_staged(tmp_path / "staging")] == [0, 1, 2, 3]
    assert await scored_backlog(bus) == (0, 0, 0)  # everything acked: trained, dropped or duplicate
    store = LocalObjectStore(tmp_path / "store")
    pointer = msgspec.json.decode(store.get("checkpoints/it/latest.json"), type=Pointer)
    assert (pointer.step, pointer.policy_version) == (3, 3)  # the final commit at max_steps
    outcomes = read_outcomes(tmp_path / "outcomes.jsonl")
    trained = sorted(o.trajectory_id for o in outcomes if o.outcome == "trained")
    assert trained == sorted(s.trajectory.trajectory_id for g in groups for s in g)
    dropped = sorted((o.trajectory_id, o.reason) for o in outcomes if o.outcome == "dropped")
    assert dropped == sorted(
        [
            ("bad", "malformed"),
            ("ahead", "malformed"),
            ("masked", "no_trained_tokens"),
            ("eval", "heldout"),
            ("uni-0", "uniform_group"),
            ("uni-1", "uniform_group"),
            ("lonely", "incomplete_group"),
            ("g0-1", "duplicate"),
        ]
    )


async def test_stop_commits_what_was_trained_and_hands_back_the_rest(
    nats_server: Server, bus: Bus, tmp_path: Path
) -> None:
    overrides = learner_settings(tmp_path, groups_per_step=1, checkpoint_every=10)
    overrides["bus"] = {"url": nats_server.url}
    svc = LearnerService(resolve(LearnerConfig, environ={}, overrides=overrides))
    await svc.setup()
    stop = asyncio.Event()
    run = asyncio.create_task(svc.run(stop))
    try:
        partial = group("p")[:2]  # a group that will never fill up before the stop
        await publish(bus, [*group("g0"), *group("g1"), *partial])
        await eventually(
            lambda: svc.step == 2 and svc.intake is not None and svc.intake.pending_groups == 1, 30, "2 steps"
        )
        assert svc.committed_step == 0 and await scored_backlog(bus) == (10, 0, 10)  # all held: 8 trained, 2 pending
        stop.set()  # what SIGTERM does
        await asyncio.wait_for(run, 30)
    finally:
        stop.set()
        await svc.close()
    assert svc.committed_step == 2
    store = LocalObjectStore(tmp_path / "store")
    assert msgspec.json.decode(store.get("checkpoints/it/latest.json"), type=Pointer).step == 2
    assert (await scored_backlog(bus))[0] == 2  # the trained 8 are acked
    # The partial group was handed back (a nak without delay): it is there for the next fetch at once,
    # not after the 600 s ack wait.
    consumer = await bus.consumer("learner", ScoredTrajectory)
    back = await consumer.fetch(10, 2.0)
    assert sorted((d.msg.trajectory.trajectory_id, d.num_delivered) for d in back) == [("p-0", 2), ("p-1", 2)]
    trained = [o.trajectory_id for o in read_outcomes(tmp_path / "outcomes.jsonl") if o.outcome == "trained"]
    assert len(trained) == 8 and not any(t.startswith("p-") for t in trained)


# --- crash and resume ----------------------------------------------------------------------------------


def learner_process(tmp_path: Path, nats_url: str, name: str) -> ManagedProcess:
    settings = learner_settings(
        tmp_path,
        max_steps=8,
        groups_per_step=2,
        checkpoint_every=2,
        commit_when_idle_s=0.0,  # commit only every 2 steps, so the kill lands between commits
        keep_checkpoints=20,
        group_timeout_s=60.0,
        ack_wait_s=3.0,  # the killed run's deliveries come back after 3 s, not the table's 600 s
    )
    settings["bus"] = {"url": nats_url}
    settings["telemetry"] = {"log_format": "json", "traces": "none"}
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLIPSTREAM_", "OTEL_"))}
    for section, fields in settings.items():
        for key, value in fields.items():
            env[f"SLIPSTREAM_{section.upper()}__{key.upper()}"] = str(value)
    return ManagedProcess(
        name, [sys.executable, "-m", "slipstream.learner"], tmp_path / "logs" / f"{name}.log", env=env
    )


def log_records(proc: ManagedProcess) -> list[dict[str, Any]]:
    return [json.loads(line) for line in proc.log_path.read_text().splitlines() if line.startswith("{")]


async def test_a_killed_learner_resumes_from_its_checkpoint_without_losing_or_double_counting(
    nats_server: Server, bus: Bus, tmp_path: Path
) -> None:
    store = LocalObjectStore(tmp_path / "store")
    first = [group(f"a{i}") for i in range(10)]  # steps 1-5
    partial = group("p")  # half of it before the kill, half after
    later = [group(f"b{i}") for i in range(5)]  # with the partial group and step 5's groups: steps 5-8
    published = [s.trajectory.trajectory_id for g in [*first, partial, *later] for s in g]
    await publish(bus, [s for g in first for s in g] + partial[:2])

    run_a = learner_process(tmp_path, nats_server.url, "learner-a")
    try:

        def committed_step() -> int:
            if not store.exists("checkpoints/it/latest.json"):
                return -1
            return msgspec.json.decode(store.get("checkpoints/it/latest.json"), type=Pointer).step

        def stepped(n: int) -> bool:
            return any(r.get("event") == "step" and r.get("step") == n for r in log_records(run_a))

        await eventually(lambda: stepped(5) or not run_a.alive(), 60, "run A's step 5")
        assert run_a.alive(), run_a.tail()
        assert committed_step() == 4  # step 5 is trained, staged and announced, but not committed
        run_a.send(signal.SIGKILL)
        run_a.proc.wait(10)
    finally:
        run_a.stop(5)
    assert [s.version for s in list_staged(tmp_path / "staging")] == [0, 1, 2, 3, 4, 5]
    # As if run A had died between committing step 4 and writing its lines (chaos hit that window
    # once): the lines of step 4's commit are taken out of the log, and run B must write them back.
    log_path = tmp_path / "outcomes.jsonl"
    before = read_outcomes(log_path)
    kept = [o for o in before if not (o.outcome == "trained" and o.step == 4)]
    assert len(before) - len(kept) == 16  # steps 3 and 4: 4 groups of 4
    log_path.write_bytes(b"".join(msgspec.json.encode(o) + b"\n" for o in kept))

    run_b = learner_process(tmp_path, nats_server.url, "learner-b")
    try:
        await publish(bus, partial[2:] + [s for g in later for s in g])
        deadline = time.monotonic() + 90
        while run_b.alive() and time.monotonic() < deadline:
            await asyncio.sleep(0.2)
        assert run_b.proc.poll() == 0, run_b.tail()
    finally:
        run_b.stop(5)

    restored = [r for r in log_records(run_b) if r.get("event", "").startswith("outcome lines of the last commit")]
    assert [(r["trajectories"], r["step"]) for r in restored] == [(16, 4)]
    resumed = next(r for r in log_records(run_b) if r.get("event") == "resumed")
    assert (resumed["step"], resumed["policy_version"], resumed["staged"]) == (4, 5, 5)
    steps = await read_steps(bus, 9, 10)
    assert [(s.step, s.policy_version) for s in steps] == [
        (1, 1), (2, 2), (3, 3), (4, 4), (5, 5),  # run A; step 5 is lost with it
        (5, 6), (6, 7), (7, 8), (8, 9),  # run B redoes step 5 from the checkpoint, as a new version
    ]  # fmt: skip
    assert [s.version for s in list_staged(tmp_path / "staging")] == list(range(10))
    assert steps[-1].dropped == {}  # nothing dropped, nothing counted as a duplicate
    assert await scored_backlog(bus) == (0, 0, 0)

    # Trained exactly once: the committed checkpoints' ids partition what was published.
    pointer = msgspec.json.decode(store.get("checkpoints/it/latest.json"), type=Pointer)
    metas = [msgspec.json.decode(store.get(f"{p}/meta.json"), type=CheckpointMeta) for p in pointer.chain]
    assert sorted(m.step for m in metas) == [2, 4, 6, 8]
    in_checkpoints = [tid for m in metas for tid in m.trained_ids]
    assert len(in_checkpoints) == len(published) == 64
    assert sorted(in_checkpoints) == sorted(published)
    trained = [o for o in read_outcomes(log_path) if o.outcome == "trained"]
    assert sorted(o.trajectory_id for o in trained) == sorted(published)  # one line each: run A's lost step left none
    by_id = {o.trajectory_id: o for o in trained}
    step4 = next(m for m in metas if m.step == 4)
    assert {(by_id[t].step, by_id[t].policy_version) for t in step4.trained_ids} == {(4, 4)}
    assert [by_id[t].sequences for t in step4.trained_ids] == step4.trained_sequences
    assert all(len(seqs) == 1 for seqs in step4.trained_sequences)


def agentic_group(name: str, store: LocalObjectStore, size: int = 4) -> list[ScoredEpisode]:
    """Multi-sample episodes (policy with a tool result, a summary branch, a frozen sub-agent);
    the odd ones travel by reference, their bodies in the learner's store."""
    out: list[ScoredEpisode] = []
    for i in range(size):
        v1 = trajectory(f"{name}-{i}", f"{name}/s1", size=size, reward=float(i % 2)).trajectory
        root = msgspec.structs.replace(
            sample_from_trajectory(v1),
            loss_mask=pack_mask([1, 0, 1]),  # the middle token is a tool result
            logprobs=pack_floats([UNIFORM_LOGPROB, 0.0, UNIFORM_LOGPROB]),
        )
        summary = msgspec.structs.replace(
            root, sample_id=f"{root.sample_id}/s", branch_of=root.sample_id, edit="summary"
        )
        frozen = msgspec.structs.replace(
            root, sample_id=f"{root.sample_id}/f", agent_id="sub", trainable=False, segments=[PolicySegment(0, 3)]
        )
        ep = msgspec.structs.replace(
            episode_from_trajectory(v1),
            samples=[root, summary, frozen],
            tool_log=[
                ToolEvent(sample_id=root.sample_id, name="calc"),
                ToolEvent(sample_id=root.sample_id, status="invalid_tool_call"),
            ],
            counts={"turns": 4, "tool_calls": 2, "invalid_tool_call": 1},
        )
        if i % 2:
            ep = offload(store, ep, limit=HEADROOM)  # forced: every body goes to the store
            assert ep.is_stub()
        out.append(ScoredEpisode(episode=ep, reward=float(i % 2), correct=bool(i % 2)))
    return out


async def test_learner_trains_multi_sample_episodes_some_by_reference(
    nats_server: Server, bus: Bus, tmp_path: Path
) -> None:
    overrides = learner_settings(tmp_path, max_steps=1, groups_per_step=2, group_timeout_s=5.0)
    overrides["bus"] = {"url": nats_server.url}
    svc = LearnerService(resolve(LearnerConfig, environ={}, overrides=overrides))
    await svc.setup()
    store = LocalObjectStore(tmp_path / "store")
    groups = [agentic_group(f"e{i}", store) for i in range(2)]
    stop = asyncio.Event()
    run = asyncio.create_task(svc.run(stop))
    try:
        for g in groups:
            for s in g:
                await bus.publish(SUBJECT, s, msg_id=s.episode.episode_id)
        await asyncio.wait_for(run, 60)
    finally:
        stop.set()
        if not run.done():
            await asyncio.wait_for(run, 30)
        await svc.close()
    (step,) = await read_steps(bus, 1, 10)
    # 8 episodes x 2 trainable samples; 2 sampled tokens each (the tool result is masked); nothing dropped.
    assert (step.n_trajectories, step.n_samples, step.n_tokens) == (8, 16, 32)
    assert step.dropped == {} and step.staleness == {"0": 8}
    assert (step.turns_per_episode, step.tool_calls_per_turn, step.invalid_call_rate) == (4.0, 0.5, 0.5)
    assert step.samples_per_episode == 3.0
    assert set(step.logprob_mismatch_by_turn) == {"0", "1", "2", "3"}
    trained = sorted(o.trajectory_id for o in read_outcomes(tmp_path / "outcomes.jsonl") if o.outcome == "trained")
    assert trained == sorted(s.episode.episode_id for g in groups for s in g)
