"""Per-command cgroups (v1 memory and pids controllers), nested under our own.

rlimits cannot bound a process *tree*: RLIMIT_AS is per process and RLIMIT_NPROC is not enforced
for root, which the sandbox runs as. A cgroup can: every process the command starts is born
inside it, the memory controller OOM-kills the tree past `memory.limit_in_bytes`, the pids
controller refuses forks past `pids.max`, and `cgroup.procs` lists every process left to kill.
Each command gets fresh groups, created beside nothing else of ours, under the groups this
process already sits in (a container's or a VM agent's), never moved out of them.

These machines have cgroup v1 with both controllers writable by root; where they are not
(`available()` is False), the provider refuses memory and process limits with a clear error
rather than pretend to enforce them.
"""

from __future__ import annotations

import os
import signal
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

ROOT = Path("/sys/fs/cgroup")


def _own_path(controller: str) -> Path | None:
    """The v1 group of this process for `controller`, or None when that hierarchy is not mounted."""
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controller in controllers.split(","):
            base = ROOT / controller
            return base / path.lstrip("/") if base.is_dir() else None
    return None


def available() -> str | None:
    """None when per-command memory and pids groups can be made here, else why not."""
    for controller in ("memory", "pids"):
        own = _own_path(controller)
        if own is None:
            return f"the cgroup v1 {controller} controller is not mounted under {ROOT}"
        if not os.access(own, os.W_OK):
            return f"cannot create groups under {own} (not writable)"
    return None


@dataclass
class CommandGroup:
    """The memory and pids groups of one command: create, join (by path), read what happened, remove."""

    memory: Path
    pids: Path

    @classmethod
    def create(cls, memory_mb: int, processes: int) -> CommandGroup:
        name = f"slipstream-sbx-{uuid.uuid4().hex[:12]}"
        mem_own, pids_own = _own_path("memory"), _own_path("pids")
        if mem_own is None or pids_own is None:
            raise RuntimeError(available() or "cgroup v1 memory/pids controllers are not available")
        group = cls(memory=mem_own / name, pids=pids_own / name)
        group.memory.mkdir()
        try:
            group.pids.mkdir()
            limit = str(memory_mb * 1024 * 1024)
            (group.memory / "memory.limit_in_bytes").write_text(limit)
            memsw = group.memory / "memory.memsw.limit_in_bytes"
            if memsw.exists():  # with swap, the tree would page out instead of being stopped
                memsw.write_text(limit)
            (group.pids / "pids.max").write_text(str(processes))
        except BaseException:
            group.remove()
            raise
        return group

    @property
    def procs_files(self) -> tuple[str, str]:
        """What a launcher writes its own pid to, before it execs the command, to put the tree inside."""
        return str(self.memory / "cgroup.procs"), str(self.pids / "cgroup.procs")

    def oom_kills(self) -> int:
        for line in (self.memory / "memory.oom_control").read_text().splitlines():
            key, _, value = line.partition(" ")
            if key == "oom_kill":
                return int(value)
        # Kernels before 4.13 have no oom_kill line: a hit limit is the nearest sign.
        return int((self.memory / "memory.failcnt").read_text())

    def forks_refused(self) -> int:
        for line in (self.pids / "pids.events").read_text().splitlines():
            key, _, value = line.partition(" ")
            if key == "max":
                return int(value)
        return 0

    def peak_memory_mb(self) -> float:
        return int((self.memory / "memory.max_usage_in_bytes").read_text()) / 2**20

    def pids_left(self) -> list[int]:
        try:
            return [int(p) for p in (self.pids / "cgroup.procs").read_text().split()]
        except OSError:
            return []

    def kill_all(self, timeout_s: float = 5.0) -> None:
        """SIGKILL every process left in the group, until none is (a fork bomb keeps forking meanwhile)."""
        deadline = time.monotonic() + timeout_s
        while (left := self.pids_left()) and time.monotonic() < deadline:
            for pid in left:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            time.sleep(0.005)

    def remove(self) -> None:
        self.kill_all()
        for path in (self.memory, self.pids):
            for _ in range(200):  # rmdir fails with EBUSY until the last killed process is reaped
                try:
                    path.rmdir()
                    break
                except FileNotFoundError:
                    break
                except OSError:
                    time.sleep(0.01)
