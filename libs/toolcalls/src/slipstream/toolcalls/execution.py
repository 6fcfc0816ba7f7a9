"""Running a turn's calls: concurrently, each under its tool's timeout, over a transport.

A `ToolTransport` turns one well-formed `ToolCall` into one classified `ToolResult` and never
raises for anything a tool or its backend does. `LocalTransport` runs implementations in this
process; `NatsTransport` (remote.py) asks a tool service over NATS request/reply. One contract
suite (tests/contract/test_tools.py) holds both to the same results.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Sequence
from typing import Any, Protocol

from slipstream.toolcalls.calls import IN_PROCESS, MalformedCall, ToolCall, ToolResult, invalid_result
from slipstream.toolcalls.tool import Tool, ToolInputError, ToolRegistry


class ToolTransport(Protocol):
    """Where calls run. `invoke` returns a classified result; it does not raise for tool failures."""

    @property
    def registry(self) -> ToolRegistry: ...

    async def invoke(self, call: ToolCall) -> ToolResult: ...

    async def close(self) -> None: ...


def result_text(value: Any) -> str:
    """What the model sees for a tool's return value: strings as they are, anything else as JSON."""
    if isinstance(value, str):
        return value
    return json.dumps(value, sort_keys=True, ensure_ascii=False)


async def run_tool(tool: Tool | None, call: ToolCall, *, served_by: str = "") -> ToolResult:
    """Validate and run one call in this process under the tool's timeout; classify what happened.

    Shared by `LocalTransport` and the tool service so both classify identically.
    """
    t0 = time.perf_counter()

    def done(outcome: Any, text: str, kind: str = "") -> ToolResult:
        return ToolResult(
            call_id=call.id,
            name=call.name,
            outcome=outcome,
            text=text,
            kind=kind,
            elapsed_s=time.perf_counter() - t0,
            served_by=served_by,
        )

    if tool is None:
        return done("invalid_tool_call", f"error: unknown tool {call.name!r}", "unknown_tool")
    problem = tool.argument_error(call.arguments)
    if problem is not None:
        return done("invalid_tool_call", f"error: invalid arguments for {call.name}: {problem}", "bad_arguments")
    if tool.fn is None:
        return done("infra_error", f"error: tool {call.name} has no implementation here", "unavailable")
    try:
        value = await asyncio.wait_for(tool.fn(**call.arguments), tool.timeout_s)
    except ToolInputError as exc:
        return done("invalid_tool_call", f"error: invalid arguments for {call.name}: {exc}", "bad_arguments")
    except TimeoutError:
        return done("infra_error", f"error: tool {call.name} timed out after {tool.timeout_s:g} s", "timeout")
    except Exception as exc:  # a tool bug is reported as infrastructure, never blamed on the model
        return done("infra_error", f"error: tool {call.name} failed: {type(exc).__name__}", "tool_crashed")
    return done("ok", result_text(value))


class LocalTransport:
    """Runs the registry's implementations in this process."""

    def __init__(self, registry: ToolRegistry) -> None:
        self._registry = registry

    @property
    def registry(self) -> ToolRegistry:
        return self._registry

    async def invoke(self, call: ToolCall) -> ToolResult:
        return await run_tool(self._registry.get(call.name), call, served_by=IN_PROCESS)

    async def close(self) -> None:
        return None


async def execute(items: Sequence[ToolCall | MalformedCall], transport: ToolTransport) -> list[ToolResult]:
    """One result per item, in item order. Well-formed calls run concurrently; malformed ones never run."""

    async def one(item: ToolCall | MalformedCall) -> ToolResult:
        if isinstance(item, MalformedCall):
            return invalid_result(item)
        return await transport.invoke(item)

    return list(await asyncio.gather(*(one(i) for i in items)))
