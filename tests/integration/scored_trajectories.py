"""Synthetic scored trajectories and bus helpers shared by the learner's integration tests.

The trajectories look like the tiny model's arith rollouts (a 4-token prompt, a made-up
two-digit answer and eos) with near-uniform behaviour log-probs, so a learner can train on them
without any rollout service running.
"""

from __future__ import annotations

import asyncio
import math
import time
import zlib
from collections.abc import Callable

import pytest

from slipstream.bus import Bus
from slipstream.schemas import (
    LearnerStep,
    PolicySegment,
    ScoredTrajectory,
    Trajectory,
    pack_floats,
    pack_ids,
    pack_mask,
)
from slipstream.schemas.subjects import LEARNER_STEP, traj_scored_subject

SUBJECT = traj_scored_subject("arith")
UNIFORM_LOGPROB = -math.log(259.0)  # the untrained tiny model is close to uniform over its 259 ids


def trajectory(
    tid: str,
    group: str,
    *,
    size: int,
    reward: float,
    version: int = 0,
    completion: list[int] | None = None,
    mask: list[int] | None = None,
    segments: list[PolicySegment] | None = None,
    split: str = "train",
) -> ScoredTrajectory:
    digits = zlib.crc32(tid.encode()) % 100  # a stable, made-up two-digit answer
    completion = completion or [48 + digits // 10, 48 + digits % 10, 2]
    n = len(completion)
    traj = Trajectory(
        trajectory_id=tid,
        task_id=group.split("/")[0],
        env="arith",
        group_id=group,
        group_size=size,
        prompt_len=4,
        token_ids=pack_ids([1, 49, 43, 50, *completion]),
        logprobs=pack_floats([UNIFORM_LOGPROB] * n),
        loss_mask=pack_mask(mask if mask is not None else [1] * n),
        segments=segments if segments is not None else [PolicySegment(version, n)],
        split=split,
    )
    return ScoredTrajectory(trajectory=traj, reward=reward, correct=reward > 0.5)


def group(name: str, size: int = 4) -> list[ScoredTrajectory]:
    """A group of task `name` with rewards 0, 1, 0, 1, ... (never uniform)."""
    return [trajectory(f"{name}-{i}", f"{name}/s1", size=size, reward=float(i % 2)) for i in range(size)]


async def publish(bus: Bus, items: list[ScoredTrajectory], *, msg_id_suffix: str = "") -> None:
    for s in items:
        await bus.publish(SUBJECT, s, msg_id=s.trajectory.trajectory_id + msg_id_suffix)


async def read_steps(bus: Bus, n: int, timeout_s: float) -> list[LearnerStep]:
    """Up to `n` learner.step messages (all of the stream), waiting at most `timeout_s`."""
    out: list[LearnerStep] = []
    reader = bus.subscribe(LEARNER_STEP, LearnerStep, deliver="all")

    async def collect() -> None:
        async for d in reader:
            out.append(d.msg)
            if len(out) >= n:
                return

    try:
        await asyncio.wait_for(collect(), timeout_s)
    except TimeoutError:
        pass
    finally:
        await reader.close()
    return out


async def eventually(predicate: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout_s}s waiting for {what}")
        await asyncio.sleep(0.05)
