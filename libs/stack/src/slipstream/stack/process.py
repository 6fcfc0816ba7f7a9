"""Child processes we own: started with a log file, tracked by PID, stopped by PID.

Nothing here kills by name. Each child gets its own session (process group) so stopping it also
stops anything it spawned, and `ProcessGroup` stops its children in reverse start order.
"""

from __future__ import annotations

import ctypes
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

# Ports handed out by this process: two calls never return the same one, even once both are closed.
_GIVEN: set[int] = set()
_PORT_FLOOR = 20000


def _ephemeral_floor() -> int:
    """The lowest port the kernel gives outgoing connections (Linux's default is 32768)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def port_bindable(host: str, port: int) -> bool:
    """Whether a server could bind `port` now (nothing listens there, no connection holds it).

    With SO_REUSEADDR, as servers set it (asyncio's among them): a closed connection lingering in
    TIME_WAIT does not count, a live one or a listener does.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def free_port(host: str = "127.0.0.1") -> int:
    """A port that was free a moment ago, for a server about to start.

    Drawn below the kernel's ephemeral range where it can be: a port taken from that range (bind to
    0) can be handed to a client's outgoing connection (a service's NATS link, say) in the seconds
    before the server binds it, and a long-lived connection then keeps the server out for good.
    Random (from the OS, not `random`, which tests seed) and tried with a bind, so parallel runs
    rarely meet and never share one that is bound.
    """
    ceiling = _ephemeral_floor()
    draw = secrets.SystemRandom()
    if ceiling - _PORT_FLOOR >= 1000:
        for _ in range(64):
            port = draw.randrange(_PORT_FLOOR, ceiling)
            if port in _GIVEN or not port_bindable(host, port):
                continue
            _GIVEN.add(port)
            return port
    while True:  # no room below the ephemeral range: the kernel's choice, as before
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind((host, 0))
            port = int(s.getsockname()[1])
        if port not in _GIVEN:
            _GIVEN.add(port)
            return port


def wait_port(host: str, port: int, timeout_s: float, proc: subprocess.Popen[bytes] | None = None) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"process {proc.args!r} exited with {proc.returncode} before listening on {port}")
        try:
            with socket.create_connection((host, port), timeout=0.2):
                return
        except OSError:
            time.sleep(0.05)
    raise TimeoutError(f"nothing listening on {host}:{port} after {timeout_s:.0f}s")


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A zombie still answers kill(0); treat it as gone if /proc says so.
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().split(") ", 1)[1][:1] != "Z"
    except OSError:
        return False


_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:  # pragma: no cover - runs in the forked child
    """Ask the kernel to SIGTERM this child when the process that started it dies (even by SIGKILL).

    Without it a SIGKILLed `slipstream up` would leave servers and services running.
    """
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)


class ManagedProcess:
    """One child process with a name, a log file and a PID."""

    def __init__(
        self,
        name: str,
        argv: Sequence[str],
        log_path: Path,
        env: Mapping[str, str] | None = None,
        cwd: str | Path | None = None,
        die_with_parent: bool = True,
    ) -> None:
        self.name = name
        self.argv = list(argv)
        self.log_path = log_path
        log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = log_path.open("ab")
        self.proc: subprocess.Popen[bytes] = subprocess.Popen(
            self.argv,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=dict(env) if env is not None else None,
            cwd=cwd,
            start_new_session=True,
            preexec_fn=_die_with_parent if die_with_parent and sys.platform == "linux" else None,
        )

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None

    def send(self, sig: int) -> None:
        if self.alive():
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                pass

    def stop(self, timeout_s: float = 10.0, sig: int = signal.SIGTERM) -> int | None:
        """SIGTERM (or `sig`), wait, then SIGKILL the whole group. Returns the exit code."""
        self.send(sig)
        try:
            self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.send(signal.SIGKILL)
            self.proc.wait(timeout=5)
        else:
            # Reap stragglers the child left in its group.
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        self._log.close()
        return self.proc.returncode

    def tail(self, n: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""


class ProcessGroup:
    """Children stopped together, last started first."""

    def __init__(self) -> None:
        self.procs: list[ManagedProcess] = []
        self._cleanups: list[Callable[[], None]] = []

    def add(self, proc: ManagedProcess) -> ManagedProcess:
        self.procs.append(proc)
        return proc

    def on_stop(self, fn: Callable[[], None]) -> None:
        self._cleanups.append(fn)

    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def stop(self, timeout_s: float = 10.0) -> None:
        for p in reversed(self.procs):
            p.stop(timeout_s)
        for fn in reversed(self._cleanups):
            fn()
        self._cleanups.clear()
