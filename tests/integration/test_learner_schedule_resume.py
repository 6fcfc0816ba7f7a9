"""The learner's reward schedule against a real nats-server with the tiny model (issue 15).

Swarm-like scored episodes (components perf / parallel / finish, counts critical_steps /
total_steps / subagents) go to a learner with `[learner.reward_schedule.parallel]` λ = 0.5 → 0
over 2 steps. Its `learner.step` messages carry λ per step and the per-step means; a group that
is uniform as scored trains while λ > 0; and a learner restarted from the checkpoint of step 2
continues the schedule (λ = 0 exactly), dropping a group that differs only in the annealed
component as uniform.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
from scored_trajectories import eventually, read_steps, trajectory

from slipstream.bus import Bus, BusConfig, connect_bus
from slipstream.learner.config import LearnerConfig
from slipstream.learner.outcomes import read_outcomes
from slipstream.learner.service import LearnerService
from slipstream.runtime.config import resolve
from slipstream.schemas import ScoredEpisode, ScoredTrajectory, scored_episode_from_v1
from slipstream.schemas.subjects import traj_scored_subject
from slipstream.stack import Server

pytestmark = pytest.mark.integration

SUBJECT = traj_scored_subject("swarm")


@pytest.fixture
async def bus(nats_server: Server) -> AsyncIterator[Bus]:
    b = await connect_bus(BusConfig(url=nats_server.url), name="schedule-test")
    await b.ensure_streams()
    yield b
    await b.close()


def swarm(tid: str, group: str, perf: float, parallel: float, subagents: int) -> ScoredEpisode:
    v1 = trajectory(tid, group, size=2, reward=perf + parallel).trajectory
    scored = scored_episode_from_v1(ScoredTrajectory(trajectory=v1, reward=perf + parallel, correct=perf > 0.5))
    counts = {"critical_steps": 2 + subagents, "total_steps": 2 + 3 * subagents}
    if subagents:
        counts["subagents"] = subagents
    episode = msgspec.structs.replace(scored.episode, env="swarm", counts=counts)
    components = {"perf": perf, "parallel": parallel, "finish": 0.0}
    return msgspec.structs.replace(scored, episode=episode, components=components)


def equal_as_scored(name: str) -> list[ScoredEpisode]:
    """A solved the task alone, B parallelised (2 sub-agents) and failed: both scored 1.0."""
    return [swarm(f"{name}-a", f"{name}/s", 1.0, 0.0, 0), swarm(f"{name}-b", f"{name}/s", 0.0, 1.0, 2)]


def settings(tmp_path: Path, url: str, max_steps: int) -> dict[str, dict[str, Any]]:
    return {
        "service": {"run_id": "sched", "replica": "learner-0"},
        "bus": {"url": url},
        "store": {"root": str(tmp_path / "store")},
        "model": {"preset": "tiny", "seed": 0, "threads": 1},
        "learner": {
            "staging_dir": str(tmp_path / "staging"),
            "outcomes_path": str(tmp_path / "outcomes.jsonl"),
            "max_staleness": 100,
            "announce_timeout_s": 0.3,
            "max_steps": max_steps,
            "groups_per_step": 1,
            "checkpoint_every": 1,
            "group_timeout_s": 20.0,
            "reward_schedule": {"parallel": {"init": 0.5, "anneal_steps": 2}},
        },
    }


async def run_learner(cfg: dict[str, dict[str, Any]], bus: Bus, work: list[list[ScoredEpisode]]) -> LearnerService:
    """Start a learner, publish `work` group by group (each after the previous is settled), run to max_steps."""
    svc = LearnerService(resolve(LearnerConfig, environ={}, overrides=cfg))
    await svc.setup()
    stop = asyncio.Event()
    run = asyncio.create_task(svc.run(stop))
    try:
        for group in work:
            before = svc.intake.received if svc.intake is not None else 0
            for s in group:
                await bus.publish(SUBJECT, s, msg_id=s.episode.episode_id)
            await eventually(
                lambda before=before, n=len(group): svc.intake is not None and svc.intake.received >= before + n,
                20,
                "the group's arrival",
            )
        await asyncio.wait_for(run, 60)  # max_steps reached: run returns by itself
    finally:
        stop.set()
        if not run.done():
            await asyncio.wait_for(run, 30)
        await svc.close()
    return svc


async def test_learner_steps_carry_lambda_and_a_resumed_learner_continues_the_schedule(
    nats_server: Server, bus: Bus, tmp_path: Path
) -> None:
    first = await run_learner(
        settings(tmp_path, nats_server.url, 2), bus, [equal_as_scored("g0"), equal_as_scored("g1")]
    )
    assert first.committed_step == 2
    # Resumed from step 2: λ = 0 exactly. A group equal but for the parallel bonus carries no signal
    # any more; one that differs in perf trains.
    differs_in_bonus = [swarm("g2-a", "g2/s", 1.0, 0.5, 2), swarm("g2-b", "g2/s", 1.0, 0.0, 0)]
    second = await run_learner(settings(tmp_path, nats_server.url, 3), bus, [differs_in_bonus, equal_as_scored("g3")])
    assert second.step == 3 and second.intake is not None and second.intake.dropped == {"uniform_group": 2}

    steps = await read_steps(bus, 3, 10)
    assert [s.step for s in steps] == [1, 2, 3]
    assert [s.reward_weights for s in steps] == [{"parallel": 0.5}, {"parallel": 0.25}, {"parallel": 0.0}]
    assert [s.reward_mean for s in steps] == [1.0, 1.0, 1.0]  # as scored: equal, yet every step trained
    assert all(s.n_trajectories == 2 and s.grad_norm > 0 for s in steps)
    assert steps[0].episode_means == {
        "critical_steps": 3.0,  # (2 + 4) / 2
        "total_steps": 5.0,  # (2 + 8) / 2
        "subagents": 1.0,  # 2 in B, none recorded in A
        "component.finish": 0.0,
        "component.parallel": 0.5,
        "component.perf": 0.5,
    }
    outcomes = read_outcomes(tmp_path / "outcomes.jsonl")
    assert sorted(o.trajectory_id for o in outcomes if o.outcome == "dropped") == ["g2-a", "g2-b"]
    assert len([o for o in outcomes if o.outcome == "trained"]) == 6
