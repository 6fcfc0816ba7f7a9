"""The sandbox host's answers that need no sandbox: refused requests come back as errors naming why,
and the client raises them as the exceptions they are in-process (libs/sandbox remote.py)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from slipstream.sandbox import SandboxError
from slipstream.sandbox.remote import RemoteSandbox, SandboxHost

pytestmark = pytest.mark.unit


def test_requests_for_unknown_or_malformed_sessions_are_refused_naming_why(tmp_path: Path) -> None:
    host = SandboxHost(tmp_path / "host", idle_ttl_s=5)

    def ask(op: str, **args: Any) -> dict[str, Any]:
        return asyncio.run(host.handle(op, args))

    assert ask("exec", session="nope", command="true")["error"] == {
        "type": "SandboxError",
        "message": "no sandbox session 'nope' here (closed, reaped after being idle, or never made)",
    }
    assert ask("exec", session="../x")["error"]["type"] == "ValueError"
    assert "files must be an object" in ask("create", session="s1", files=["a"])["error"]["message"]
    assert ask("create", session="s1", files={"a.py": "%%%"})["error"] == {
        "type": "ValueError",
        "message": "not valid base64: Only base64 data is allowed",
    }
    assert host.status() == {"open": 0, "created": 0, "forked": 0, "closed": 0, "reaped": 0}
    asyncio.run(host.aclose())
    assert not (tmp_path / "host").exists()


def test_the_client_raises_what_the_host_refused_and_sandbox_errors_for_the_rest() -> None:
    replies: list[dict[str, Any]] = [
        {},
        {"error": {"type": "FileNotFoundError", "message": "/work/x: no such file"}},
        {"error": {"type": "PermissionError", "message": "outside /work"}},
        {"error": {"type": "SomethingElse", "message": "host broke"}},
    ]

    async def caller(op: str, args: dict[str, Any]) -> dict[str, Any]:
        return replies.pop(0)

    async def run() -> None:
        box = await RemoteSandbox.create(caller, {"a.py": "x = 1\n"}, session="s1")
        with pytest.raises(FileNotFoundError, match="no such file"):
            await box.read("x")
        with pytest.raises(PermissionError, match="outside /work"):
            await box.write("/etc/x", "y")
        with pytest.raises(SandboxError, match="host broke"):
            await box.exec("true")
        assert box.last_error == "host broke"

    asyncio.run(run())
