"""Every process started beneath the verifiers runner ends with it.

verifiers starts an MCP tool server per episode (`python -m vf_lookup`, under uv), each in a new
session, so neither the runner's process group nor its session holds them; a runner that died
with episodes in flight left them running, re-parented to init (61 after one stack run). So:

- the runner makes itself a child subreaper (`prctl(PR_SET_CHILD_SUBREAPER)`): a process beneath
  it whose parent exits is re-parented to the runner, not to init, so the runner's tree in /proc
  (by parent pid, whatever the session or group) holds every process started beneath it until
  the runner itself is gone; and it asks for SIGTERM when its parent (the worker) dies
  (`PR_SET_PDEATHSIG`), so a worker killed outright still lets it clean up;
- `kill_tree(root)` stops that tree (SIGSTOP: a stopped process cannot fork, re-scanning until
  no new process appears), then kills all of it with SIGKILL, the root last: the runner's own
  end (root = itself, spared), and the worker's fallback when the runner does not exit in time.

Linux only (/proc, prctl): elsewhere the subreaper is not set and the tree is the root alone.
Standard library only: runner.py (in verifiers' venv) and bridge.py (Slipstream's) both import it.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import sys
import time
from pathlib import Path

PR_SET_PDEATHSIG = 1
PR_SET_CHILD_SUBREAPER = 36
LINUX = sys.platform.startswith("linux")
KILL_WAIT_S = 2.0  # kill_tree's wait for the killed to be gone


def _prctl(option: int, value: int) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(option, value, 0, 0, 0) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"prctl({option}, {value}): {os.strerror(err)}")


def hold_descendants(parent_death_signal: int = signal.SIGTERM) -> bool:
    """Make this process the subreaper of everything it starts, signalled when its parent dies.
    False where that is not available (not Linux)."""
    if not LINUX:
        return False
    _prctl(PR_SET_CHILD_SUBREAPER, 1)
    _prctl(PR_SET_PDEATHSIG, int(parent_death_signal))
    return True


def _parents() -> dict[int, int]:
    """Live (not zombie) processes by pid: their parent pid."""
    out: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:  # gone meanwhile
            continue
        # pid (comm) state ppid ...: comm may hold spaces and parentheses, so split after the last ')'.
        state, ppid = stat.rsplit(")", 1)[1].split()[:2]
        if state not in ("Z", "X"):
            out[int(entry.name)] = int(ppid)
    return out


def descendants(root: int) -> list[int]:
    """Live processes beneath `root` (its children, theirs, ...), by parent pid in /proc."""
    if not LINUX:
        return []
    children: dict[int, list[int]] = {}
    for pid, ppid in _parents().items():
        children.setdefault(ppid, []).append(pid)
    out: list[int] = []
    todo = list(children.get(root, []))
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo.extend(children.get(pid, []))
    return out


def _signal(pid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.kill(pid, sig)


def terminate_tree(root: int, grace_s: float) -> None:
    """SIGTERM every process beneath `root` and wait up to `grace_s` for them to exit."""
    for pid in descendants(root):
        _signal(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while descendants(root) and time.monotonic() < deadline:
        time.sleep(0.05)


def kill_tree(root: int, *, include_root: bool) -> list[int]:
    """Freeze then SIGKILL every process beneath `root` (and `root` too when `include_root`,
    stopped first so it cannot start more) and wait until they are gone; returns the pids
    killed beneath it."""
    if include_root:
        _signal(root, signal.SIGSTOP)
    frozen: set[int] = set()
    while fresh := set(descendants(root)) - frozen:
        for pid in fresh:
            _signal(pid, signal.SIGSTOP)
        frozen |= fresh
    for pid in frozen:
        _signal(pid, signal.SIGKILL)
    if include_root:
        _signal(root, signal.SIGKILL)
    # SIGKILL is delivered, not done: wait (briefly) until none of them runs any more.
    deadline = time.monotonic() + KILL_WAIT_S
    while frozen & set(_parents()) and time.monotonic() < deadline:
        time.sleep(0.01)
    return sorted(frozen)
