"""Several hosts on one machine: network namespaces joined by veth pairs to one bridge.

`Hosts(n)` creates, as root with iproute2, `n` network namespaces, each with one interface
(`eth0`) and its own address on a private /24, all plugged into a bridge. The bridge also gets an
address in the machine's own namespace, so the process that built the hosts (a test, `slipstream
up --hosts N`) reaches every server on them, and nothing of theirs listens on the machine's
loopback. Every name carries a random tag, so two runs never meet, and the subnet is one no
route of the machine uses yet.

    with Hosts(3) as hosts:
        proc = hosts.start(hosts[0], "nats-0", ["nats-server", "-c", conf], log_path)
        hosts.cut(hosts[1])        # its link goes down: a partition
        hosts.heal(hosts[1])

Processes started on a host (`ip netns exec`, which execs the command itself, so the PID is the
server's) are stopped by PID on close, and any process still in a namespace then (one a server
forked into a process group of its own) is SIGKILLed, before the namespaces, veths and bridge are deleted;
close runs on any exit of the `with` block, and a half-made set of hosts is removed as well.
`unavailable()` says why namespaces cannot be made here (not root, no `ip`, no permission), for
a test to skip with that reason.
"""

from __future__ import annotations

import ipaddress
import os
import secrets
import shutil
import signal
import subprocess
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

from slipstream.stack.process import ManagedProcess

MAX_HOSTS = 200
_PROBE_TIMEOUT_S = 10.0


class HostsError(RuntimeError):
    """An `ip` command failed; the message names the command and what it printed."""


@dataclass(frozen=True)
class Host:
    """One namespace: its name, its address on the hosts' subnet, the root-side end of its link."""

    index: int
    netns: str
    address: str
    link: str

    def exec_argv(self, argv: Sequence[str]) -> list[str]:
        """`argv` run inside this host's namespace."""
        return ["ip", "netns", "exec", self.netns, *argv]


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=_PROBE_TIMEOUT_S, check=False)
    if check and done.returncode != 0:
        raise HostsError(
            f"ip {' '.join(args)} failed ({done.returncode}): {done.stderr.strip() or done.stdout.strip()}"
        )
    return done


def unavailable() -> str:
    """Why namespaces cannot be made here ("" when they can): probed by making and deleting one."""
    if os.name != "posix" or not Path("/proc/self/ns/net").exists():
        return "no Linux network namespaces on this system"
    if os.geteuid() != 0:
        return f"network namespaces need root (running as uid {os.geteuid()})"
    if shutil.which("ip") is None:
        return "iproute2's `ip` is not on PATH"
    probe = f"ssprobe{secrets.token_hex(3)}"
    try:
        made = _ip("netns", "add", probe, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"`ip netns add` could not run: {exc}"
    if made.returncode != 0:
        return f"`ip netns add` is refused here: {made.stderr.strip()}"
    _ip("netns", "del", probe, check=False)
    return ""


def _used_networks() -> list[ipaddress.IPv4Network]:
    out = []
    for line in _ip("-4", "route", "show", "table", "all").stdout.splitlines():
        word = line.split()[0] if line.split() else ""
        if word in ("local", "broadcast", "unreachable", "prohibit", "blackhole"):
            word = line.split()[1]
        try:
            out.append(ipaddress.IPv4Network(word, strict=False))
        except ValueError:
            continue  # 'default' and the like
    return out


def free_subnet() -> ipaddress.IPv4Network:
    """A /24 in 10.200.0.0/13 that no route of this machine overlaps."""
    used = _used_networks()
    pool = list(ipaddress.IPv4Network("10.200.0.0/13").subnets(new_prefix=24))
    draw = secrets.SystemRandom()
    for net in draw.sample(pool, len(pool)):
        if not any(net.overlaps(u) for u in used if u.prefixlen > 0):
            return net
    raise HostsError("no free /24 left in 10.200.0.0/13 for the hosts' subnet")


def netns_pids(netns: str) -> list[int]:
    """The PIDs of every process in namespace `netns` now (`ip netns pids`)."""
    return [int(p) for p in _ip("netns", "pids", netns, check=False).stdout.split() if p.isdigit()]


def kill_remaining(netns: str) -> list[int]:
    """SIGKILL every process still in namespace `netns` (by the PIDs `ip netns pids` lists); returns them.

    What a started process spawned in a new process group of its own (Ray's workers) outlives the
    stop of its group; a namespace host that goes away takes all its processes with it."""
    pids = netns_pids(netns)
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return pids


class Hosts:
    """`n` namespaces on one bridge; see the module docstring. Use as a context manager."""

    def __init__(self, n: int, *, tag: str | None = None) -> None:
        if not 1 <= n <= MAX_HOSTS:
            raise ValueError(f"hosts: n must be in [1, {MAX_HOSTS}], got {n}")
        self.n = n
        self.tag = tag or secrets.token_hex(3)
        if not (self.tag.isalnum() and len(self.tag) <= 6):
            raise ValueError(f"hosts: tag must be at most 6 letters or digits, got {self.tag!r}")
        self.bridge = f"ssbr{self.tag}"
        self.hosts: list[Host] = []
        self.subnet: ipaddress.IPv4Network | None = None
        self.gateway = ""
        self.procs: list[ManagedProcess] = []
        self._made_bridge = False
        self._netns: list[str] = []
        self._cut: set[str] = set()

    # -- life ----------------------------------------------------------------------------------
    def __enter__(self) -> Hosts:
        try:
            self.create()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def create(self) -> None:
        """Make the bridge, then each namespace with its veth pair and address (see the module docstring)."""
        subnet = self.subnet = free_subnet()
        addrs = list(subnet.hosts())
        self.gateway = str(addrs[-1])
        _ip("link", "add", self.bridge, "type", "bridge")
        self._made_bridge = True
        _ip("addr", "add", f"{self.gateway}/{subnet.prefixlen}", "dev", self.bridge)
        _ip("link", "set", self.bridge, "up")
        for i in range(self.n):
            netns, link = f"ss{self.tag}h{i}", f"ss{self.tag}v{i}"
            _ip("netns", "add", netns)
            self._netns.append(netns)
            _ip("link", "add", link, "type", "veth", "peer", "name", "eth0", "netns", netns)
            _ip("link", "set", link, "master", self.bridge)
            _ip("link", "set", link, "up")
            address = str(addrs[i])
            _ip("-n", netns, "addr", "add", f"{address}/{subnet.prefixlen}", "dev", "eth0")
            _ip("-n", netns, "link", "set", "lo", "up")
            _ip("-n", netns, "link", "set", "eth0", "up")
            self.hosts.append(Host(i, netns, address, link))

    def close(self) -> None:
        """Stop every process started here (by PID), SIGKILL any other left in the namespaces, then delete
        the namespaces, their links and the bridge."""
        for proc in reversed(self.procs):
            proc.stop(5.0)
        self.procs.clear()
        for netns in reversed(self._netns):
            kill_remaining(netns)
            # The veth pair first (both ends go): a deleted namespace frees its links only later.
            _ip("link", "del", f"ss{self.tag}v{netns.rsplit('h', 1)[1]}", check=False)
            _ip("netns", "del", netns, check=False)
        self._netns.clear()
        if self._made_bridge:
            _ip("link", "del", self.bridge, check=False)
            self._made_bridge = False
        self.hosts.clear()

    # -- use -----------------------------------------------------------------------------------
    def __getitem__(self, i: int) -> Host:
        return self.hosts[i]

    def __len__(self) -> int:
        return len(self.hosts)

    def start(
        self,
        host: Host,
        name: str,
        argv: Sequence[str],
        log_path: Path,
        env: Mapping[str, str] | None = None,
    ) -> ManagedProcess:
        """Run `argv` on `host`; stopped by PID on close (or earlier by the caller)."""
        proc = ManagedProcess(name, host.exec_argv(argv), log_path, env=env)
        self.procs.append(proc)
        return proc

    def cut(self, host: Host) -> None:
        """Take `host`'s link down: nothing reaches it and it reaches nothing, its processes run on."""
        _ip("link", "set", host.link, "down")
        self._cut.add(host.netns)

    def heal(self, host: Host) -> None:
        """Bring a cut link back up."""
        _ip("link", "set", host.link, "up")
        self._cut.discard(host.netns)

    def is_cut(self, host: Host) -> bool:
        return host.netns in self._cut

    def names(self) -> list[str]:
        """The namespaces that exist now with this run's tag (what close must leave empty)."""
        listed = _ip("netns", "list", check=False).stdout.split()
        return sorted(n for n in listed if n.startswith(f"ss{self.tag}h"))

    def links(self) -> list[str]:
        """The root-side links with this run's tag (bridge and veths) that exist now."""
        shown = _ip("-o", "link", "show", check=False).stdout.splitlines()
        found = [line.split(":")[1].strip().split("@")[0] for line in shown if ":" in line]
        return sorted(n for n in found if n.startswith(f"ss{self.tag}") or n == self.bridge)
