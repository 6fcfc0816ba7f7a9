"""RUN_DIR/stack.json as one type: what a running local stack writes and what every reader decodes.

The stack (local.py, through state.py) builds a `StackFile` and writes it; `slipstream status`,
`top`, `report`, `eval`/`promote`/`rollback` and the chaos suite read it back with
`read_stack_file`, which names what is wrong (no file, not JSON, not an object, a missing or
mistyped field) as a `StackFileError`. Fields a reader may meet absent in an older file have
defaults; unknown fields are ignored, so an older reader still reads a newer file.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import msgspec

FILE = "stack.json"
REQUIRED = ("run_id", "servers", "services", "store")
"""The fields without which a file is not a stack's (checked first, for a message naming the field)."""


class StackFileError(Exception):
    """No usable stack.json: missing, unreadable, or not what a stack writes."""


class ServerEntry(msgspec.Struct, kw_only=True):
    """A server of the stack (nats, redis, s3): where it listens and whether this stack started it."""

    url: str
    port: int = 0
    pid: int | None = None
    managed: bool = False
    log: str | None = None


class StoreEntry(msgspec.Struct, kw_only=True):
    """The object store every service shares: a local directory or an S3 bucket/prefix."""

    type: str = "local"
    root: str = ""
    url: str = ""
    endpoint_url: str = ""


class ServiceEntry(msgspec.Struct, kw_only=True):
    """One service process: where its health endpoints answer, its log, its restarts."""

    module: str = ""
    pid: int | None = None
    port: int = 0
    url: str = ""
    log: str = ""
    traces_file: str | None = None
    ready_after_s: float | None = None
    restarts: int = 0
    supervisor: str = "running"


class TrustEntry(msgspec.Struct, kw_only=True):
    """Who signs weights and scores, and which keys to trust: for services started beside the stack."""

    signing_key: str = ""
    trusted_keys: list[Any] = []
    score_signing_key: str = ""
    score_trusted_keys: list[Any] = []


class RestartPolicyEntry(msgspec.Struct, kw_only=True):
    """The supervisor's policy the stack ran with."""

    enabled: bool = True
    max_restarts: int = 0
    window_s: float = 0.0


class StackFile(msgspec.Struct, kw_only=True):
    """What RUN_DIR/stack.json holds."""

    version: int = 1
    state: str = "?"
    run_id: str
    run_dir: str = ""
    supervisor_pid: int | None = None
    started_at: float | None = None
    servers: dict[str, ServerEntry]
    store: StoreEntry
    services: dict[str, ServiceEntry]
    exit_codes: dict[str, int | None] = {}
    signing_key_id: str = ""
    trust: TrustEntry = msgspec.field(default_factory=TrustEntry)
    restart_policy: RestartPolicyEntry = msgspec.field(default_factory=RestartPolicyEntry)
    supervisor_events: list[dict[str, Any]] = []
    credentials_file: str | None = None

    def server_url(self, name: str) -> str:
        """The URL of server `name` ("nats", "redis"), or "" when the file names none."""
        server = self.servers.get(name)
        return server.url if server is not None else ""


def read_stack_file(run_dir: Path) -> StackFile:
    """RUN_DIR/stack.json, decoded; StackFileError says what is missing or wrong."""
    path = run_dir / FILE
    try:
        raw = msgspec.json.decode(path.read_bytes())
    except FileNotFoundError:
        raise StackFileError(f"no {FILE} in {run_dir}") from None
    except (OSError, msgspec.DecodeError) as exc:
        raise StackFileError(f"cannot read {path}: {exc}") from None
    if not isinstance(raw, dict):
        raise StackFileError(f"{path} is not a JSON object")
    for key in REQUIRED:
        if key not in raw:
            raise StackFileError(f"{path} has no {key!r}: written by an older or foreign tool?")
    try:
        return msgspec.convert(raw, StackFile)
    except msgspec.ValidationError as exc:
        raise StackFileError(f"{path}: {exc}") from None


def encode_stack_file(stack_file: StackFile) -> bytes:
    """The file's bytes: indented JSON and a final newline."""
    return msgspec.json.format(msgspec.json.encode(stack_file), indent=2) + b"\n"
