"""A Ray cluster across the hosts of `hosts.Hosts`: the head on one host, a worker node on each other one.

`start_ray_cluster(hosts, ranks, ...)` runs `ray start --head` on the first host and `ray start
--address=<head>:<port>` on the next `ranks - 1`, each inside its namespace (`ip netns exec`) with
`--node-ip-address` its host's address, so every node is reached only over the bridge. Node r
advertises one unit of `slipstream-rank-<r>` (`RANK_RESOURCE`): a learner given `[learner]
ray_address = RayCluster.address` and `rank_resource = RANK_RESOURCE` places rank r on node r (its
placement group's bundle r asks for that resource), so its ranks run on different hosts.

Every node is kept small for a shared machine: one CPU (one rank), an 80 MiB object store (Ray's
floor is 75), no dashboard, no usage stats. Its processes (`ray start --block`, GCS, raylet, agents,
and the workers the raylet forks, each in its own process group) share one session, the session of
the `ray start` this module started; `kill(i)` SIGKILLs every process of host i's namespace in that
session (a Ray node lost with its host: its rank actor dies with it), `start(i)` brings the node back
on the same host and ports. `stop()` stops every node; `Hosts.close()` removes whatever is left in
the namespaces anyway. The session files (sockets, logs) live in a temp dir of this cluster's own,
removed by `stop()`, never in the machine's shared /tmp/ray.

The cluster authenticates with a token of its own (`client_env`: RAY_AUTH_MODE=token and the
token, for every node and for the driver): Ray turns token auth on for any new head once a token
file exists in ~/.ray (a local `ray.init` writes one), and a worker node joining such a head
without the token is refused ("InvalidAuthToken"); a fixed mode and token keep the cluster
independent of what else ran on the machine.

The driver (the learner) must run on a host with a Ray node (Ray drivers attach to their own
node's raylet): on the head's host, as `multihost.placement` puts it.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from slipstream.stack.hosts import Host, Hosts, netns_pids
from slipstream.stack.process import ManagedProcess, pid_alive, wait_port

GCS_PORT = 26390
"""The head's GCS port, inside its namespace (Ray's default is Redis's 6379)."""
NODE_MANAGER_PORT = 26391
OBJECT_MANAGER_PORT = 26392
WORKER_PORTS = (26400, 26499)
RANK_RESOURCE = "slipstream-rank-{rank}"
"""`[learner] rank_resource`: node r advertises one unit of it formatted with r."""
OBJECT_STORE_BYTES = 80 * 1024 * 1024
START_TIMEOUT_S = 120.0
"""How long `ray start` may take until the node's raylet listens (a few seconds idle; tens on 2 loaded cores)."""


class RayClusterError(RuntimeError):
    """A Ray node did not start; the message names the host and ends with its log."""


def ray_binary() -> str:
    """The `ray` command of this interpreter's environment (the one the learner imports)."""
    path = Path(sys.executable).parent / "ray"
    if not path.exists():
        found = shutil.which("ray")
        if found is None:
            raise RayClusterError(f"no `ray` command next to {sys.executable} nor on PATH: is Ray installed?")
        return found
    return str(path)


def ray_unavailable() -> str:
    """Why a Ray cluster cannot start here ("" when it can): Ray not importable or no `ray` command."""
    try:
        import ray  # noqa: F401
    except ImportError as exc:
        return f"Ray is not installed ({exc})"
    try:
        ray_binary()
    except RayClusterError as exc:
        return str(exc)
    return ""


def _session_of(pid: int) -> int | None:
    try:
        return os.getsid(pid)
    except (ProcessLookupError, PermissionError):
        return None


@dataclass
class RayCluster:
    """The nodes of one Ray cluster, node r on `nodes[r]`; node 0 is the head (see the module docstring)."""

    hosts: Hosts
    nodes: list[Host]
    log_dir: Path
    temp_dir: Path
    procs: dict[int, ManagedProcess] = field(default_factory=dict)
    sessions: dict[int, int] = field(default_factory=dict)
    """Node index -> the session id of its `ray start` (what `kill` kills), kept after `kill` for `pids`."""
    token: str = field(default_factory=lambda: secrets.token_hex(32), repr=False)

    @property
    def client_env(self) -> dict[str, str]:
        """What every process joining this cluster (its nodes, the learner as driver) needs in its environment."""
        return {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": self.token}

    @property
    def address(self) -> str:
        """`<head address>:<GCS port>`: `[learner] ray_address`."""
        return f"{self.nodes[0].address}:{GCS_PORT}"

    def start(self, i: int) -> ManagedProcess:
        """Start node `i` (the head for 0) on its host and wait until its raylet listens."""
        host = self.nodes[i]
        argv = [
            ray_binary(), "start", "--block",
            "--node-ip-address", host.address,
            "--num-cpus", "1",
            "--resources", json.dumps({RANK_RESOURCE.format(rank=i): 1}),
            "--object-store-memory", str(OBJECT_STORE_BYTES),
            "--node-manager-port", str(NODE_MANAGER_PORT),
            "--object-manager-port", str(OBJECT_MANAGER_PORT),
            "--min-worker-port", str(WORKER_PORTS[0]),
            "--max-worker-port", str(WORKER_PORTS[1]),
            "--temp-dir", str(self.temp_dir),
            "--disable-usage-stats",
        ]  # fmt: skip
        if i == 0:
            argv += ["--head", "--port", str(GCS_PORT), "--include-dashboard", "false"]
        else:
            argv += ["--address", self.address]
        # Ray nices its workers to 15 by default: on 2 shared cores a rank then gets a few % of a core.
        env = {**os.environ, "RAY_worker_niceness": "0", **self.client_env}
        name = "ray-head" if i == 0 else f"ray-worker-{i}"
        proc = self.hosts.start(host, name, argv, self.log_dir / f"{name}.log", env=env)
        self.procs[i] = proc
        self.sessions[i] = proc.pid  # a new session per ManagedProcess: its id is the leader's pid
        try:
            wait_port(host.address, NODE_MANAGER_PORT, START_TIMEOUT_S, proc.proc)
        except Exception:
            self.kill(i)
            raise RayClusterError(
                f"Ray {'head' if i == 0 else 'worker'} node on {host.netns} ({host.address}) did not start:\n"
                + proc.tail()
            ) from None
        return proc

    def pids(self, i: int) -> list[int]:
        """Every live process of node `i`: its host's processes in its `ray start`'s session."""
        sid = self.sessions.get(i)
        if sid is None:
            return []
        return [p for p in netns_pids(self.nodes[i].netns) if _session_of(p) == sid and pid_alive(p)]

    def kill(self, i: int) -> list[int]:
        """SIGKILL every process of node `i` (raylet, agents, workers, rank actors): the node is lost.

        Returns the PIDs killed. Waits (up to 10 s) until none of them is alive."""
        pids = self.pids(i)
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        proc = self.procs.pop(i, None)
        if proc is not None:
            proc.stop(5.0, sig=signal.SIGKILL)
        deadline = time.monotonic() + 10.0
        while any(pid_alive(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.1)
        return pids

    def stop(self) -> None:
        """Stop every node (workers first, then the head) and remove the session files."""
        for i in sorted(self.procs, reverse=True):
            proc = self.procs[i]
            proc.stop(10.0)  # SIGTERM: `ray start --block` stops its node's processes itself
            self.kill(i)  # whatever outlived it (workers in their own process groups)
        shutil.rmtree(self.temp_dir, ignore_errors=True)


def start_ray_cluster(hosts: Hosts, ranks: int, log_dir: Path, *, first: int = 0) -> RayCluster:
    """A head on host `first` and a worker node on each of the next `ranks - 1` hosts (node r for rank r)."""
    if ranks < 1 or first + ranks > len(hosts):
        raise ValueError(f"{ranks} Ray nodes from host {first} need {first + ranks} hosts, there are {len(hosts)}")
    # Short: Ray's unix sockets live under it, and a socket path must stay under 108 bytes.
    temp_dir = Path("/tmp") / f"ssray{hosts.tag}"
    cluster = RayCluster(hosts, hosts.hosts[first : first + ranks], log_dir, temp_dir)
    try:
        for i in range(ranks):
            cluster.start(i)
    except BaseException:
        cluster.stop()
        raise
    return cluster
