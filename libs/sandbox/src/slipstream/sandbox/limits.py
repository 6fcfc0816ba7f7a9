"""What a sandboxed command may use, and how its run ended.

Every `exec` runs under `Limits`: a wall-clock timeout (the whole process tree is killed, not just
the first process), CPU seconds, memory, processes, the size of any one written file, and the
bytes of output kept. `ExecResult.reason` says in one word why the command ended and `detail`
says it in a sentence, so an environment can tell "the agent's code failed" (`exit`) from "the
agent's code hit a limit" (its fault, a negative signal) from "the sandbox broke" (an
infrastructure error, masked).
"""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

Doc = msgspec.Meta

Reason = Literal[
    "ok",  # exit status 0
    "exit",  # a non-zero exit status of the command itself
    "timeout",  # the wall-clock limit: the whole tree was killed
    "cpu_limit",  # CPU seconds used up (SIGXCPU)
    "memory_limit",  # the memory cgroup's limit was hit and the kernel killed the tree
    "process_limit",  # a fork was refused at the process limit
    "file_size_limit",  # a write past the file-size limit (SIGXFSZ)
    "killed",  # ended by a signal for another reason
]


class Limits(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Resource limits of one command. The defaults suit a unit-test-sized coding task."""

    wall_s: Annotated[float, Doc(description="Wall-clock seconds before the whole process tree is killed.")] = 30.0
    cpu_s: Annotated[int, Doc(description="CPU seconds (RLIMIT_CPU) before SIGXCPU.")] = 20
    memory_mb: Annotated[int, Doc(description="Memory of the whole tree (cgroup v1 memory controller), MiB.")] = 512
    processes: Annotated[int, Doc(description="Processes and threads alive at once in the tree (cgroup pids).")] = 64
    file_size_mb: Annotated[int, Doc(description="Largest file a command may write (RLIMIT_FSIZE), MiB.")] = 64
    output_bytes: Annotated[int, Doc(description="Bytes of stdout and of stderr kept; the rest is cut.")] = 65_536

    def __post_init__(self) -> None:
        if not self.wall_s > 0:
            raise ValueError(f"wall_s must be > 0, got {self.wall_s}")
        for name in ("cpu_s", "memory_mb", "processes", "file_size_mb", "output_bytes"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.processes < 2:
            raise ValueError(f"processes must be >= 2 (the sandbox's init and the command), got {self.processes}")


class ExecResult(msgspec.Struct, frozen=True, kw_only=True):
    """How one command ended."""

    exit_code: int  # the command's exit status; 128 + N when a signal N ended it; -1 when we killed it
    stdout: str  # decoded as UTF-8, undecodable bytes replaced
    stderr: str
    wall_s: float
    reason: Reason
    detail: str = ""  # one sentence: which limit, how much was used
    truncated: bool = False  # stdout or stderr was cut at Limits.output_bytes
    raw_stdout: bytes = b""  # stdout exactly as written (what `read` returns)

    @property
    def ok(self) -> bool:
        return self.reason == "ok"

    @property
    def hit_limit(self) -> bool:
        """The command ran into one of its limits (the agent's doing, not the sandbox's)."""
        return self.reason in ("timeout", "cpu_limit", "memory_limit", "process_limit", "file_size_limit")
