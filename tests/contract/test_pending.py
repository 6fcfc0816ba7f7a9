"""The pending stage's contract, run against both stores: in memory and in a real Redis.

Idempotent feedback, feedback before the flush kept and attached, release on a signal (or on the
configured keys), deadline expiry masks (or publishes with `publish_unrated`), groups formed only
when full (or after `group_wait_s`), 409 after release, and claimed-but-unreleased members found
again after a releaser died. Groups per prompt: episodes with a group key are released with their
key's other members (interleaved prompts come out as one group each), a partial group smaller at
`group_timeout_s`, keyless episodes in arrival order as before, and (Redis) a restarted process
forms the groups its predecessor left filling.
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


async def _ready(p: PendingStore, eid: str, now: float, group: str = "", size: int = 0, signal: bool = True) -> None:
    """Serve, flush (with a group key when given) and, with `signal`, rate one episode at `now`."""
    await _open(p, eid)
    await p.flushed(eid, f"k/{eid}", deadline=now + 100.0, now=now, group_key=group, group_size=size)
    if signal:
        await p.add_feedback(eid, sig("accepted", fid=f"f-{eid}"), now)


async def _drain(p: PendingStore, now: float) -> list[list[str]]:
    groups = []
    while group := await p.form_group(now=now):
        assert [m.group_index for m in group] == list(range(len(group)))
        assert {m.group_size for m in group} == {len(group)} and len({m.group_id for m in group}) == 1
        groups.append([m.episode_id for m in group])
    return groups


async def test_interleaved_prompts_are_released_as_one_group_per_prompt(make: Any) -> None:
    p = make(group_size=2)
    # Two prompts' rollouts (2 each, as two n=2 calls make them) and two keyless episodes,
    # finishing interleaved: in arrival order they would pair a1+b1, u1+a2, ...
    order = [("a1", "grp-a"), ("b1", "grp-b"), ("u1", ""), ("a2", "grp-a"), ("u2", ""), ("b2", "grp-b")]
    seen: list[list[str]] = []
    for t, (eid, group) in enumerate(order):
        await _ready(p, eid, float(t), group, 2 if group else 0)
        seen += await _drain(p, now=float(t))
    assert seen == [["a1", "a2"], ["u1", "u2"], ["b1", "b2"]]
    # A key asking for more members than `group_size` waits for all of them.
    q = make(group_size=2)
    for t, eid in enumerate(["c1", "d1", "c2", "c3", "d2"]):
        await _ready(q, eid, float(t), f"grp-{eid[0]}", 3 if eid[0] == "c" else 0)
    assert await _drain(q, now=10.0) == [["c1", "c2", "c3"], ["d1", "d2"]]
    counts = await q.counts()
    assert counts["groups_by_key"] == 2 and counts.get("groups_partial", 0) == 0


async def test_a_partial_group_is_released_smaller_at_its_timeout(make: Any) -> None:
    p = make(group_size=8, group_timeout_s=30.0)
    await _ready(p, "a1", 0.0, "grp-a", 3)
    await _ready(p, "a2", 5.0, "grp-a", 3)
    await _ready(p, "a3", 6.0, "grp-a", 3, signal=False)  # served, still waiting for its feedback
    assert await _drain(p, now=29.9) == []  # two of three: the group is still filling
    assert await _drain(p, now=30.0) == [["a1", "a2"]]  # 30 s after its first member was ready
    assert (await p.counts())["groups_partial"] == 1
    # The key starts over: the straggler, rated later, waits for a group of its own (the same rule).
    await p.add_feedback("a3", sig("accepted", fid="late"), 40.0)
    assert await _drain(p, now=69.0) == [] and await p.state("a3") == "ready"
    assert await _drain(p, now=70.0) == [["a3"]]
    # A member masked at its deadline (no feedback) never publishes, so its group need not wait.
    q = make(group_timeout_s=1000.0)
    await _ready(q, "b1", 0.0, "grp-b", 2)
    await _open(q, "b2")
    await q.flushed("b2", "k/b2", deadline=50.0, now=1.0, group_key="grp-b", group_size=2)
    assert await _drain(q, now=49.0) == []
    assert await q.expire(now=50.0) == ["b2"]
    assert await _drain(q, now=50.0) == [["b1"]]
    assert (await q.counts())["groups_partial"] == 1
    # A reused key forms a full group again (its masked count started over).
    await _ready(q, "b3", 60.0, "grp-b", 2)
    assert await _drain(q, now=61.0) == []
    await _ready(q, "b4", 62.0, "grp-b", 2)
    assert await _drain(q, now=62.0) == [["b3", "b4"]]


async def test_keyless_episodes_are_still_grouped_in_arrival_order(make: Any) -> None:
    p = make(group_size=2, group_timeout_s=1.0)
    await _ready(p, "k1", 0.0, "grp-k", 4)  # a keyed member waiting does not join keyless groups
    for t, eid in enumerate(["u1", "u2", "u3"], start=1):
        await _ready(p, eid, float(t))
    assert await _drain(p, now=0.5) == [["u1", "u2"]]
    assert await p.state("u3") == "ready" and await p.state("k1") == "ready"
    assert await _drain(p, now=5.0) == [["k1"]]  # the keyed one at its timeout; u3 waits for a partner


async def test_a_restarted_process_forms_the_groups_redis_kept(redis_server: Any) -> None:
    """The serving process dies with a prompt group half done: a new process (a fresh
    connection, the same run) finishes it from what Redis holds, losing no member."""
    policy = PendingPolicy(env="serve", run_id="restart", group_size=8, group_timeout_s=30.0)
    before = RedisPending.connect(policy, redis_server.url)
    await _ready(before, "r1", 0.0, "grp-r", 3)
    await _ready(before, "r2", 1.0, "grp-r", 3)
    await _ready(before, "s1", 2.0, "grp-s", 2)
    await _open(before, "r3")  # served before the crash, flushed by nobody yet
    await before.close()
    after = RedisPending.connect(policy, redis_server.url)
    try:
        assert await _drain(after, now=3.0) == []
        await after.flushed("r3", "k/r3", deadline=100.0, now=4.0, group_key="grp-r", group_size=3)
        await after.add_feedback("r3", sig("accepted", fid="f-r3"), 4.0)
        assert await _drain(after, now=4.0) == [["r1", "r2", "r3"]]
        assert await _drain(after, now=32.0) == [["s1"]]  # its timeout counts from before the restart
    finally:
        await after.close()
