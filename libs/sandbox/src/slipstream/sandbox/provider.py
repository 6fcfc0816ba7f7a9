"""The sandbox interface every backend implements, and the frozen layer chains forks share.

A sandbox is an isolated directory tree (`/work` inside) in which commands run under limits and
with no network by default. Its files are a stack of read-only layers (a task's base tree, then
frozen edits) plus one writable layer of its own. `snapshot()` freezes the writable layer into
the chain and starts a fresh one; `fork()` snapshots and gives a new sandbox the same chain with
its own writable layer, so a fork's edits are invisible to its parent and to its siblings.

Forks copy **files, not processes or memory**: every `exec` is a fresh process tree (no daemon
lives between calls), and no process state survives a snapshot. Checkpointing live processes
(CRIU) does not work on these machines' kernels; memory snapshots need a VM backend.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from slipstream.sandbox.limits import ExecResult, Limits


class SandboxError(RuntimeError):
    """The sandbox itself failed (cannot start, closed, layer chain too deep): an infrastructure error."""


@dataclass(frozen=True)
class Snapshot:
    """A frozen chain of layers, lowest first: what `create` can start a sandbox from."""

    layers: tuple[Path, ...]

    def __post_init__(self) -> None:
        if not self.layers:
            raise ValueError("a snapshot needs at least one layer")


class Sandbox(Protocol):
    """One isolated environment. Paths are inside the sandbox; relative ones are under /work."""

    id: str

    async def exec(
        self,
        command: str | Sequence[str],
        *,
        cwd: str = "/work",
        stdin: bytes | None = None,
        env: Mapping[str, str] | None = None,
        limits: Limits | None = None,
    ) -> ExecResult:
        """Run `command` (a string is run by `sh -c`), killing the whole tree at the wall-clock limit."""
        ...

    async def read(self, path: str) -> bytes:
        """A file's bytes. Missing: FileNotFoundError naming the path."""
        ...

    async def write(self, path: str, data: bytes | str) -> None:
        """Create or replace a file under /work (parents created). Elsewhere: PermissionError."""
        ...

    async def snapshot(self) -> Snapshot:
        """Freeze the files as they are now; the sandbox goes on writing above the snapshot."""
        ...

    async def fork(self) -> Sandbox:
        """A new sandbox with this one's files as they are now (files only, see the module doc)."""
        ...

    async def close(self) -> None:
        """Remove the writable layer; frozen layers go once no sandbox or snapshot holds them."""
        ...


class SandboxProvider(Protocol):
    """Makes sandboxes: from a host directory (read-only, must not change while used) or a snapshot."""

    async def create(self, base: Path | Snapshot | None = None, *, limits: Limits | None = None) -> Sandbox: ...

    def release(self, snapshot: Snapshot) -> None:
        """The caller is done with a snapshot `snapshot()` returned: its layers may go."""
        ...

    async def aclose(self) -> None:
        """Close every sandbox and remove every layer this provider made."""
        ...
