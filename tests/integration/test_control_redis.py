"""The Redis control plane against a real redis-server: lease, ledger, task stats, eval history, outages."""

from __future__ import annotations

import asyncio
import re
import signal
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from slipstream.control import (
    Control,
    ControlError,
    ControlUnavailable,
    Keyspace,
    LeaseHeld,
    connect_control,
    redact_url,
)
from slipstream.schemas import EvalResult
from slipstream.stack import Server, start_redis
from slipstream.telemetry.metrics import REGISTRY

pytestmark = pytest.mark.integration

RUN = "run-ctl"


async def _connect(url: str) -> Control:
    """A client with the tests' 1 s call bound. Its first ping may be retried: under xdist on a
    loaded 2-core machine (load ~12) one setup ping took over 1 s, which is not what any test checks."""
    for attempt in range(3):
        try:
            return await connect_control(url, RUN, timeout_s=1.0)
        except ControlUnavailable:
            if attempt == 2:
                raise
    raise AssertionError("unreachable")


@pytest.fixture
async def control(redis_server: Server) -> AsyncIterator[Control]:
    c = await _connect(redis_server.url)
    yield c
    await c.close()


@pytest.fixture
async def other(redis_server: Server) -> AsyncIterator[Control]:
    """A second, independent client of the same run (another process, as far as Redis can tell)."""
    c = await _connect(redis_server.url)
    yield c
    await c.close()


# --- leader lease --------------------------------------------------------------------------------


async def test_second_holder_is_refused_with_the_holder_named_then_takes_over_after_release(
    control: Control, other: Control
) -> None:
    first = control.lease("learner-a", ttl_s=10.0)
    second = other.lease("learner-b", ttl_s=10.0)
    t1 = await first.acquire()
    assert t1 == 1 and first.held

    with pytest.raises(LeaseHeld) as refused:
        await second.acquire(wait=False)
    assert refused.value.holder == "learner-a" and refused.value.token == t1
    assert 9.0 < refused.value.remaining_s <= 10.0
    assert "'learner-a'" in str(refused.value) and "run 'run-ctl'" in str(refused.value)

    t0 = time.monotonic()
    with pytest.raises(LeaseHeld, match=r"after waiting 0\.3 s"):
        await second.acquire(wait=True, timeout_s=0.3)
    assert 0.25 <= time.monotonic() - t0 < 1.5

    assert await first.release() is True
    t2 = await second.acquire(wait=False)
    assert t2 == t1 + 1
    assert await first.check(t1) is False
    assert await second.check(t2) is True
    assert await first.fenced_publish_allowed(t1) is False
    info = await control.lease("observer").current()
    assert info is not None and (info.holder, info.token) == ("learner-b", t2)


async def test_waiting_holder_gets_the_lease_when_the_ttl_lapses_and_the_old_token_is_fenced(
    control: Control, other: Control
) -> None:
    fenced_before = REGISTRY.counter("control/lease/fenced").value(reason="lease_lost")
    stale = control.lease("learner-a", ttl_s=0.5)
    # Timed from before a's acquire: the TTL runs from there, however long the calls between take
    # on a loaded machine (timed from after them, b once waited only 0.24 s of the 0.5 s).
    t0 = time.monotonic()
    t1 = await stale.acquire()
    assert await stale.fenced_publish_allowed(t1) is True

    t2 = await other.lease("learner-b", ttl_s=5.0).acquire(wait=True, timeout_s=5.0)
    waited = time.monotonic() - t0
    assert 0.45 <= waited < 2.5  # a's 0.5 s TTL, not b's 5 s timeout
    assert t2 > t1
    # No keepalive ran: a's own clock says the lease lapsed, and Redis has b's token anyway.
    assert stale.lost and not stale.held
    assert await stale.check(t1) is False
    assert await stale.fenced_publish_allowed(t1) is False
    assert REGISTRY.counter("control/lease/fenced").value(reason="lease_lost") == fenced_before + 1
    assert await stale.renew() is False


async def test_fencing_token_grows_on_every_acquisition(control: Control) -> None:
    lease = control.lease("learner-a", ttl_s=5.0)
    tokens = []
    for _ in range(3):
        tokens.append(await lease.acquire())
        await lease.release()
    # The same holder id re-acquiring while it holds (a restarted pod) also gets a new token.
    tokens.append(await lease.acquire())
    tokens.append(await control.lease("learner-a", ttl_s=5.0).acquire())
    assert tokens == [1, 2, 3, 4, 5]
    assert await lease.check(4) is False and await lease.check(5) is True


async def test_keepalive_holds_the_lease_past_its_ttl_and_flips_lost_when_the_key_vanishes(
    control: Control, other: Control
) -> None:
    lease = control.lease("learner-a", ttl_s=0.6)
    token = await lease.acquire()
    lease.keepalive(0.15)
    await asyncio.sleep(1.2)  # two TTLs
    assert lease.held and not lease.lost
    assert await lease.check(token, min_remaining_s=0.2) is True
    with pytest.raises(LeaseHeld):
        await other.lease("learner-b").acquire()

    await control.client.redis.delete(control.keys.lease)
    await asyncio.wait_for(lease.lost_event.wait(), 1.0)
    assert lease.lost and lease.lost_reason is not None and lease.lost_reason.startswith("renewal refused")
    assert await lease.fenced_publish_allowed(token) is False
    assert await other.lease("learner-b").acquire() == token + 1
    await lease.release()  # no longer ours: nothing deleted
    assert (await other.lease("x").current()) is not None


async def test_keepalive_needs_a_held_lease_and_a_sane_interval(control: Control) -> None:
    lease = control.lease("learner-a", ttl_s=1.0)
    with pytest.raises(ControlError, match="call acquire"):
        lease.keepalive()
    await lease.acquire()
    with pytest.raises(ValueError, match="keepalive interval"):
        lease.keepalive(1.0)
    await lease.release()


# --- idempotency ledger --------------------------------------------------------------------------


async def test_ledger_counts_each_trajectory_once_across_clients(control: Control, other: Control) -> None:
    assert await control.ledger.claim(["t1", "t2", "t1"], step=3) == [True, True, False]
    assert await other.ledger.claim(["t2", "t3"], step=4) == [False, True]
    assert await other.ledger.counted(["t1", "t2", "t3", "t4"]) == [True, True, True, False]
    assert await control.ledger.is_counted("t4") is False
    assert await control.ledger.step_of("t2") == 3 and await control.ledger.step_of("t3") == 4
    assert await control.ledger.step_of("t4") is None
    # Restoring from a checkpoint: only missing ids are written, present ones keep their step.
    assert await other.ledger.mark(["t1", "t4", "t5"], step=9) == 2
    assert await control.ledger.step_of("t1") == 3 and await control.ledger.step_of("t5") == 9
    ttl_ms = await control.client.redis.pttl(control.keys.ledger("t1"))
    assert 0 < ttl_ms <= 7 * 24 * 3600 * 1000


async def test_ledger_claims_big_batches_in_chunks_and_expires_after_its_ttl(redis_server: Server) -> None:
    # Chunks under a TTL no busy machine outlasts between two claims; the expiry on its own, short.
    async with await connect_control(redis_server.url, RUN, ledger_ttl_s=60) as c:
        ids = [f"traj-{i}" for i in range(4500)]  # three Lua calls
        assert sum(await c.ledger.claim(ids, step=1)) == 4500
        assert sum(await c.ledger.claim(ids, step=2)) == 0
    async with await connect_control(redis_server.url, RUN + "-ttl", ledger_ttl_s=0.3) as c:
        assert await c.ledger.claim(["traj-7"], step=1) == [True]
        await asyncio.sleep(0.45)
        assert await c.ledger.claim(["traj-7"], step=2) == [True]


async def test_ledger_rejects_bad_ids(control: Control) -> None:
    with pytest.raises(ValueError, match="non-empty strings"):
        await control.ledger.claim(["ok", ""], step=1)
    with pytest.raises(TypeError, match="not one string"):
        await control.ledger.claim("t1", step=1)


# --- task statistics -----------------------------------------------------------------------------


async def test_task_stats_accumulate_and_drive_the_skip_reasons(control: Control, other: Control) -> None:
    skips = REGISTRY.counter("control/tasks/skips")
    before = {r: skips.value(reason=r) for r in ("always_solved", "never_solved")}
    for reward in (1.0, 1.0, 1.0, 1.0):
        await control.task_stats.record("arith/easy", reward, True)
    assert await other.task_stats.record_many([("arith/hard", 0.0, False)] * 4 + [("arith/mid", 0.25, False)] * 2) == 6
    await other.task_stats.record_many([("arith/mid", 0.75, True)] * 2)

    easy, hard, mid, new = await other.task_stats.get_many(["arith/easy", "arith/hard", "arith/mid", "arith/new"])
    assert (easy.attempts, easy.solved, easy.mean_reward, easy.solve_rate) == (4, 4, 1.0, 1.0)
    assert (hard.attempts, hard.solved, hard.mean_reward) == (4, 0, 0.0)
    assert (mid.attempts, mid.solved, mid.mean_reward, mid.solve_rate) == (4, 2, 0.5, 0.5)
    assert (new.attempts, new.solved, new.mean_reward) == (0, 0, 0.0)

    rule = {"min_attempts": 4, "solved_above": 0.9, "solved_below": 0.1}
    assert await control.task_stats.should_skip("arith/easy", **rule) == "always_solved"
    assert await control.task_stats.should_skip("arith/hard", **rule) == "never_solved"
    assert await control.task_stats.should_skip("arith/mid", **rule) is None
    assert await control.task_stats.should_skip("arith/new", **rule) is None  # too young to judge
    assert await control.task_stats.should_skip("arith/easy", **{**rule, "min_attempts": 5}) is None
    assert skips.value(reason="always_solved") == before["always_solved"] + 1
    assert skips.value(reason="never_solved") == before["never_solved"] + 1

    with pytest.raises(ValueError, match="solved_below < solved_above"):
        await control.task_stats.should_skip("arith/easy", min_attempts=1, solved_above=0.2, solved_below=0.5)
    with pytest.raises(ValueError, match="finite"):
        await control.task_stats.record("arith/easy", float("nan"), True)


# --- eval history and the promoted pointer -------------------------------------------------------


def result(version: int, score: float, decision: str = "promote") -> EvalResult:
    return EvalResult(policy_version=version, suite="arith-200", score=score, decision=decision, run_id=RUN)


async def test_eval_history_and_promotion_stack_survive_a_new_client(redis_server: Server) -> None:
    async with await connect_control(redis_server.url, RUN) as gate:
        assert await gate.evals.promoted() is None
        for v, s in ((1, 0.4), (3, 0.5), (5, 0.6), (6, 0.2)):
            await gate.evals.record(result(v, s, "reject" if v == 6 else "promote"))
        await gate.evals.record(result(5, 0.61))  # re-evaluated: the latest result wins for get()
        assert await gate.evals.promote(1, "first version") is None
        assert await gate.evals.promote(3, "better than v1") == 1
        assert await gate.evals.promote(3, "redelivered decision") == 3  # no-op
        assert await gate.evals.promote(5, "better than v3") == 3

    async with await connect_control(redis_server.url, RUN) as restarted:
        evals = restarted.evals
        assert await evals.promoted() == 5
        assert await evals.promotion_stack() == [1, 3, 5]
        got = await evals.get(5)
        assert got is not None and got.score == 0.61 and got.suite == "arith-200"
        assert await evals.get(2) is None
        assert [(r.policy_version, r.score) for r in await evals.history(limit=3)] == [(5, 0.6), (6, 0.2), (5, 0.61)]
        assert len(await evals.history()) == 5

        assert await evals.rollback("v5 regressed in production") == 3
        assert await evals.promoted() == 3
        assert await evals.rollback() == 1
        assert await evals.rollback() is None and await evals.promoted() is None
        assert await evals.rollback() is None  # nothing left: no change, no log entry
        log = await evals.promotions()
        assert [(p.action, p.version, p.previous) for p in log] == [
            ("promote", 1, None),
            ("promote", 3, 1),
            ("promote", 5, 3),
            ("rollback", 3, 5),
            ("rollback", 1, 3),
            ("rollback", None, 1),
        ]
        assert log[3].reason == "v5 regressed in production" and log[0].at > 1.7e9

    async with await connect_control(redis_server.url, "another-run") as neighbour:
        assert await neighbour.evals.promoted() is None and await neighbour.evals.history() == []


# --- Redis outages -------------------------------------------------------------------------------


async def test_redis_killed_raises_unavailable_within_the_timeout_and_recovers_by_itself(
    redis_server: Server, tmp_path: Path
) -> None:
    async with await connect_control(redis_server.url, RUN, timeout_s=0.5) as c:
        assert await c.ledger.claim(["before"], step=1) == [True]
        assert c.healthy and c.readiness() == {"redis": "ok", "url": redis_server.url}

        redis_server.process.stop(sig=signal.SIGKILL)
        ops = (lambda: c.ledger.claim(["during"], step=2), c.evals.promoted, lambda: c.task_stats.get("t"))
        for op in ops:
            t0 = time.monotonic()
            with pytest.raises(ControlUnavailable, match=re.escape(f"Redis at {redis_server.url} unavailable")):
                await op()
            assert time.monotonic() - t0 < 1.0
        assert c.healthy is False
        assert c.readiness()["redis"] == "degraded" and "error" in c.readiness()
        assert await c.ping() is False

        again = start_redis(tmp_path / "redis-again", tmp_path / "logs-again", port=redis_server.port)
        try:
            # No reconnect call: the next operation finds the new server.
            assert await c.ledger.claim(["during"], step=2) == [True]
            assert c.healthy is True and c.readiness() == {"redis": "ok", "url": redis_server.url}
            # This Redis runs without persistence: what was there before the crash is gone.
            assert await c.ledger.is_counted("before") is False
        finally:
            again.stop()


async def test_hung_redis_times_out_instead_of_hanging(redis_server: Server) -> None:
    async with await connect_control(redis_server.url, RUN, timeout_s=0.3) as c:
        await c.evals.promote(2)
        redis_server.process.send(signal.SIGSTOP)
        try:
            t0 = time.monotonic()
            with pytest.raises(ControlUnavailable, match=r"during evals\.promoted"):
                await c.evals.promoted()
            assert 0.25 <= time.monotonic() - t0 < 0.8
            assert not c.healthy
        finally:
            redis_server.process.send(signal.SIGCONT)
        assert await c.evals.promoted() == 2 and c.healthy


async def test_lease_keepalive_rides_out_a_short_outage_but_not_a_long_one(
    redis_server: Server, tmp_path: Path
) -> None:
    async with await connect_control(redis_server.url, RUN, timeout_s=0.2) as c:
        lease = c.lease("learner-a", ttl_s=1.0)
        token = await lease.acquire()
        lease.keepalive(0.2)
        redis_server.process.send(signal.SIGSTOP)  # shorter than the TTL: renewals retry
        await asyncio.sleep(0.5)
        redis_server.process.send(signal.SIGCONT)
        await asyncio.sleep(0.4)
        assert lease.held and await lease.check(token)

        redis_server.process.stop(sig=signal.SIGKILL)  # longer than the TTL: the lease is lost
        await asyncio.wait_for(lease.lost_event.wait(), 2.0)
        assert lease.lost_reason is not None and "unreachable for longer than the lease ttl" in lease.lost_reason
        assert await lease.fenced_publish_allowed(token) is False

        again = start_redis(tmp_path / "redis-again", tmp_path / "logs-again", port=redis_server.port)
        try:
            # The state went with the old server, counter included; the token still grows because
            # the holder remembers its last one (a learner passes the one in its checkpoint).
            assert await c.lease("learner-b").acquire() == 1
            await c.client.redis.flushall()
            assert await lease.acquire() == token + 1 and lease.held
            assert await c.lease("learner-c", ttl_s=1.0).acquire(wait=True, timeout_s=3, min_token=41) == 42
        finally:
            await lease.release()
            again.stop()


async def test_connect_names_the_url_when_nothing_listens() -> None:
    from slipstream.stack import free_port

    url = f"redis://127.0.0.1:{free_port()}/0"
    t0 = time.monotonic()
    with pytest.raises(ControlUnavailable, match=re.escape(f"Redis at {url} unavailable during ping")):
        await connect_control(url, RUN, timeout_s=0.5)
    assert time.monotonic() - t0 < 1.5


def test_keys_are_namespaced_by_run_with_a_cluster_hash_tag_and_urls_lose_their_password() -> None:
    keys = Keyspace("run-7")
    assert keys.lease == "slipstream:{run-7}:lease"
    assert keys.ledger("traj:42") == "slipstream:{run-7}:ledger:traj:42"
    assert keys.task("arith/17") == "slipstream:{run-7}:task:arith/17"
    for bad in ("", "has space", "a{b}", "-lead"):
        with pytest.raises(ValueError, match="not usable as a key namespace"):
            Keyspace(bad)
    assert redact_url("redis://:s3cret@db:6380/2") == "redis://:***@db:6380/2"
    assert redact_url("redis://user:pw@db/0") == "redis://user:***@db/0"
    assert redact_url("redis://127.0.0.1:6379/0") == "redis://127.0.0.1:6379/0"


async def test_announces_under_a_token_the_lease_never_granted_are_refused(control: Control, tmp_path: Path) -> None:
    """The verifier compares an announce's (signed) fencing token with the lease's granted counter."""
    from slipstream.schemas import WeightAnnounce, WeightManifest, to_json
    from slipstream.store import LocalObjectStore
    from slipstream.trust import AnnounceVerifier, Keyring

    store = LocalObjectStore(tmp_path / "store")
    verifier = AnnounceVerifier(store, run_id=RUN, keyring=Keyring({}), control=control)

    def put(version: int, token: int) -> WeightAnnounce:
        store.put(f"m{version}", to_json(WeightManifest(policy_version=version, run_id=RUN, fence_token=token)))
        return WeightAnnounce(policy_version=version, manifest_key=f"m{version}", run_id=RUN, fence_token=token)

    assert await control.granted_fence() is None
    # No counter in Redis (a fresh run, or Redis restarted empty): nothing to compare, not refused.
    assert (await verifier.verify(put(1, 3))).ok
    token = await control.lease("learner-a").acquire()
    assert await control.granted_fence() == token
    assert (await verifier.verify(put(2, token))).ok
    refused = await verifier.verify(put(3, token + 1))
    assert refused.reason == "fence" and "never granted" in refused.detail
    assert verifier.refused == {"fence": 1}
