"""Three hosts on one machine (network namespaces): a JetStream cluster and Redis with Sentinel, under faults.

Every server runs inside a namespace on its own address (`slipstream.stack.hosts`); this process
reaches them through the hosts' bridge. The hosts themselves: each has its own address, a cut
link isolates one until it is healed, and everything made (namespaces, links, processes) is gone
afterwards, also when the block fails. Faults, each while messages flow:

- the nats-server leading TRAJ_SCORED (3 replicas) is killed: every published id is stored once
  and accounted once by the consumer (a redelivery is recognised, as the learner's ledger does);
- the host of the new leader is cut off and healed: the other two go on, and the healed replica
  catches up;
- the three nodes are restarted one by one (a rolling upgrade): the same accounting holds;
- the Redis primary is killed: Sentinel promotes the replica; the lease granted before the kill is
  still held after it (nobody else is granted it), an unreplicated grant is refused, and once the
  holder stops renewing, the successor's fencing token is higher and the old one is fenced.

Skipped, with the reason, where network namespaces cannot be made (not root, no iproute2).
"""

from __future__ import annotations

import asyncio
import ipaddress
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import pytest
from scored_trajectories import trajectory

from slipstream.bus import Bus, BusConfig, BusError, PublishError, connect_bus
from slipstream.control import ControlClient, ControlUnavailable, LeaderLease, LeaseHeld
from slipstream.control.client import NotReplicated
from slipstream.schemas import ScoredEpisode, scored_episode_from_v1
from slipstream.schemas.subjects import traj_scored_subject
from slipstream.stack import pid_alive
from slipstream.stack.cluster import (
    NatsCluster,
    RedisFailover,
    start_nats_cluster,
    start_redis_failover,
)
from slipstream.stack.hosts import Hosts, unavailable

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]

WHY_NOT = unavailable()
if WHY_NOT:
    pytestmark.append(pytest.mark.skip(reason=f"no network namespaces: {WHY_NOT}"))

SUBJECT = traj_scored_subject("arith")
STREAM = "TRAJ_SCORED"
T = TypeVar("T")
TTL_S = 8.0
"""Lease TTL: longer than a Sentinel failover (down-after 1 s, then the election), as in production."""


@pytest.fixture
def hosts() -> Iterator[Hosts]:
    with Hosts(3) as h:
        yield h
    assert h.names() == [] and h.links() == [], "the hosts were not removed"


ECHO = (
    "import socket, sys\n"
    "s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)\n"
    "s.bind((sys.argv[1], 25555)); s.listen()\n"
    "while True:\n"
    "    c, _ = s.accept(); c.sendall(c.recv(64)); c.close()\n"
)


def echo(hosts: Hosts, frm: int, to: int) -> bool:
    """Whether host `frm` gets an answer from the echo server on host `to` within 2 s."""
    probe = (
        "import socket, sys\n"
        "try:\n"
        "    c = socket.create_connection((sys.argv[1], 25555), timeout=2); c.sendall(b'hi')\n"
        "    sys.exit(0 if c.recv(8) == b'hi' else 1)\n"
        "except OSError:\n"
        "    sys.exit(1)\n"
    )
    argv = hosts[frm].exec_argv([sys.executable, "-c", probe, hosts[to].address])
    return subprocess.run(argv, capture_output=True, timeout=10, check=False).returncode == 0


def reaches(hosts: Hosts, frm: int, to: int, timeout_s: float = 15.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not echo(hosts, frm, to):
        assert time.monotonic() < deadline, f"host {frm} never reached host {to}"
        time.sleep(0.2)


def test_hosts_have_their_own_addresses_a_cut_isolates_one_and_everything_is_removed(tmp_path: Path) -> None:
    with Hosts(3) as hosts:
        addresses = [h.address for h in hosts.hosts]
        assert len(set(addresses)) == 3 and hosts.subnet is not None
        assert all(ipaddress.ip_address(a) in hosts.subnet for a in addresses)
        assert len(hosts.names()) == 3
        hosts.start(hosts[2], "echo", [sys.executable, "-c", ECHO, hosts[2].address], tmp_path / "echo.log")
        reaches(hosts, 0, 2)
        hosts.cut(hosts[2])
        assert not echo(hosts, 0, 2) and not echo(hosts, 1, 2)
        hosts.heal(hosts[2])
        reaches(hosts, 1, 2)  # the link takes a moment to come up and the neighbours to resolve again
        echo_pid = hosts.procs[0].pid
    assert hosts.names() == [] and hosts.links() == []
    assert not pid_alive(echo_pid)
    # A failure inside the block removes them too.
    with pytest.raises(RuntimeError, match="boom"), Hosts(2) as failing:
        raise RuntimeError("boom")
    assert failing.names() == [] and failing.links() == []


def bus_config(url: str) -> BusConfig:
    # Short pings: a client whose node is cut off notices within seconds and moves to another URL.
    return BusConfig(url=url, stream_replicas=3, ping_interval_s=1.0, max_outstanding_pings=2, ack_timeout_s=5.0)


async def until(predicate: Callable[[], Awaitable[bool]], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        if await predicate():
            return
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout_s:.0f} s waiting for {what}")
        await asyncio.sleep(0.2)


class Flow:
    """Publishes numbered scored episodes and consumes them with the learner's durable, ids accounted once."""

    def __init__(self, pub: Bus, sub: Bus) -> None:
        self.pub, self.sub = pub, sub
        self.published: list[str] = []
        self.deliveries: Counter[str] = Counter()
        self.accounted: set[str] = set()  # what a ledger would count: each id once
        self.republished = 0

    async def publish(self, start: int, n: int, pace_s: float = 0.01) -> None:
        for i in range(start, start + n):
            eid = f"e{i:05d}"
            scored = scored_episode_from_v1(trajectory(eid, f"{eid}/s1", size=1, reward=1.0))
            while True:
                try:
                    await self.pub.publish(SUBJECT, scored, msg_id=eid)
                    break
                except PublishError:
                    # What a producer does (its input is redelivered): publish again under the same
                    # msg id, which the stream stores once.
                    self.republished += 1
                    await asyncio.sleep(0.2)
            self.published.append(eid)
            await asyncio.sleep(pace_s)

    async def consume(self, stop: asyncio.Event) -> None:
        consumer = await self.sub.consumer("learner", ScoredEpisode)
        try:
            while not stop.is_set():
                for d in await consumer.fetch(32, 0.5):
                    eid = d.msg.episode.episode_id
                    self.deliveries[eid] += 1
                    self.accounted.add(eid)
                    await d.ack()
        finally:
            await consumer.close()

    async def drained(self) -> bool:
        return self.accounted >= set(self.published)


@dataclass
class Nats3:
    hosts: Hosts
    cluster: NatsCluster
    admin: Bus
    pub: Bus
    sub: Bus


@pytest.fixture
async def nats3(hosts: Hosts, tmp_path: Path) -> AsyncIterator[Nats3]:
    cluster = start_nats_cluster(hosts, tmp_path / "data", tmp_path / "logs")
    admin = await connect_bus(bus_config(cluster.url), name="provision")
    await provision(admin)
    pub = await connect_bus(bus_config(cluster.url), name="publisher")
    sub = await connect_bus(bus_config(cluster.url), name="consumer")
    try:
        yield Nats3(hosts, cluster, admin, pub, sub)
    finally:
        for b in (sub, pub, admin):
            await b.close()


async def provision(bus: Bus, timeout_s: float = 30.0) -> None:
    """Create the R3 streams once the cluster has formed ("no suitable peers" until every node has met)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            await bus.ensure_streams()
            return
        except BusError:
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.5)


async def leader(bus: Bus) -> str:
    info = await bus.stream_info(STREAM)
    return str(info["leader"])


async def test_killing_the_stream_leader_and_cutting_a_host_loses_nothing_and_counts_nothing_twice(
    nats3: Nats3,
) -> None:
    hosts, cluster, admin, pub, sub = nats3.hosts, nats3.cluster, nats3.admin, nats3.pub, nats3.sub
    info = await admin.stream_info(STREAM)
    assert len(info["replicas"]) == 2 and info["leader"], info  # 3 copies: a leader and two followers
    flow = Flow(pub, sub)
    stop = asyncio.Event()
    consuming = asyncio.create_task(flow.consume(stop))
    timings: dict[str, float] = {}
    try:
        await flow.publish(0, 100)
        # 1. Kill the leader of the stream mid-flow.
        first = await leader(admin)
        publishing = asyncio.create_task(flow.publish(100, 200))
        await asyncio.sleep(0.5)
        t0 = time.monotonic()
        cluster.stop(cluster.index_of(first))  # SIGKILL by PID
        await until(lambda: _new_leader(admin, first), 30, "a new stream leader")
        timings["leader_kill"] = time.monotonic() - t0
        await asyncio.wait_for(publishing, 90)
        cluster.start(cluster.index_of(first))  # back, same store: it catches up as a follower
        await until(lambda: _all_current(admin), 60, "the restarted node to catch up")
        # 2. Cut the host of the current leader off, publish through the others, heal.
        second = await leader(admin)
        host = hosts[cluster.index_of(second)]
        publishing = asyncio.create_task(flow.publish(300, 200))
        await asyncio.sleep(0.5)
        t0 = time.monotonic()
        hosts.cut(host)
        await until(lambda: _new_leader(admin, second), 30, "a leader on the hosts still connected")
        timings["partition"] = time.monotonic() - t0
        await asyncio.wait_for(publishing, 90)
        hosts.heal(host)
        await until(lambda: _all_current(admin), 60, "the healed replica to catch up")
        await until(flow.drained, 60, "every published id consumed")
        # Just after a heal the consumer's own group may still be electing its leader, and the
        # consumer list leaves it out until then: wait for it to be listed (it must show 0 pending).
        await until(lambda: _consumer_listed(admin, "learner"), 30, "the learner's consumer listed again")
    finally:
        stop.set()
        await asyncio.wait_for(consuming, 30)
    info = await admin.stream_info(STREAM)
    assert len(flow.published) == 500 and len(set(flow.published)) == 500
    assert flow.accounted == set(flow.published), "an id was lost"
    assert info["last_seq"] == 500, f"{info['last_seq']} stored for 500 ids: a publish retry was stored twice"
    assert info["consumers"]["learner"]["num_pending"] == 0
    redelivered = sum(n - 1 for n in flow.deliveries.values())
    print(
        f"recovery: {timings}; redelivered {redelivered}, republished {flow.republished}: each stored and counted once"
    )


async def test_rolling_the_nats_nodes_one_by_one_loses_nothing(nats3: Nats3) -> None:
    cluster, admin = nats3.cluster, nats3.admin
    flow = Flow(nats3.pub, nats3.sub)
    stop = asyncio.Event()
    consuming = asyncio.create_task(flow.consume(stop))
    try:
        publishing = asyncio.create_task(flow.publish(0, 400, pace_s=0.02))
        for i in range(3):  # a rolling upgrade: each node stopped cleanly, started again, caught up
            await asyncio.sleep(0.5)
            cluster.stop(i, kill=False)
            await asyncio.sleep(1.0)
            cluster.start(i)
            await until(lambda: _all_current(admin), 60, f"node n{i} to catch up")
        await asyncio.wait_for(publishing, 90)
        await until(flow.drained, 60, "every published id consumed")
    finally:
        stop.set()
        await asyncio.wait_for(consuming, 30)
    info = await admin.stream_info(STREAM)
    assert flow.accounted == set(flow.published) and len(flow.published) == 400
    assert info["last_seq"] == 400 and info["consumers"]["learner"]["num_pending"] == 0


async def _new_leader(bus: Bus, old: str) -> bool:
    try:
        now = await leader(bus)
    except Exception:  # the meta leader is being elected: ask again
        return False
    return bool(now) and now != old


async def _consumer_listed(bus: Bus, durable: str) -> bool:
    try:
        info = await bus.stream_info(STREAM)
    except Exception:
        return False
    return durable in info["consumers"]


async def _all_current(bus: Bus) -> bool:
    try:
        info = await bus.stream_info(STREAM)
    except Exception:
        return False
    replicas = info["replicas"]
    return len(replicas) == 2 and all(r["current"] and not r["offline"] for r in replicas.values())


async def test_a_redis_failover_grants_no_lease_twice_and_the_fence_proves_it(hosts: Hosts, tmp_path: Path) -> None:
    rf = start_redis_failover(hosts, tmp_path / "data", tmp_path / "logs")
    assert await rf.sentinel_primary() == hosts[0].address
    client_a, client_b = ControlClient(rf.url, timeout_s=2.0), ControlClient(rf.url, timeout_s=2.0)
    try:
        await until(lambda: _replica_online(rf), 20, "the replica in sync")
        a = LeaderLease(client_a, "run", holder_id="learner-a", ttl_s=TTL_S)
        b = LeaderLease(client_b, "run", holder_id="learner-b", ttl_s=TTL_S)
        t1 = await a.acquire()
        a.keepalive()  # as the learner does: renewals retried through the failover
        # A grant no replica holds is not a grant: with the replica paused, acquiring fails closed.
        stalled = LeaderLease(client_b, "other-run", holder_id="learner-c", ttl_s=4.0)
        rf.procs["redis-1"].send(signal.SIGSTOP)
        try:
            with pytest.raises(ControlUnavailable) as refused:
                await stalled.acquire()
            assert isinstance(refused.value.__cause__, NotReplicated)
        finally:
            rf.procs["redis-1"].send(signal.SIGCONT)
        # Kill the primary; Sentinel promotes the replica, which has the lease and the fence counter.
        t0 = time.monotonic()
        rf.kill("redis-0")
        await until(lambda: _primary_is(rf, hosts[1].address), 30, "Sentinel to promote the replica")
        promoted_s = time.monotonic() - t0
        rf.start_redis(0, replica_of=1)  # the old primary returns as the new one's replica
        await until(lambda: _replica_online(rf), 30, "the returned node in sync")
        with pytest.raises(LeaseHeld) as held:
            await _retrying(lambda: b.acquire())
        assert (held.value.holder, held.value.token) == ("learner-a", t1), "the lease was granted twice"
        assert not a.lost and await a.fenced_publish_allowed(t1), "the holder lost its lease in the failover"
        assert int(await client_b.redis.get(b.keys.fence)) == t1  # the counter survived: the next token is new
        # The holder stops renewing; once it lapses the successor gets a higher token, the old one is fenced.
        await a.stop_keepalive()
        await asyncio.sleep(TTL_S + 0.5)
        t2 = await _retrying(lambda: b.acquire())
        assert t2 > t1
        assert not await a.check(t1) and not await a.fenced_publish_allowed(t1)  # Redis says: superseded
        assert await b.fenced_publish_allowed(t2)
        print(f"recovery: promoted in {promoted_s:.1f} s; tokens {t1} -> {t2}")
    finally:
        await client_a.close()
        await client_b.close()


async def _retrying(op: Callable[[], Awaitable[T]], timeout_s: float = 20.0) -> T:
    """`op()` retried while the control plane is unavailable (the client rediscovering the primary)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return await op()
        except ControlUnavailable:
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.2)


async def _primary_is(rf: RedisFailover, address: str) -> bool:
    return await rf.sentinel_primary() == address


async def _replica_online(rf: RedisFailover) -> bool:
    """The current primary reports a replica connected and in sync."""
    return await rf.replica_online(await rf.sentinel_primary())


def test_bench_bus_hosts_measures_one_node_against_three_replicas() -> None:
    from slipstream.bench.bus import build_messages
    from slipstream.bench.bus_hosts import measure, table

    msgs, payloads = build_messages(60, 2000)
    res = measure(3, msgs, sum(len(p) for p in payloads) / len(payloads))
    rates = res["trajectories_per_s"]
    assert (rates["single"]["copies"], rates["replicated"]["copies"]) == (1, 3)
    assert all(rates[side][p] > 0 for side in rates for p in ("publish", "consume"))
    assert res["ratio"]["publish"] == rates["replicated"]["publish"] / rates["single"]["publish"]
    assert "replicated (3 copies)" in table(res)
    # CPU per trajectory (client and servers) for each side and phase; 60 messages may cost under one
    # clock tick, so only that it was read, not how much.
    cpu = res["cpu"]
    assert all(
        cpu[side][p][who]["us_per_trajectory"] >= 0 for side in cpu for p in cpu[side] for who in ("client", "servers")
    )
    assert "CPU per trajectory" in table(res)
