"""The pending stage's contract, run against both stores: in memory and in a real Redis.

Idempotent feedback, feedback before the flush kept and attached, release on a signal (or on the
configured keys), deadline expiry masks (or publishes with `publish_unrated`), groups formed only
when full (or after `group_wait_s`), 409 after release, and claimed-but-unreleased members found
again after a releaser died.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import pytest

from slipstream.schemas import FeedbackSignal
from slipstream.serve import MemoryPending, PendingPolicy, PendingStore, RedisPending

pytestmark = [pytest.mark.contract, pytest.mark.timeout(60)]


@pytest.fixture(params=["memory", "redis"])
async def make(request: pytest.FixtureRequest) -> AsyncIterator[Any]:
    made: list[PendingStore] = []

    def build(**policy: Any) -> PendingStore:
        # Each store of a test is its own run: in Redis they would share keys otherwise.
        p = PendingPolicy(env="serve", run_id=f"run{len(made) + 1}", **policy)
        if request.param == "memory":
            store: PendingStore = MemoryPending(p)
        else:
            url = request.getfixturevalue("redis_server").url
            store = RedisPending.connect(p, url)
        made.append(store)
        return store

    yield build
    for s in made:
        await s.close()


def sig(key: str, value: float | bool | str = 1.0, fid: str = "", at: float = 1.0) -> FeedbackSignal:
    return FeedbackSignal(key=key, value=value, feedback_id=fid or f"id-{key}", at=at)


async def _open(p: PendingStore, eid: str, call: str = "", session: str = "s") -> None:
    await p.note_call(call or f"call-{eid}", session, eid)


async def test_feedback_is_idempotent_and_attached_at_flush(make: Any) -> None:
    p = make()
    assert await p.next_episode("s") == 0 and await p.next_episode("s") == 1 and await p.next_episode("t") == 0
    await _open(p, "e1", call="c1")
    assert await p.episode_of_call("c1") == "e1" and await p.last_call("s") == "c1"
    assert await p.episode_of_call("nope") is None and await p.state("nope") is None
    assert await p.add_feedback("nope", sig("accepted"), 1.0) == "unknown"
    assert await p.add_feedback("e1", sig("accepted", True, "f1"), 1.0) == "recorded"
    assert await p.add_feedback("e1", sig("accepted", True, "f1"), 2.0) == "duplicate"
    assert await p.state("e1") == "open"  # still being served: it waits for its flush
    assert await p.flushed("e1", "k/e1", deadline=100.0, now=5.0) == "ready"  # kept, attached, released
    assert await p.flushed("e1", "k/e1", deadline=100.0, now=6.0) == "ready"  # a second flush changes nothing
    assert [s.feedback_id for s in await p.feedback("e1")] == ["f1"]


async def test_a_pending_episode_is_released_by_its_first_signal_or_its_keys(make: Any) -> None:
    p = make(release_keys=("accepted", "edited"))
    await _open(p, "e1")
    assert await p.flushed("e1", "k/e1", deadline=100.0, now=1.0) == "pending"
    await p.add_feedback("e1", sig("accepted"), 2.0)
    assert await p.state("e1") == "pending"  # 'edited' still missing
    await p.add_feedback("e1", sig("edited"), 3.0)
    assert await p.state("e1") == "ready"
    q = make()
    await _open(q, "e2")
    await q.flushed("e2", "k/e2", deadline=100.0, now=1.0)
    await q.add_feedback("e2", sig("anything"), 2.0)
    assert await q.state("e2") == "ready"


async def test_only_the_keys_the_reward_spec_reads_count(make: Any) -> None:
    p = make(reward_keys=("accepted", "stars"))
    await _open(p, "e")
    await p.flushed("e", "k/e", deadline=10.0, now=0.0)
    await p.add_feedback("e", sig("followed_up"), 1.0)
    assert await p.state("e") == "pending"  # the spec would mask it: it waits
    await p.add_feedback("e", sig("stars", 4.0), 2.0)
    assert await p.state("e") == "ready"
    await _open(p, "f")
    await p.flushed("f", "k/f", deadline=10.0, now=0.0)
    await p.add_feedback("f", sig("followed_up"), 1.0)
    assert await p.expire(now=10.0) == ["f"]  # signals, but none the spec reads: masked


async def test_deadline_expiry_masks_an_unrated_episode(make: Any) -> None:
    p = make()
    for eid in ("quiet", "rated"):
        await _open(p, eid)
        await p.flushed(eid, f"k/{eid}", deadline=10.0, now=0.0)
    assert await p.expire(now=5.0) == []
    assert await p.state("quiet") == "pending"
    # A release key never arrived, but it has a signal: published at the deadline with what it has.
    strict = make(release_keys=("accepted",))
    await _open(strict, "partial")
    await strict.flushed("partial", "k/partial", deadline=10.0, now=0.0)
    await strict.add_feedback("partial", sig("followed_up"), 1.0)
    assert await p.expire(now=10.0) == ["quiet", "rated"]
    assert await strict.expire(now=10.0) == [] and await strict.state("partial") == "ready"
    assert await p.state("quiet") == "masked"
    assert await p.add_feedback("quiet", sig("late"), 11.0) == "too_late"
    assert (await p.counts())["masked"] == 2
    assert await p.form_group(now=12.0) == []  # masked episodes never form a group
    opt_in = make(publish_unrated=True)
    await _open(opt_in, "unrated")
    await opt_in.flushed("unrated", "k/u", deadline=10.0, now=0.0)
    assert await opt_in.expire(now=10.0) == [] and await opt_in.state("unrated") == "ready"


async def test_groups_form_only_when_full_or_after_the_wait(make: Any) -> None:
    p = make(group_size=3)
    for i in range(4):
        await _open(p, f"e{i}")
        await p.flushed(f"e{i}", f"k/e{i}", deadline=100.0, now=float(i))
    for i in range(2):
        await p.add_feedback(f"e{i}", sig("accepted"), 10.0 + i)
    assert await p.form_group(now=20.0) == []  # two ready of three: still filling, no ids yet
    await p.add_feedback("e2", sig("accepted"), 12.0)
    await p.add_feedback("e3", sig("accepted"), 13.0)
    group = await p.form_group(now=20.0)
    assert [m.episode_id for m in group] == ["e0", "e1", "e2"]  # oldest first
    assert {m.group_id for m in group} == {"serve-run1-1"} and [m.group_index for m in group] == [0, 1, 2]
    assert all(m.group_size == 3 for m in group) and group[0].body_key == "k/e0"
    assert await p.form_group(now=20.0) == []
    assert await p.add_feedback("e0", sig("late", fid="late"), 21.0) == "too_late"  # signals are fixed now
    assert await p.add_feedback("e0", sig("accepted"), 21.0) == "duplicate"  # a retry is still a 200
    waiting = make(group_size=3, group_wait_s=5.0)
    await _open(waiting, "w")
    await waiting.flushed("w", "k/w", deadline=100.0, now=0.0)
    await waiting.add_feedback("w", sig("accepted"), 1.0)
    assert await waiting.form_group(now=5.0) == []
    (alone,) = await waiting.form_group(now=6.5)
    assert alone.group_size == 1 and alone.group_id == "serve-run2-1"


async def test_a_claimed_member_is_found_again_until_released(make: Any) -> None:
    p = make(group_size=1)
    await _open(p, "e")
    await p.add_feedback("e", sig("accepted"), 0.5)
    await p.flushed("e", "k/e", deadline=100.0, now=1.0)
    (member,) = await p.form_group(now=2.0)
    assert await p.stale_releasing(now=3.0, older_than_s=30.0) == []  # its releaser is at work
    assert await p.stale_releasing(now=40.0, older_than_s=30.0) == [member]  # it died: pick it up
    await p.released("e")
    await p.released("e")  # twice is once
    assert await p.state("e") == "released" and await p.stale_releasing(now=40.0, older_than_s=30.0) == []
    counts = await p.counts()
    assert counts["released"] == 1 and counts["flushed"] == 1 and counts["feedback"] == 1


async def test_memory_forgets_calls_and_finished_episodes_after_the_retention() -> None:
    wall = [1000.0]
    p = MemoryPending(PendingPolicy(group_size=1, retention_s=60.0), clock=lambda: wall[0])
    assert await p.next_episode("s") == 0
    await p.note_call("c1", "s", "e1")
    await p.add_feedback("e1", sig("accepted"), 0.0)
    await p.flushed("e1", "k/e1", deadline=10.0, now=0.0)
    await p.form_group(now=1.0)
    await p.released("e1")
    wall[0] += 59.0
    await p.note_call("c2", "t", "e2")
    assert await p.episode_of_call("c1") == "e1" and await p.state("e1") == "released"
    wall[0] += 2.0
    await p.expire(now=2.0)
    assert await p.episode_of_call("c1") is None and await p.last_call("s") is None and await p.state("e1") is None
    assert await p.episode_of_call("c2") == "e2" and await p.state("e2") == "open"  # still served
    assert await p.next_episode("s") == 1  # episode numbers outlive the retention: ids never repeat
