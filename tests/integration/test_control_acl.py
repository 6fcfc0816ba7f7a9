"""Redis ACL users per service on a real redis-server: each does its control-plane work and nothing else.

The server runs with `slipstream.control.acl.acl_file` (the admin is the password-protected
`default` user). Each service's user goes through the real `Control` API for what it does in a
run, and is refused (`NOPERM`, from the server) for what another service does, for another run's
keys, and for admin commands. A connection without a password cannot run anything.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
import redis.asyncio as aioredis
from redis.exceptions import AuthenticationError, NoPermissionError, ResponseError

from slipstream.control import Control, connect_control
from slipstream.control.acl import ADMIN, acl_file, with_user
from slipstream.schemas import EvalResult
from slipstream.stack import Server, start_redis

pytestmark = pytest.mark.integration

RUN = "acl-run"
PASSWORDS = {
    ADMIN: "admin-pw",
    "learner": "l-pw",
    "weight-publisher": "wp-pw",
    "eval-gate": "eg-pw",
    "task-source": "ts-pw",
    "rollout-worker": "rw-pw",
    "reward-model": "rm-pw",
}


@pytest.fixture
def acl_redis(tmp_path: Path) -> Iterator[Server]:
    services = {k: v for k, v in PASSWORDS.items() if k != ADMIN}
    srv = start_redis(tmp_path / "redis", tmp_path / "logs", acl=acl_file(PASSWORDS[ADMIN], services, RUN))
    try:
        yield srv
    finally:
        srv.stop()


def url(server: Server, user: str) -> str:
    return with_user(server.url, user, PASSWORDS[user])


@pytest.fixture
async def controls(acl_redis: Server) -> AsyncIterator[dict[str, Control]]:
    out = {user: await connect_control(url(acl_redis, user), RUN, timeout_s=2.0) for user in PASSWORDS}
    yield out
    for c in out.values():
        await c.close()


def result(version: int) -> EvalResult:
    return EvalResult(policy_version=version, suite="arith", score=0.5, decision="promote")


async def test_each_service_does_its_own_work(controls: dict[str, Control]) -> None:
    learner = controls["learner"]
    lease = learner.lease("learner-0", ttl_s=5.0)
    token = await lease.acquire()
    assert token == 1
    assert await lease.renew()
    assert await learner.ledger.claim(["e1", "e2"], step=1) == [True, True]
    assert await learner.ledger.counted(["e1", "e3"]) == [True, False]
    assert await learner.task_stats.record_many([("arith:t1", 1.0, True)]) == 1

    observed = await controls["weight-publisher"].lease("weight-publisher").current()
    assert observed is not None and observed.token == token

    gate = controls["eval-gate"].evals
    await gate.record(result(1))
    assert await gate.promote(1) is None
    assert await gate.promoted() == 1
    assert (await gate.get(1)) == result(1)
    assert await gate.rollback() is None

    for reader in ("rollout-worker", "task-source", "eval-gate"):  # announce checks read the granted fence
        assert await controls[reader].granted_fence() == token
    stats = await controls["task-source"].task_stats.get_many(["arith:t1"])
    assert stats[0].attempts == 1 and stats[0].solved == 1
    assert await lease.release()


async def test_each_service_is_refused_outside_its_rights(controls: dict[str, Control]) -> None:
    # The task source may read statistics, not write them or take the learner's lease.
    with pytest.raises(NoPermissionError):
        await controls["task-source"].task_stats.record_many([("arith:t1", 1.0, True)])
    with pytest.raises(NoPermissionError):
        await controls["task-source"].lease("intruder").acquire()
    # The weight-publisher observes the lease; it cannot take it (the fence counter is the learner's).
    with pytest.raises(NoPermissionError):
        await controls["weight-publisher"].lease("intruder").acquire()
    # Only the eval-gate moves the promotion pointer; the learner cannot.
    with pytest.raises(NoPermissionError):
        await controls["learner"].evals.promote(7)
    with pytest.raises(NoPermissionError):
        await controls["eval-gate"].ledger.claim(["forged"], step=1)
    # A worker only reads the granted fence token: it cannot move it, nor touch anything else.
    assert await controls["rollout-worker"].granted_fence() == await controls[ADMIN].granted_fence()
    with pytest.raises(NoPermissionError):
        await controls["rollout-worker"].lease("intruder").acquire()
    with pytest.raises(NoPermissionError):
        await controls["rollout-worker"].evals.promoted()
    # A service with no control-plane rights at all can only ping.
    assert await controls["reward-model"].ping()
    with pytest.raises(NoPermissionError):
        await controls["reward-model"].granted_fence()
    assert await controls[ADMIN].evals.promoted() is None  # nothing above got through


async def test_another_runs_keys_and_admin_commands_are_refused(acl_redis: Server) -> None:
    other = await connect_control(url(acl_redis, "eval-gate"), "another-run")
    try:
        with pytest.raises(NoPermissionError):
            await other.evals.promote(3)
    finally:
        await other.close()
    r = aioredis.Redis.from_url(url(acl_redis, "learner"))
    try:
        for cmd in (("FLUSHALL",), ("KEYS", "*"), ("CONFIG", "GET", "*"), ("ACL", "LIST")):
            with pytest.raises(NoPermissionError):
                await r.execute_command(*cmd)
    finally:
        await r.aclose()


async def test_no_password_no_access(acl_redis: Server) -> None:
    r = aioredis.Redis.from_url(acl_redis.url)
    try:
        with pytest.raises((AuthenticationError, ResponseError), match=r"authenticated|NOAUTH"):
            await r.get("x")
    finally:
        await r.aclose()
    wrong = aioredis.Redis.from_url(with_user(acl_redis.url, "learner", "guess"))
    try:
        with pytest.raises(AuthenticationError):
            await wrong.ping()
    finally:
        await wrong.aclose()
