"""The local stack spread over network-namespace hosts: `slipstream up --hosts N`, `slipstream chaos --hosts 3`.

`HostsStack(spec)` with `spec.hosts = N` (N >= 3, root only) is a `Stack` whose servers and
services run on N hosts made by `hosts.Hosts` (namespaces on one bridge, each with its own
address) instead of this machine's loopback:

- a 3-node JetStream cluster on hosts 0-2 (`cluster.start_nats_cluster`), every stream created
  with 3 replicas before any service starts; the services get every node's URL and short pings
  (a cut-off node is noticed within seconds and the client moves to another);
- Redis with a replica and three Sentinels on hosts 0-2 (`cluster.start_redis_failover`); the
  services' `redis_url` is the `redis+sentinel://` URL, so after a failover they find the
  promoted replica;
- with `[learner] ranks = N > 1` (`spec.learner_ranks`), a Ray cluster (`raycluster`): the head
  on host 0, a worker node on each of hosts 1..N-1, node r offering `slipstream-rank-<r>`; the
  learner (the Ray driver, on the head's host) joins it (`ray_address`) and places rank r on node r
  (`rank_resource`), so its ranks train on different hosts, FSDP2 over gloo across the bridge;
- the services spread by `placement`: the learner and its weight-publisher(s) on host 0, the
  reward-model, task-source and the rest on host 1, rollout workers (and sub-agent pools) on the
  last host(s), each `ip netns exec`-ed on its host with its HTTP port on the host's address.

The object store stays a local directory: the namespaces separate the network, not the disk.
The servers run without per-service users (`spec.secure` is ignored): the Redis failover set has
no ACLs yet. Signed manifests and signed scores are checked as on one host. `stop()` stops the
services, calls `on_services_stopped` (the chaos audit reads the streams there, while the cluster
still runs), then stops every server and removes the namespaces, veths and bridge, also when the
start failed half-way. `open_stack(spec)` picks this class or the plain `Stack`.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import time
from collections.abc import Callable
from typing import Any

from slipstream.bus.config import BusConfig
from slipstream.stack.cluster import NatsCluster, RedisFailover, start_nats_cluster, start_redis_failover
from slipstream.stack.handles import ServerHandle
from slipstream.stack.hosts import Host, Hosts, HostsError, unavailable
from slipstream.stack.local import Stack, StackError
from slipstream.stack.raycluster import RANK_RESOURCE, RayCluster, RayClusterError, ray_unavailable, start_ray_cluster
from slipstream.stack.spec import SUBAGENT_POOL, StackSpec, kind_of

MIN_HOSTS = 3
"""A 3-node JetStream cluster and a Sentinel quorum of 2 of 3 need three hosts."""
PROVISION_TIMEOUT_S = 60.0
"""How long the streams' creation is retried while the cluster forms ("no suitable peers")."""
CLUSTER_BUS_ENV = {
    "SLIPSTREAM_BUS__STREAM_REPLICAS": "3",
    # A node cut off without a reset is noticed after 3 unanswered pings (3 s), not 240 s.
    "SLIPSTREAM_BUS__PING_INTERVAL_S": "1.0",
    "SLIPSTREAM_BUS__MAX_OUTSTANDING_PINGS": "3",
}
"""Every service's `[bus]` settings on the hosts (the spec's own env wins where it names one)."""
CLUSTER_CLIENT = {"ping_interval_s": 1.0, "max_outstanding_pings": 3}
"""The stack's own bus clients (the run's follower, the chaos suite) on the cluster."""
CLUSTER_TAP: dict[str, Any] = {"ping_interval": 1, "max_outstanding_pings": 3, "max_reconnect_attempts": -1}
"""`nats.connect` options of the run's trajectory tap on the cluster: it moves off a dead node in seconds."""
LEARNER_KINDS = ("learner", "weight-publisher")
WORKER_KINDS = ("rollout-worker", SUBAGENT_POOL)


def placement(names: list[str] | tuple[str, ...], n: int) -> dict[str, int]:
    """Which host each process runs on: learner side on 0, workers on the last host(s), the rest on 1."""
    if n < MIN_HOSTS:
        raise ValueError(f"placement needs at least {MIN_HOSTS} hosts, got {n}")
    worker_hosts = list(range(2, n))
    out: dict[str, int] = {}
    workers = 0
    for name in names:
        kind = kind_of(name)
        if kind in LEARNER_KINDS:
            out[name] = 0
        elif kind in WORKER_KINDS:
            out[name] = worker_hosts[-1 - workers % len(worker_hosts)]
            workers += 1
        else:
            out[name] = 1
    return out


class HostsStack(Stack):
    """A `Stack` on namespace hosts (see the module docstring)."""

    def __init__(self, spec: StackSpec, **kw: Any) -> None:
        if spec.hosts < MIN_HOSTS:
            raise StackError(f"--hosts must be at least {MIN_HOSTS} (a 3-node JetStream cluster), got {spec.hosts}")
        if spec.nats_url or spec.redis_url:
            raise StackError("--hosts starts its own NATS cluster and Redis failover set; drop --nats-url/--redis-url")
        why = unavailable()
        if why:
            raise StackError(f"--hosts {spec.hosts} needs network namespaces, unavailable here: {why}")
        if spec.learner_ranks > spec.hosts:
            raise StackError(f"{spec.learner_ranks} learner ranks need a host each, got --hosts {spec.hosts}")
        if spec.learner_ranks > 1 and (why := ray_unavailable()):
            raise StackError(f"{spec.learner_ranks} learner ranks on --hosts need a Ray cluster: {why}")
        super().__init__(dataclasses.replace(spec, secure=False), **kw)
        self.hosts: Hosts | None = None
        self.nats: NatsCluster | None = None
        self.redis: RedisFailover | None = None
        self.ray: RayCluster | None = None
        self.placed = placement(self._all_names(), self.spec.hosts)
        self.on_services_stopped: list[Callable[[HostsStack], None]] = []

    def _all_names(self) -> list[str]:
        from slipstream.stack.spec import pool_replica_names, tool_replica_names

        spec = self.spec
        return [*tool_replica_names(spec.tool_services), *pool_replica_names(spec.subagent_pool), *spec.process_names()]

    # -- Stack's hooks ----------------------------------------------------------------------------
    def _start_servers(self) -> None:
        spec = self.spec
        self.hosts = Hosts(spec.hosts)
        try:
            self.hosts.create()
        except HostsError as exc:
            raise StackError(f"cannot make {spec.hosts} namespace hosts: {exc}") from exc
        for h in self.hosts.hosts:
            self._log(f"host {h.index}: namespace {h.netns}, address {h.address}")
        try:
            self.nats = start_nats_cluster(self.hosts, spec.data_dir / "nats-cluster", spec.log_dir)
            self.servers["nats"] = ServerHandle("nats", self.nats.url, None)
            self._log(f"started a 3-node JetStream cluster at {self.nats.url}")
            self._provision_cluster()
            self.redis = start_redis_failover(self.hosts, spec.data_dir / "redis-failover", spec.log_dir)
        except RuntimeError as exc:
            raise StackError(str(exc)) from exc
        self.servers["redis"] = ServerHandle("redis", self.redis.url, None)
        self._log(f"started Redis (primary on host 0, replica on host 1) and 3 Sentinels: {self.redis.url}")
        if spec.learner_ranks > 1:
            try:
                self.ray = start_ray_cluster(self.hosts, spec.learner_ranks, spec.log_dir)
            except RayClusterError as exc:
                raise StackError(str(exc)) from exc
            self._log(
                f"started a Ray cluster at {self.ray.address}: head on host 0, workers on hosts "
                f"1-{spec.learner_ranks - 1}, rank r on node r ({RANK_RESOURCE})"
            )

    def _provision_cluster(self) -> None:
        """Create every stream with 3 replicas, retried while the cluster forms."""
        from slipstream.bus.provision import provision

        assert self.nats is not None
        bus = self.admin_bus(type="nats", stream_replicas=3)
        deadline = time.monotonic() + PROVISION_TIMEOUT_S
        while True:
            self._check_interrupt()
            with concurrent.futures.ThreadPoolExecutor(1) as pool:  # start() may run inside an event loop
                try:
                    pool.submit(asyncio.run, provision(bus)).result()
                    break
                except Exception as exc:
                    if time.monotonic() > deadline:
                        raise StackError(f"cannot create the replicated streams on {self.nats.url}: {exc}") from exc
            time.sleep(0.5)
        self._log("provisioned the streams with 3 replicas")

    def host_of(self, name: str) -> Host:
        """The host service `name` runs on."""
        if self.hosts is None or not self.hosts.hosts:
            raise StackError("the hosts are not made yet (or already removed)")
        return self.hosts[self.placed[name]]

    def service_host(self, name: str) -> str:
        return self.host_of(name).address

    def service_argv(self, name: str) -> list[str]:
        return self.host_of(name).exec_argv(super().service_argv(name))

    def service_env(self, name: str, port: int) -> dict[str, str]:
        env = super().service_env(name, port)
        env.update({k: v for k, v in CLUSTER_BUS_ENV.items() if k not in self.spec.env})
        if self.ray is not None and kind_of(name) == "learner":
            env.update(self.ray.client_env)
            env["SLIPSTREAM_LEARNER__RAY_ADDRESS"] = self.ray.address
            env["SLIPSTREAM_LEARNER__RANK_RESOURCE"] = RANK_RESOURCE
            # A node lost takes its rank with it: the restarted learner waits this long for the node's return.
            env.setdefault("SLIPSTREAM_LEARNER__RANK_START_TIMEOUT_S", "300")
        return env

    def admin_bus(self, **kw: Any) -> BusConfig:
        return BusConfig(url=self.servers["nats"].url, **{**CLUSTER_CLIENT, **kw})

    def service_bus(self, service: str, **kw: Any) -> BusConfig:
        return self.admin_bus(**kw)

    def restart_server(self, name: str, *, empty: bool = False) -> float:
        raise StackError(f"restart:{name} is a single-host fault; on hosts the cluster's own faults apply")

    # -- reading it -------------------------------------------------------------------------------
    def where(self) -> list[dict[str, Any]]:
        """One row per process: its name, host index, namespace, address, and pid."""
        rows: list[dict[str, Any]] = []
        if self.hosts is None:
            return rows
        for proc_map in (self.nats.procs if self.nats else {}, self.redis.procs if self.redis else {}):
            for key, proc in proc_map.items():
                name = f"nats-{key}" if isinstance(key, int) else str(key)
                host = self._host_by_netns(proc.argv[3] if len(proc.argv) > 3 else "")
                rows.append(self._row(name, host, proc.pid))
        if self.ray is not None:
            for i, proc in self.ray.procs.items():
                rows.append(self._row("ray-head" if i == 0 else f"ray-worker-{i}", self.ray.nodes[i], proc.pid))
        for name, svc in self.services.items():
            rows.append(self._row(name, self.host_of(name), svc.pid, svc.port))
        return rows

    def _host_by_netns(self, netns: str) -> Host | None:
        assert self.hosts is not None
        return next((h for h in self.hosts.hosts if h.netns == netns), None)

    @staticmethod
    def _row(name: str, host: Host | None, pid: int, port: int | None = None) -> dict[str, Any]:
        return {
            "name": name,
            "host": host.index if host else None,
            "netns": host.netns if host else "",
            "address": f"{host.address}:{port}" if host and port else (host.address if host else ""),
            "pid": pid,
        }

    # -- stop -------------------------------------------------------------------------------------
    def stop(self) -> dict[str, int | None]:
        """The services (Stack.stop), then `on_services_stopped`, then every server and the hosts themselves."""
        if self.state == "stopped":
            return self.exit_codes
        codes = super().stop()
        for fn in self.on_services_stopped:
            try:
                fn(self)
            except Exception as exc:  # the hosts must go whatever a reader did
                self._log(f"after the services stopped: {fn!r} failed: {exc!r}")
        if self.ray is not None:
            self.ray.stop()
            self._log("stopped the Ray cluster")
        if self.hosts is not None:
            self.hosts.close()
            self._log("removed the hosts (namespaces, links, bridge)")
        return codes


def open_stack(spec: StackSpec, **kw: Any) -> Stack:
    """A `HostsStack` when `spec.hosts` is set, else the plain loopback `Stack`."""
    return HostsStack(spec, **kw) if spec.hosts else Stack(spec, **kw)
