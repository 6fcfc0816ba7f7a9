"""Sandboxes as a service: a host that keeps sandboxes by session, and a client that drives one.

The sandbox of an episode lives where it was created. `SandboxHost` (run by a tool-service replica,
services/tool-service) keeps each sandbox under the caller's session id, with its own base tree
(the files the caller sent), and answers operations on it: `exec`, `read`, `write`, `snapshot`,
`fork` (a child session on the same host, sharing the frozen layers), `changes`, `close`.
Sessions no call has touched for `idle_ttl_s` are closed by `reap` (a caller that died, a reply
that was lost), so nothing leaks; `aclose` closes them all (a replica's drain).

`RemoteSandbox` is the `Sandbox` interface over any request function (`Caller`): it sends every
operation of its session to the one host that holds it, named by the route `create` returned.
How the request travels is the caller's business (the code env uses the tool-service's NATS
request/reply, one subject per replica for the routed operations). Two kinds of failure stay
apart: what the sandbox says about the *request* (a missing file, a write outside /work) comes
back as the same exception it is in-process (FileNotFoundError, PermissionError, ValueError);
a host that is gone or cannot answer raises `SandboxError`, an infrastructure error that is
never the agent's fault.

Wire format (JSON objects, in and out): requests carry `op`, `session` and the op's arguments;
bytes travel base64 (`data`, `stdin`); replies are the op's result, or `{"error": {"type",
"message"}}` for a request the sandbox refused.
"""

from __future__ import annotations

import asyncio
import base64
import re
import shutil
import time
import uuid
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec

from slipstream.sandbox.bwrap import BwrapProvider, BwrapSandbox
from slipstream.sandbox.limits import ExecResult, Limits
from slipstream.sandbox.provider import SandboxError, Snapshot

# A caller: (operation name, arguments) -> the host's JSON reply. Raises SandboxError when no host answers.
Caller = Callable[[str, dict[str, Any]], Awaitable[dict[str, Any]]]

_SESSION = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.:/#-]{0,199}")
_ERRORS: dict[str, type[Exception]] = {
    "FileNotFoundError": FileNotFoundError,
    "PermissionError": PermissionError,
    "ValueError": ValueError,
    "SandboxError": SandboxError,
}
MAX_FILES_BYTES = 4 * 2**20  # a base tree sent to `create`, at most


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def _unb64(text: str) -> bytes:
    try:
        return base64.b64decode(text.encode(), validate=True)
    except ValueError as exc:  # binascii.Error
        raise ValueError(f"not valid base64: {exc}") from None


# ------------------------------------------------------------------------------------------- host


@dataclass
class _Family:
    """A base tree and the provider whose layers its sessions (a sandbox and its forks) share."""

    root: Path
    provider: BwrapProvider
    sessions: set[str] = field(default_factory=set)


@dataclass
class _Session:
    sandbox: BwrapSandbox
    family: _Family
    last_used: float
    snapshots: dict[str, Snapshot] = field(default_factory=dict)


class SandboxHost:
    """Sandboxes by session id, each built from the files its creator sent; see the module docstring."""

    def __init__(
        self,
        root: Path,
        *,
        idle_ttl_s: float = 600.0,
        max_sessions: int = 256,
        max_limits: Limits | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if idle_ttl_s <= 0 or max_sessions < 1:
            raise ValueError(f"need idle_ttl_s > 0 and max_sessions >= 1, got {idle_ttl_s}, {max_sessions}")
        self.root = Path(root)
        # A previous process's sandboxes (a crash, a SIGKILL) are nobody's now: start clean.
        shutil.rmtree(self.root, ignore_errors=True)
        self.root.mkdir(parents=True)
        self.idle_ttl_s = idle_ttl_s
        self.max_sessions = max_sessions
        self.max_limits = max_limits or Limits(wall_s=120.0, cpu_s=120, memory_mb=2048, processes=256)
        self.clock = clock
        self.sessions: dict[str, _Session] = {}
        self.counts: dict[str, int] = {"created": 0, "forked": 0, "closed": 0, "reaped": 0}
        self._lock = asyncio.Lock()

    # -- what a replica reports ---------------------------------------------------------------------

    @property
    def open(self) -> int:
        return len(self.sessions)

    def status(self) -> dict[str, int]:
        return {"open": self.open, **self.counts}

    # -- operations ---------------------------------------------------------------------------------

    async def handle(self, op: str, args: Mapping[str, Any]) -> dict[str, Any]:
        """Run one operation; a refused request is `{"error": ...}`, a broken host raises."""
        try:
            return await self._handle(op, dict(args))
        except (FileNotFoundError, PermissionError, ValueError, SandboxError) as exc:
            return {"error": {"type": type(exc).__name__, "message": str(exc)}}

    async def _handle(self, op: str, args: dict[str, Any]) -> dict[str, Any]:
        session = str(args.get("session", ""))
        if not _SESSION.fullmatch(session):
            raise ValueError(f"session id {session!r} must match {_SESSION.pattern}")
        if op == "create":
            return await self.create(session, args.get("files") or {}, _limits(args.get("limits")))
        entry = self.sessions.get(session)
        if entry is None:
            raise SandboxError(f"no sandbox session {session!r} here (closed, reaped after being idle, or never made)")
        entry.last_used = self.clock()
        box = entry.sandbox
        if op == "exec":
            command = args.get("command")
            if not isinstance(command, str | list) or not command:
                raise ValueError("exec needs a command: a string (run by sh -c) or a list of arguments")
            stdin = _unb64(args["stdin"]) if args.get("stdin") is not None else None
            result = await box.exec(
                command if isinstance(command, str) else [str(c) for c in command],
                cwd=str(args.get("cwd") or "/work"),
                stdin=stdin,
                env={str(k): str(v) for k, v in (args.get("env") or {}).items()},
                limits=self._capped(_limits(args.get("limits"))),
            )
            return {"result": msgspec.to_builtins(result)}
        if op == "read":
            return {"data": _b64(await box.read(str(args.get("path", ""))))}
        if op == "write":
            await box.write(str(args.get("path", "")), _unb64(str(args.get("data", ""))))
            return {}
        if op == "changes":
            return {"changes": {p: (_b64(d) if d is not None else None) for p, d in box.changes().items()}}
        if op == "snapshot":
            snap = await box.snapshot()
            name = uuid.uuid4().hex[:12]
            entry.snapshots[name] = snap
            return {"snapshot": name, "layers": len(snap.layers)}
        if op == "fork":
            child = str(args.get("child", ""))
            if not _SESSION.fullmatch(child) or child in self.sessions:
                raise ValueError(f"fork needs a new child session id, got {child!r}")
            self._room()
            forked = await box.fork()
            self.sessions[child] = _Session(forked, entry.family, self.clock())
            entry.family.sessions.add(child)
            self.counts["forked"] += 1
            return {"session": child}
        if op == "close":
            await self.close(session)
            return {}
        raise ValueError(f"unknown sandbox operation {op!r}")

    async def create(self, session: str, files: Mapping[str, str], limits: Limits | None) -> dict[str, Any]:
        """A sandbox over a new base tree of `files` ({path: base64 content}); an existing session is kept."""
        if session in self.sessions:  # a create re-sent after a lost reply: the same sandbox
            self.sessions[session].last_used = self.clock()
            return {"session": session}
        if not isinstance(files, Mapping):
            raise ValueError("create: files must be an object {path: base64 content}")
        tree = {str(p): _unb64(str(c)) for p, c in files.items()}
        if sum(len(d) for d in tree.values()) > MAX_FILES_BYTES:
            raise ValueError(f"create: the base tree is larger than {MAX_FILES_BYTES} bytes")
        async with self._lock:
            self._room()
            root = self.root / uuid.uuid4().hex[:12]
            base = root / "base"
            base.mkdir(parents=True)
            try:
                for path, data in tree.items():
                    target = (base / path).resolve()
                    if not target.is_relative_to(base.resolve()):
                        raise PermissionError(f"create: {path!r} is outside the sandbox's tree")
                    target.parent.mkdir(parents=True, exist_ok=True)
                    target.write_bytes(data)
                provider = BwrapProvider(root / "layers", limits=self._capped(limits))
                sandbox = await provider.create(base)
            except BaseException:
                shutil.rmtree(root, ignore_errors=True)
                raise
            family = _Family(root, provider, {session})
            self.sessions[session] = _Session(sandbox, family, self.clock())
            self.counts["created"] += 1
        return {"session": session}

    async def close(self, session: str, *, reaped: bool = False) -> None:
        entry = self.sessions.pop(session, None)
        if entry is None:
            return
        for snap in entry.snapshots.values():
            entry.family.provider.release(snap)
        await entry.sandbox.close()
        family = entry.family
        family.sessions.discard(session)
        if not family.sessions:  # the last of a sandbox and its forks: its layers and base go
            await family.provider.aclose()
            shutil.rmtree(family.root, ignore_errors=True)
        self.counts["reaped" if reaped else "closed"] += 1

    async def reap(self) -> list[str]:
        """Close every session idle for longer than `idle_ttl_s`; returns their ids."""
        cutoff = self.clock() - self.idle_ttl_s
        idle = [s for s, e in self.sessions.items() if e.last_used < cutoff]
        for session in idle:
            await self.close(session, reaped=True)
        return idle

    async def aclose(self) -> None:
        for session in list(self.sessions):
            await self.close(session)
        shutil.rmtree(self.root, ignore_errors=True)

    def _room(self) -> None:
        if len(self.sessions) >= self.max_sessions:
            raise SandboxError(f"this host holds its maximum of {self.max_sessions} sandboxes")

    def _capped(self, limits: Limits | None) -> Limits | None:
        """A caller's limits, never above the host's own."""
        if limits is None:
            return None
        top = self.max_limits
        return msgspec.structs.replace(
            limits,
            wall_s=min(limits.wall_s, top.wall_s),
            cpu_s=min(limits.cpu_s, top.cpu_s),
            memory_mb=min(limits.memory_mb, top.memory_mb),
            processes=min(limits.processes, top.processes),
            file_size_mb=min(limits.file_size_mb, top.file_size_mb),
            output_bytes=min(limits.output_bytes, top.output_bytes),
        )


def _limits(raw: Any) -> Limits | None:
    if raw is None:
        return None
    try:
        return msgspec.convert(raw, Limits)
    except msgspec.ValidationError as exc:
        raise ValueError(f"bad limits: {exc}") from None


# ----------------------------------------------------------------------------------------- client


class RemoteSandbox:
    """One session on a `SandboxHost`, driven through `caller`; the `Sandbox` interface plus `changes`."""

    def __init__(self, caller: Caller, session: str, limits: Limits | None = None) -> None:
        self.caller = caller
        self.id = session
        self.limits = limits
        self.closed = False
        self.last_error = ""  # the last SandboxError's message (a tool's crash report names only the type)

    def __repr__(self) -> str:
        return f"RemoteSandbox({self.id})"

    @classmethod
    async def create(
        cls, caller: Caller, files: Mapping[str, bytes | str], *, session: str, limits: Limits | None = None
    ) -> RemoteSandbox:
        """A new sandbox over a base tree of `files`, held by whichever host `caller` reaches."""
        payload = {p: _b64(d.encode() if isinstance(d, str) else d) for p, d in files.items()}
        args: dict[str, Any] = {"session": session, "files": payload}
        if limits is not None:
            args["limits"] = msgspec.to_builtins(limits)
        await _checked(caller, "create", args)
        return cls(caller, session, limits)

    async def _op(self, op: str, **args: Any) -> dict[str, Any]:
        if self.closed:
            raise SandboxError(f"sandbox {self.id} is closed")
        try:
            return await _checked(self.caller, op, {"session": self.id, **args})
        except SandboxError as exc:
            self.last_error = str(exc)
            raise

    async def exec(
        self,
        command: str | Sequence[str],
        *,
        cwd: str = "/work",
        stdin: bytes | None = None,
        env: Mapping[str, str] | None = None,
        limits: Limits | None = None,
    ) -> ExecResult:
        args: dict[str, Any] = {"command": command if isinstance(command, str) else list(command), "cwd": cwd}
        if stdin is not None:
            args["stdin"] = _b64(stdin)
        if env:
            args["env"] = dict(env)
        lim = limits or self.limits
        if lim is not None:
            args["limits"] = msgspec.to_builtins(lim)
        reply = await self._op("exec", **args)
        try:
            return msgspec.convert(reply["result"], ExecResult)
        except (KeyError, msgspec.ValidationError) as exc:
            raise SandboxError(f"sandbox {self.id}: the host's exec reply is not a result: {exc}") from None

    async def read(self, path: str) -> bytes:
        return _unb64((await self._op("read", path=path))["data"])

    async def write(self, path: str, data: bytes | str) -> None:
        await self._op("write", path=path, data=_b64(data.encode() if isinstance(data, str) else data))

    async def fetch_changes(self) -> dict[str, bytes | None]:
        """Every file this sandbox changed over its base: path -> bytes now, or None where deleted."""
        raw = (await self._op("changes"))["changes"]
        return {p: (_unb64(d) if d is not None else None) for p, d in raw.items()}

    async def snapshot(self) -> Snapshot:
        """Freeze the files on the host. The snapshot names a layer *on the host*: branch with `fork`."""
        reply = await self._op("snapshot")
        return Snapshot((Path("/remote") / self.id / str(reply["snapshot"]),))

    async def fork(self) -> RemoteSandbox:
        child = f"{self.id}#{uuid.uuid4().hex[:8]}"[:200]
        await self._op("fork", child=child)
        return RemoteSandbox(self.caller, child, self.limits)

    async def close(self) -> None:
        if self.closed:
            return
        try:
            await self._op("close")
        finally:
            self.closed = True


async def _checked(caller: Caller, op: str, args: dict[str, Any]) -> dict[str, Any]:
    reply = await caller(op, args)
    error = reply.get("error") if isinstance(reply, dict) else None
    if error is None:
        return reply
    kind = _ERRORS.get(str(error.get("type")), SandboxError)
    raise kind(str(error.get("message", "")))
