"""Replicated servers across the hosts of `hosts.Hosts`: a JetStream cluster, Redis with a replica and Sentinel.

- `start_nats_cluster(hosts, ...)`: one nats-server per host, JetStream on, each routing to the
  others (cluster `slipstream`); clients get every node's URL (`NatsCluster.url`, comma-separated,
  what `[bus] url` takes) and streams are created with `[bus] stream_replicas` copies.
- `start_redis_failover(hosts, ...)`: a Redis primary on the first host, one replica on the
  second, and a Sentinel on each of the first three (quorum 2) watching them under the name
  `slipstream`; clients take `RedisFailover.url`, a `redis+sentinel://` URL that
  `slipstream.control` resolves to whichever node Sentinel says is the primary.

Every server is the same binary the single-host stack runs (`servers.nats_server_binary`,
`servers.redis_server_binary`), listens only on its host's address (ports below are inside the
namespaces, never the machine's standard ones), and is stopped by PID: by the caller for a fault,
by `Hosts.close()` otherwise. `restart(i)` starts a stopped node again on the same host and port.
"""

from __future__ import annotations

import signal
from dataclasses import dataclass, field
from pathlib import Path

from slipstream.stack.hosts import Host, Hosts
from slipstream.stack.process import ManagedProcess, wait_port
from slipstream.stack.servers import nats_server_binary, private_file, redis_server_binary

NATS_PORT = 24222
ROUTE_PORT = 26222
REDIS_PORT = 26379
SENTINEL_PORT = 26380
SERVICE = "slipstream"
"""The name Sentinel knows the Redis primary by."""
START_TIMEOUT_S = 20.0


def _started(proc: ManagedProcess, host: Host, port: int, what: str) -> None:
    try:
        wait_port(host.address, port, START_TIMEOUT_S, proc.proc)
    except Exception:
        proc.stop(2)
        raise RuntimeError(f"{what} on {host.netns} ({host.address}:{port}) did not start:\n{proc.tail()}") from None


@dataclass
class NatsCluster:
    """The nodes of one JetStream cluster, by host index."""

    hosts: Hosts
    nodes: list[Host]
    data_dir: Path
    log_dir: Path
    authorization: str = ""
    procs: dict[int, ManagedProcess] = field(default_factory=dict)

    @property
    def urls(self) -> list[str]:
        return [f"nats://{h.address}:{NATS_PORT}" for h in self.nodes]

    @property
    def url(self) -> str:
        """Every node, comma-separated: `[bus] url`."""
        return ",".join(self.urls)

    def start(self, i: int) -> ManagedProcess:
        """Start node `i` (its store kept across restarts) and wait until it listens."""
        host = self.nodes[i]
        routes = ", ".join(f"nats-route://{h.address}:{ROUTE_PORT}" for h in self.nodes if h is not host)
        node_dir = self.data_dir / f"nats-{i}"
        node_dir.mkdir(parents=True, exist_ok=True)
        conf = node_dir / "nats.conf"
        text = (
            f"server_name: n{i}\n"
            f"listen: {host.address}:{NATS_PORT}\n"
            "max_payload: 1048576\n"
            "max_pending: 268435456\n"
            f'jetstream {{ store_dir: "{node_dir / "js"}" }}\n'
        )
        if len(self.nodes) > 1:  # one node alone is a plain server, the single-host baseline
            text += f"cluster {{\n  name: {SERVICE}\n  listen: {host.address}:{ROUTE_PORT}\n  routes: [{routes}]\n}}\n"
        private_file(conf, text + self.authorization)
        proc = self.hosts.start(
            host, f"nats-{i}", [nats_server_binary(), "-c", str(conf)], self.log_dir / f"nats-{i}.log"
        )
        _started(proc, host, NATS_PORT, f"nats-server n{i}")
        self.procs[i] = proc
        return proc

    def stop(self, i: int, *, kill: bool = True) -> None:
        """Stop node `i` by PID: SIGKILL (a crash) by default, else SIGTERM (a clean stop)."""
        proc = self.procs.pop(i)
        proc.stop(5.0, sig=signal.SIGKILL if kill else signal.SIGTERM)

    def index_of(self, server_name: str) -> int:
        """The node index of a server name as JetStream reports it (`n2` -> 2)."""
        if not server_name.startswith("n") or not server_name[1:].isdigit():
            raise ValueError(f"not a node of this cluster: {server_name!r}")
        return int(server_name[1:])


def start_nats_cluster(
    hosts: Hosts, data_dir: Path, log_dir: Path, *, nodes: int = 3, authorization: str = ""
) -> NatsCluster:
    """A JetStream cluster of `nodes` servers on the first `nodes` hosts (see the module docstring)."""
    if len(hosts) < nodes:
        raise ValueError(f"a {nodes}-node cluster needs {nodes} hosts, got {len(hosts)}")
    cluster = NatsCluster(hosts, hosts.hosts[:nodes], data_dir, log_dir, authorization)
    for i in range(nodes):
        cluster.start(i)
    return cluster


@dataclass
class RedisFailover:
    """A primary, its replica and three Sentinels; `primary`/`replica` are host indices at start."""

    hosts: Hosts
    data_dir: Path
    log_dir: Path
    primary: int = 0
    replica: int = 1
    sentinel_hosts: tuple[int, ...] = (0, 1, 2)
    down_after_ms: int = 1000
    procs: dict[str, ManagedProcess] = field(default_factory=dict)

    @property
    def url(self) -> str:
        """`redis+sentinel://<every sentinel>/<service>/0`: `[service] redis_url` of every service."""
        where = ",".join(f"{self.hosts[i].address}:{SENTINEL_PORT}" for i in self.sentinel_hosts)
        return f"redis+sentinel://{where}/{SERVICE}/0"

    def address(self, i: int) -> tuple[str, int]:
        return self.hosts[i].address, REDIS_PORT

    def start_redis(self, i: int, *, replica_of: int | None = None) -> ManagedProcess:
        host = self.hosts[i]
        node_dir = self.data_dir / f"redis-{i}"
        node_dir.mkdir(parents=True, exist_ok=True)
        argv = [
            redis_server_binary(),
            "--bind", host.address,
            "--port", str(REDIS_PORT),
            "--save", "",
            "--appendonly", "no",
            "--dir", str(node_dir),
            "--protected-mode", "no",
        ]  # fmt: skip
        if replica_of is not None:
            argv += ["--replicaof", self.hosts[replica_of].address, str(REDIS_PORT)]
        proc = self.hosts.start(host, f"redis-{i}", argv, self.log_dir / f"redis-{i}.log")
        _started(proc, host, REDIS_PORT, "redis-server")
        self.procs[f"redis-{i}"] = proc
        return proc

    def start_sentinel(self, i: int) -> ManagedProcess:
        host = self.hosts[i]
        node_dir = self.data_dir / f"sentinel-{i}"
        node_dir.mkdir(parents=True, exist_ok=True)
        conf = node_dir / "sentinel.conf"  # Sentinel rewrites it with what it learns
        primary, port = self.address(self.primary)
        conf.write_text(
            f"bind {host.address}\n"
            f"port {SENTINEL_PORT}\n"
            "protected-mode no\n"
            f"dir {node_dir}\n"
            f"sentinel monitor {SERVICE} {primary} {port} 2\n"
            f"sentinel down-after-milliseconds {SERVICE} {self.down_after_ms}\n"
            f"sentinel failover-timeout {SERVICE} {max(3 * self.down_after_ms, 3000)}\n"
            f"sentinel parallel-syncs {SERVICE} 1\n"
        )
        argv = [redis_server_binary(), str(conf), "--sentinel"]
        proc = self.hosts.start(host, f"sentinel-{i}", argv, self.log_dir / f"sentinel-{i}.log")
        _started(proc, host, SENTINEL_PORT, "redis sentinel")
        self.procs[f"sentinel-{i}"] = proc
        return proc

    def kill(self, name: str) -> None:
        """SIGKILL one of this set's processes (`redis-0`, `sentinel-2`) by PID."""
        self.procs.pop(name).stop(5.0, sig=signal.SIGKILL)

    async def sentinel_primary(self) -> str:
        """The primary's address as the first Sentinel that answers reports it ("" if none does)."""
        import redis.asyncio as aioredis

        for i in self.sentinel_hosts:
            s = aioredis.Redis(
                host=self.hosts[i].address, port=SENTINEL_PORT, socket_timeout=1.0, decode_responses=True
            )
            try:
                addr = await s.execute_command("SENTINEL", "GET-MASTER-ADDR-BY-NAME", SERVICE)
                return str(addr[0])
            except (OSError, aioredis.RedisError):
                continue
            finally:
                await s.aclose()
        return ""

    async def replica_online(self, primary: str) -> bool:
        """The primary at address `primary` reports a replica connected and in sync."""
        import redis.asyncio as aioredis

        r = aioredis.Redis(host=primary, port=REDIS_PORT, socket_timeout=1.0, decode_responses=True)
        try:
            info = await r.info("replication")
        except (OSError, aioredis.RedisError):
            return False
        finally:
            await r.aclose()
        replica = info.get("slave0")
        return (
            int(info.get("connected_slaves", 0)) >= 1 and isinstance(replica, dict) and replica.get("state") == "online"
        )


def start_redis_failover(hosts: Hosts, data_dir: Path, log_dir: Path, *, down_after_ms: int = 1000) -> RedisFailover:
    """Primary on host 0, replica on host 1, Sentinels on hosts 0-2 (see the module docstring)."""
    if len(hosts) < 3:
        raise ValueError(f"Redis with Sentinel needs 3 hosts (a quorum of 2 of 3 sentinels), got {len(hosts)}")
    rf = RedisFailover(hosts, data_dir, log_dir, down_after_ms=down_after_ms)
    rf.start_redis(0)
    rf.start_redis(1, replica_of=0)
    for i in rf.sentinel_hosts:
        rf.start_sentinel(i)
    return rf
