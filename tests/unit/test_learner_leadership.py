"""The learner's control-plane logic without Redis: leadership decisions, ledger claims, eviction, fenced commits.

Redis is replaced by small fakes that answer the way `slipstream.control` does (including
`ControlUnavailable`), so every branch runs in microseconds; the real thing is exercised by
tests/integration/test_learner_lease.py and test_redis_outage.py.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable, Sequence
from pathlib import Path

import pytest
import torch
from torch import nn

from slipstream.control import ControlUnavailable, LeaseHeld, LeaseInfo, TaskStat
from slipstream.learner.checkpoint import CheckpointError, Checkpoints
from slipstream.learner.claims import CONFLICTS, Claims, Committed, task_key
from slipstream.learner.intake import Intake, Member
from slipstream.learner.leadership import Leadership, LeadershipLost
from slipstream.learner.ledger import TrainedLedger
from slipstream.rl import DropReason
from slipstream.schemas import (
    PolicySegment,
    ScoredEpisode,
    ScoredTrajectory,
    Trajectory,
    pack_floats,
    pack_ids,
    pack_mask,
    scored_episode_from_v1,
)
from slipstream.store import LocalObjectStore

pytestmark = pytest.mark.unit

DOWN = ControlUnavailable("redis://test", "op", ConnectionRefusedError("refused"))


class Keys:
    run_id = "run"


class FakeLease:
    """Answers like `LeaderLease`; `redis_up` False makes every call raise `ControlUnavailable`."""

    def __init__(self, holder_id: str) -> None:
        self.holder_id = holder_id
        self.keys = Keys()
        self.token: int | None = None
        self.lost_event = asyncio.Event()
        self.lost_reason: str | None = None
        self.redis_up = True
        self.current_value: LeaseInfo | None = None
        self.next_token = 1
        self.released = 0
        self.keepalives = 0

    @property
    def lost(self) -> bool:
        return self.lost_event.is_set()

    @property
    def held(self) -> bool:
        return self.token is not None and not self.lost

    def _up(self) -> None:
        if not self.redis_up:
            raise DOWN

    async def acquire(self, wait: bool = False, timeout_s: float | None = None, *, min_token: int = 0) -> int:
        self._up()
        cur = self.current_value
        if cur is not None and cur.holder != self.holder_id:
            raise LeaseHeld(self.keys.run_id, cur.holder, cur.token, cur.remaining_s, None)
        self.token = max(self.next_token, min_token + 1)
        self.next_token = self.token + 1
        self.current_value = LeaseInfo(self.holder_id, self.token, 10.0)
        self.lost_event = asyncio.Event()
        return self.token

    async def current(self) -> LeaseInfo | None:
        self._up()
        return self.current_value

    async def check(self, token: int, *, min_remaining_s: float = 0.0) -> bool:
        info = await self.current()
        return info is not None and (info.holder, info.token) == (self.holder_id, token) and info.remaining_s > 0

    async def release(self) -> bool:
        self._up()
        self.released += 1
        self.token = None
        return True

    async def stop_keepalive(self) -> None:
        return None

    def keepalive(self) -> None:
        self.keepalives += 1


class FakeLedger:
    def __init__(self, control: FakeControl) -> None:
        self.control = control
        self.steps: dict[str, int] = {}

    async def claim(self, ids: Sequence[str], step: int) -> list[bool]:
        self.control.up()
        out = []
        for tid in ids:
            out.append(tid not in self.steps)
            self.steps.setdefault(tid, step)
        return out

    async def step_of(self, tid: str) -> int | None:
        self.control.up()
        return self.steps.get(tid)


class FakeStats:
    def __init__(self, control: FakeControl) -> None:
        self.control = control
        self.stats: dict[str, TaskStat] = {}

    async def record_many(self, attempts: Iterable[tuple[str, float, bool]]) -> int:
        self.control.up()
        rows = list(attempts)
        for key, reward, correct in rows:
            s = self.stats.get(key, TaskStat())
            self.stats[key] = TaskStat(
                attempts=s.attempts + 1, solved=s.solved + int(correct), reward_sum=s.reward_sum + reward
            )
        return len(rows)


class FakeControl:
    def __init__(self) -> None:
        self.healthy = True
        self.leases: list[FakeLease] = []
        self.ledger = FakeLedger(self)
        self.task_stats = FakeStats(self)

    def up(self) -> None:
        if not self.healthy:
            raise DOWN

    def lease(self, holder_id: str | None = None, ttl_s: float = 10.0) -> FakeLease:
        self.leases.append(FakeLease(holder_id or "anon"))
        return self.leases[-1]


async def quiet() -> str | None:
    return None


async def leading(holder: str = "me") -> tuple[Leadership, FakeLease]:
    leadership = Leadership(FakeControl(), holder_id=holder, ttl_s=3.0, wait=False)  # type: ignore[arg-type]
    lease = leadership.lease
    assert isinstance(lease, FakeLease)
    assert await leadership.acquire(min_token=4) == 5  # above the checkpoint's token
    return leadership, lease


# --- leadership -------------------------------------------------------------------------------------


async def test_a_held_lease_is_confirmed_and_a_redis_outage_pauses_instead_of_failing() -> None:
    leadership, lease = await leading()
    assert lease.keepalives == 1 and await leadership.confirm(quiet) is True
    lease.redis_up = False
    assert await leadership.confirm(quiet) is False and leadership.paused
    assert leadership.status()["paused"] == "control plane unreachable"
    lease.redis_up = True
    assert await leadership.confirm(quiet) is True and not leadership.paused


async def test_a_lapsed_lease_nobody_took_is_reclaimed_with_the_next_token() -> None:
    leadership, lease = await leading()
    lease.lost_event.set()  # the keepalive gave up (Redis away longer than the ttl) ...
    lease.current_value = None  # ... and Redis came back empty
    assert await leadership.confirm(quiet) is True
    assert (leadership.token, leadership.reclaimed, lease.keepalives) == (6, 1, 2)
    assert leadership.valid()


async def test_a_lease_another_learner_holds_is_lost_for_good() -> None:
    leadership, lease = await leading()
    lease.current_value = LeaseInfo("other:1", 6, 2.0)  # the check fails: somebody else leads
    with pytest.raises(LeadershipLost, match=r"held by 'other:1' \(fencing token 6\)"):
        await leadership.confirm(quiet)


async def test_a_reclaim_with_a_token_gap_means_someone_held_it_meanwhile() -> None:
    leadership, lease = await leading()
    lease.lost_event.set()
    lease.current_value = None
    lease.next_token = 7  # token 6 went to another learner while ours had lapsed
    with pytest.raises(LeadershipLost, match="fencing token 5 -> 7"):
        await leadership.confirm(quiet)
    assert lease.released == 1  # handed back at once


async def test_a_reclaim_fails_when_the_run_moved_on_without_us() -> None:
    leadership, lease = await leading()
    lease.lost_event.set()
    lease.current_value = None

    async def moved() -> str | None:
        return "checkpoint step 9 was committed by another learner"

    with pytest.raises(LeadershipLost, match="step 9"):
        await leadership.confirm(moved)
    assert lease.released == 1


async def test_without_wait_a_held_lease_raises_naming_the_holder_and_with_wait_it_is_awaited() -> None:
    control = FakeControl()
    eager = Leadership(control, holder_id="c", ttl_s=0.5, wait=False)  # type: ignore[arg-type]
    busy = LeaseInfo("b:7", 3, 0.4)
    assert isinstance(eager.lease, FakeLease)
    eager.lease.current_value = busy
    with pytest.raises(LeaseHeld, match="'b:7'"):
        await eager.acquire(min_token=0)

    patient = Leadership(control, holder_id="d", ttl_s=0.5, wait=True)  # type: ignore[arg-type]
    lease = patient.lease
    assert isinstance(lease, FakeLease)
    lease.current_value = busy
    waiter = asyncio.create_task(patient.acquire(min_token=3))
    await asyncio.sleep(0.12)
    assert not waiter.done() and patient.status()["waiting_for"] == "b:7"
    lease.current_value = None  # the holder went away
    assert await asyncio.wait_for(waiter, 2) == 4 and "waiting_for" not in patient.status()


# --- claims ------------------------------------------------------------------------------------------


def scored(tid: str, task: str, reward: float, key: str = "") -> ScoredEpisode:
    traj = Trajectory(
        trajectory_id=tid,
        task_id=task,
        env="arith",
        group_id=f"{task}/s",
        group_size=2,
        prompt_len=2,
        token_ids=pack_ids([1, 2, 3]),
        logprobs=pack_floats([-1.0]),
        loss_mask=pack_mask([1]),
        segments=[PolicySegment(0, 1)],
        metadata={"key": key} if key else {},
    )
    return scored_episode_from_v1(ScoredTrajectory(trajectory=traj, reward=reward, correct=reward > 0.5))


def member(s: ScoredEpisode) -> Member[str]:
    return Member(s, [f"h-{s.episode.episode_id}"], 0, 1)


async def test_committed_trajectories_are_claimed_recorded_then_acked_and_held_while_redis_is_down() -> None:
    control = FakeControl()
    acked: list[str] = []

    async def ack(members: Sequence[Member[str]]) -> None:
        acked.extend(h for m in members for h in m.handles)

    claims: Claims[str] = Claims(control, ack)  # type: ignore[arg-type]
    batch = [member(scored("t1", "q", 1.0, key="3+4")), member(scored("t2", "q", 0.0, key="3+4"))]
    control.healthy = False
    await claims.committed(Committed(7, batch))
    assert acked == [] and claims.pending == 2 and claims.pending_ids() == ["t1", "t2"]
    control.healthy = True
    assert await claims.settle() is True
    assert acked == ["h-t1", "h-t2"] and claims.pending == 0
    assert control.ledger.steps == {"t1": 7, "t2": 7}
    assert control.task_stats.stats == {"arith/3+4": TaskStat(attempts=2, solved=1, reward_sum=1.0)}


async def test_an_id_counted_by_another_step_is_acked_but_not_recorded_again() -> None:
    control = FakeControl()
    control.ledger.steps = {"t1": 3, "t2": 9}  # t1: another learner's step 3; t2: our own lost answer
    acks: list[str] = []

    async def ack(members: Sequence[Member[str]]) -> None:
        acks.extend(m.episode_id for m in members)

    claims: Claims[str] = Claims(control, ack)  # type: ignore[arg-type]
    before = CONFLICTS.total()
    await claims.committed(Committed(9, [member(scored("t1", "a", 1.0)), member(scored("t2", "b", 1.0))]))
    assert acks == ["t1", "t2"] and CONFLICTS.total() - before == 1
    assert list(control.task_stats.stats) == ["arith/b"]  # no problem key: keyed by the task id


async def test_uniform_groups_are_counted_once_and_skipped_while_redis_is_known_down() -> None:
    control = FakeControl()

    async def ack(members: Sequence[Member[str]]) -> None:
        raise AssertionError("uniform groups are acked by the caller")

    claims: Claims[str] = Claims(control, ack)  # type: ignore[arg-type]
    group = [scored("u1", "easy", 1.0), scored("u2", "easy", 1.0)]
    await claims.uniform_group(group, 4)
    await claims.uniform_group(group, 5)  # a redelivery: claimed already, not recorded again
    assert control.task_stats.stats["arith/easy"] == TaskStat(attempts=2, solved=2, reward_sum=2.0)
    control.healthy = False
    await claims.uniform_group([scored("u3", "easy", 1.0)], 6)  # no timeout paid, nothing recorded
    assert control.task_stats.stats["arith/easy"].attempts == 2


def test_task_key_prefers_the_problem_key() -> None:
    assert task_key("arith", {"key": "3+4"}, "run:arith-train-0-1") == "arith/3+4"
    assert task_key("reverse", {}, "run:reverse-train-0-2") == "reverse/run:reverse-train-0-2"


# --- intake eviction ---------------------------------------------------------------------------------


def test_evicted_members_leave_their_groups_which_still_complete_and_are_rescreened() -> None:
    intake: Intake[str] = Intake(max_staleness=2, group_timeout_s=10.0, vocab_size=10, ledger=TrainedLedger(1))
    for tid, task, reward in [("a1", "a", 0.0), ("a2", "a", 1.0), ("b1", "b", 0.0)]:
        assert intake.offer(scored(tid, task, reward), f"h-{tid}", 0, 0.0) == []
    assert intake.ready_ids() == ["a1", "a2"] and intake.pending_groups == 1
    drops = intake.evict({"a2", "b1"}, DropReason.DUPLICATE, "counted")
    assert sorted((d.episode_id, d.reason, d.handles) for d in drops) == [
        ("a2", "duplicate", ("h-a2",)),
        ("b1", "duplicate", ("h-b1",)),
    ]
    assert intake.dropped == {"duplicate": 2} and intake.in_flight == 1
    # Group b still completes with its next arrival; group a, left with one member, is uniform.
    intake.offer(scored("b2", "b", 1.0), "h-b2", 0, 0.0)
    groups, more = intake.take(2, 0)
    assert groups == [] and [(d.episode_id, d.reason) for d in more] == [("a1", "uniform_group")]


# --- fenced checkpoints ------------------------------------------------------------------------------


def test_a_checkpoint_is_not_committed_over_one_written_under_a_newer_token(tmp_path: Path) -> None:
    model = nn.Linear(2, 2)
    optimizer = torch.optim.AdamW(model.parameters())
    ckpts = Checkpoints(LocalObjectStore(tmp_path), "run", keep=2)
    assert ckpts.fence_token() == 0

    def save(step: int, token: int) -> None:
        ckpts.save(
            step=step,
            policy_version=step,
            model=model,
            optimizer=optimizer,
            dropped={},
            trained_ids=[],
            fence_token=token,
        )

    save(1, 4)
    assert ckpts.fence_token() == 4
    with pytest.raises(CheckpointError, match="fencing token 4, above this learner's 3"):
        save(2, 3)  # a fenced learner
    assert ckpts.latest_step() == 1
    save(2, 5)
    save(3, 0)  # without a control plane the token is not checked
    assert (ckpts.latest_step(), ckpts.fence_token()) == (3, 0)
