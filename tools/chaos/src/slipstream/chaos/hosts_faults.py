"""The faults of `slipstream chaos --hosts 3`: hosts lost, cut off and restarted under a training run.

The run's stack is a `multihost.HostsStack` (namespace hosts, a 3-node JetStream cluster with
every stream replicated 3 times, Redis with a replica and Sentinel). `HostsChaos` drives the
schedule as `Chaos` does (a fault, then `gap` learner steps after it settled, then the next) and
applies:

- `kill:nats-leader`: SIGKILL the nats-server leading the trajectory streams; recovered when the
  streams it led have a new leader and the learner steps again; it is started again on its store
  and must catch up;
- `cut:worker-host`: take the rollout worker's host off the bridge (its JetStream node and
  Sentinel go with it) for CUT_S, then heal it; recovered when the worker publishes again and the
  learner steps;
- `kill:redis-primary`: SIGKILL the Redis primary; Sentinel promotes the replica, the old primary
  returns as its replica, and the learner steps on holding its lease (its restarts are counted);
- `roll:nats`: stop each node cleanly and start it again, one by one, each caught up before the
  next (a rolling upgrade), while training goes on;
- `kill:ray-worker` (only with learner ranks > 1, so the stack runs a Ray cluster across hosts):
  SIGKILL every process of the last Ray worker node (its raylet, agents and the rank actor on it).
  The learner's step fails with a `RankError` and the learner exits 1 (no in-process recovery);
  the supervisor restarts it; the node is started again on its host RAY_NODE_DOWN_S later (a
  replacement host), the restarted learner places its ranks on both hosts again, resumes from its
  last checkpoint and steps; recovered at that step. Not in the default schedule: that runs 1 rank.

Each record's detail has the times to recover. The audit needs the streams while the cluster
still runs: `on_services_stopped` reads them once the services have stopped (`streams`).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any

from slipstream.chaos.audit import read_streams
from slipstream.chaos.faults import Chaos, FaultFailed, FaultRecord

HOST_FAULTS: tuple[str, ...] = ("kill:nats-leader", "cut:worker-host", "kill:redis-primary", "roll:nats")
"""The default schedule of `chaos --hosts` (the learner on one rank)."""
RAY_FAULTS: tuple[str, ...] = ("kill:ray-worker",)
"""Faults that need the learner's ranks on a Ray cluster across the hosts."""
RAY_NODE_DOWN_S = 5.0
"""How long a killed Ray worker node stays down before it is started again on its host."""
TRAJ_STREAMS = ("TRAJ_RAW", "TRAJ_SCORED")
ALL_STREAMS = ("TASKS", "TRAJ_RAW", "TRAJ_SCORED", "WEIGHTS", "DLQ")
CUT_S = 10.0
"""How long the worker's host stays cut off: past the clients' 3 s ping timeout and a leader election."""
STEP_TIMEOUT_S = 300.0


async def _until_async(pred: Callable[[], Awaitable[bool]], timeout_s: float, what: str) -> float:
    t0 = time.monotonic()
    while not await pred():
        if time.monotonic() - t0 > timeout_s:
            raise FaultFailed(f"timed out after {timeout_s:.0f} s waiting for {what}")
        await asyncio.sleep(0.2)
    return time.monotonic() - t0


class HostsChaos(Chaos):
    """`Chaos` with the hosts' faults (see the module docstring)."""

    def __init__(self, *args: Any, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.streams: dict[str, list[tuple[str, bytes, dict[str, str]]]] | None = None
        self.stream_read_error = ""
        self.placement: list[dict[str, Any]] = []
        self._bus: Any = None

    def on_stack(self, stack: Any) -> None:
        super().on_stack(stack)
        self.placement = stack.where()
        stack.on_services_stopped.append(self._read_streams)

    def _read_streams(self, stack: Any) -> None:
        """Every message left in the streams, read from the cluster once the services stopped.

        A node a fault left stopped (the run ended during `roll:nats`) is started again first."""
        try:
            for i in range(len(stack.nats.nodes)):
                if i not in stack.nats.procs:
                    stack.nats.start(i)
            self.streams = asyncio.run(read_streams(stack.servers["nats"].url))
        except Exception as exc:
            self.stream_read_error = repr(exc)
            raise

    async def _drive(self) -> None:
        try:
            await super()._drive()
        finally:
            await self.close()

    # -- helpers -------------------------------------------------------------------------------------
    async def _admin(self) -> Any:
        from slipstream.bus import connect_bus

        if self._bus is None:
            self._bus = await connect_bus(self.stack.admin_bus(), name="chaos-hosts")
        return self._bus

    async def _leaders(self) -> dict[str, str]:
        bus = await self._admin()
        out = {}
        for s in ALL_STREAMS:
            try:
                out[s] = str((await bus.stream_info(s))["leader"])
            except Exception:
                out[s] = ""
        return out

    async def _all_current(self) -> bool:
        bus = await self._admin()
        for s in ALL_STREAMS:
            try:
                replicas = (await bus.stream_info(s))["replicas"]
            except Exception:
                return False
            if len(replicas) != 2 or not all(r["current"] and not r["offline"] for r in replicas.values()):
                return False
        return True

    async def _steps_after(self, n: int) -> float:
        return await self._next_steps(n, STEP_TIMEOUT_S)

    # -- the faults ----------------------------------------------------------------------------------
    async def _apply(self, rec: FaultRecord) -> str:
        if rec.name == "kill:nats-leader":
            return await self._kill_leader(rec)
        if rec.name == "cut:worker-host":
            return await self._cut_worker(rec)
        if rec.name == "kill:redis-primary":
            return await self._kill_redis(rec)
        if rec.name == "roll:nats":
            return await self._roll(rec)
        if rec.name == "kill:ray-worker":
            return await self._kill_ray_worker(rec)
        raise FaultFailed(f"{rec.name} is not a hosts fault; known: {', '.join(HOST_FAULTS + RAY_FAULTS)}")

    async def _kill_leader(self, rec: FaultRecord) -> str:
        cluster = self.stack.nats
        before = await self._leaders()
        led = [before[s] for s in TRAJ_STREAMS if before[s]]
        if not led:
            raise FaultFailed(f"no leader reported for the trajectory streams: {before}")
        victim = max(led, key=led.count) if len(set(led)) == 1 else before["TRAJ_SCORED"]
        streams_led = [s for s in ALL_STREAMS if before[s] == victim]
        i = cluster.index_of(victim)
        pid = cluster.procs[i].pid
        t0 = time.monotonic()
        cluster.stop(i)  # SIGKILL by PID
        leaders: dict[str, str] = {}

        async def reelected() -> bool:
            leaders.update(await self._leaders())
            return all(leaders[s] and leaders[s] != victim for s in streams_led)

        elected = await _until_async(reelected, 60, f"new leaders for {streams_led}")
        await self._steps_after(1)
        stepped = time.monotonic() - t0
        t1 = time.monotonic()
        cluster.start(i)  # on the main thread, on its own store
        await _until_async(self._all_current, 120, f"{victim} to catch up")
        caught = time.monotonic() - t1
        rec.detail = {
            "node": victim,
            "pid": pid,
            "host": i,
            "streams_led": streams_led,
            "leaders_before": before,
            "leaders_after": dict(leaders),
            "leader_elected_s": round(elected, 2),
            "next_learner_step_s": round(stepped, 2),
            "restarted_caught_up_s": round(caught, 2),
        }
        return (
            f"SIGKILL {victim} (leading {', '.join(streams_led)}); new leaders in {elected:.1f} s, "
            f"a learner step {stepped:.1f} s after the kill; restarted, caught up in {caught:.1f} s"
        )

    async def _cut_worker(self, rec: FaultRecord) -> str:
        hosts = self.stack.hosts
        host = self.stack.host_of("rollout-worker")
        on_host = [r["name"] for r in self.placement if r["host"] == host.index]
        t0 = time.monotonic()
        hosts.cut(host)
        await asyncio.sleep(CUT_S)
        cut_steps = self.steps
        hosts.heal(host)
        t1 = time.monotonic()
        tapped = self.tap.tapped if self.tap is not None else 0

        async def publishing() -> bool:
            return self.tap is not None and self.tap.tapped > tapped

        published = await _until_async(publishing, STEP_TIMEOUT_S, "the worker publishing again after the heal")
        stepped = await self._steps_after(1)
        await _until_async(self._all_current, 120, "the healed node to catch up")
        rec.detail = {
            "host": host.index,
            "netns": host.netns,
            "on_host": on_host,
            "cut_s": round(t1 - t0, 2),
            "learner_steps_while_cut": max(0, cut_steps - rec.at_step),
            "worker_published_after_heal_s": round(published, 2),
            "next_learner_step_after_heal_s": round(published + stepped, 2),
            "replicas_current_after_heal_s": round(time.monotonic() - t1, 2),
        }
        return (
            f"cut host {host.index} ({', '.join(on_host)}) for {t1 - t0:.0f} s; after the heal the worker "
            f"published again in {published:.1f} s, the learner stepped {published + stepped:.1f} s after it"
        )

    async def _kill_redis(self, rec: FaultRecord) -> str:
        rf = self.stack.redis
        hosts = self.stack.hosts
        old_addr = await rf.sentinel_primary()
        old = next((h.index for h in hosts.hosts if h.address == old_addr), None)
        if old is None or f"redis-{old}" not in rf.procs:
            raise FaultFailed(f"Sentinel names {old_addr!r} as the primary, not a Redis of this stack")
        restarts = self.stack.supervisor.restarts("learner")
        t0 = time.monotonic()
        rf.kill(f"redis-{old}")
        new_addr = ""

        async def promoted() -> bool:
            nonlocal new_addr
            new_addr = await rf.sentinel_primary()
            return bool(new_addr) and new_addr != old_addr

        took = await _until_async(promoted, 60, "Sentinel to promote the replica")
        new = next(h.index for h in hosts.hosts if h.address == new_addr)
        rf.start_redis(old, replica_of=new)  # the old primary returns as the new one's replica
        synced = await _until_async(lambda: rf.replica_online(new_addr), 60, "the returned node in sync")
        await self._steps_after(2)
        rec.detail = {
            "killed": f"redis-{old}",
            "promoted": f"redis-{new}",
            "promoted_after_s": round(took, 2),
            "replica_back_in_sync_s": round(synced, 2),
            "two_learner_steps_after_s": round(time.monotonic() - t0, 2),
            "learner_restarts_during_fault": self.stack.supervisor.restarts("learner") - restarts,
        }
        return (
            f"SIGKILL redis-{old}; Sentinel promoted redis-{new} in {took:.1f} s; two learner steps "
            f"{rec.detail['two_learner_steps_after_s']:.1f} s after the kill"
        )

    async def _roll(self, rec: FaultRecord) -> str:
        cluster = self.stack.nats
        per_node: dict[str, float] = {}
        t0 = time.monotonic()
        for i in range(len(cluster.nodes)):
            t = time.monotonic()
            cluster.stop(i, kill=False)  # SIGTERM: a clean stop, as an upgrade does
            await asyncio.sleep(1.0)
            cluster.start(i)
            await _until_async(self._all_current, 120, f"n{i} to catch up")
            per_node[f"n{i}"] = round(time.monotonic() - t, 2)
        rolled = time.monotonic() - t0
        stepped = await self._steps_after(2)
        rec.detail = {"per_node_back_and_current_s": per_node, "rolled_s": round(rolled, 2)}
        rec.detail["two_learner_steps_after_s"] = round(stepped, 2)
        return f"rolled {len(per_node)} nodes in {rolled:.1f} s ({per_node}); two learner steps {stepped:.1f} s later"

    async def _kill_ray_worker(self, rec: FaultRecord) -> str:
        cluster = self.stack.ray
        if cluster is None or len(cluster.nodes) < 2:
            raise FaultFailed("kill:ray-worker needs the learner on 2 or more ranks (a Ray cluster across the hosts)")
        i = len(cluster.nodes) - 1
        host = cluster.nodes[i]
        restarts = self.stack.supervisor.restarts("learner")
        steps = self.steps
        t0 = time.monotonic()
        killed = await asyncio.to_thread(cluster.kill, i)

        async def learner_restarted() -> bool:
            return self.stack.supervisor.restarts("learner") > restarts

        exited = await _until_async(learner_restarted, 120, "the learner to exit and be restarted after losing a rank")
        steps_after_kill = self.steps - steps
        await asyncio.sleep(max(0.0, RAY_NODE_DOWN_S - (time.monotonic() - t0)))
        t1 = time.monotonic()
        await asyncio.to_thread(cluster.start, i)
        node_back = time.monotonic() - t1
        await self._steps_after(1)
        rec.detail = {
            "node": i,
            "host": host.index,
            "address": host.address,
            "pids_killed": len(killed),
            "learner_restarted_after_s": round(exited, 2),
            "learner_steps_between_kill_and_exit": steps_after_kill,
            "node_restarted_s": round(node_back, 2),
            "next_learner_step_after_kill_s": round(time.monotonic() - t0, 2),
            "learner_restarts_during_fault": self.stack.supervisor.restarts("learner") - restarts,
        }
        return (
            f"SIGKILL Ray worker node {i} on host {host.index} ({len(killed)} processes); the learner exited and "
            f"was restarted {exited:.1f} s after, the node was back {RAY_NODE_DOWN_S:.0f} s after the kill, and "
            f"the learner stepped again {rec.detail['next_learner_step_after_kill_s']:.1f} s after the kill"
        )

    async def close(self) -> None:
        if self._bus is not None:
            await self._bus.close()
            self._bus = None
