"""The `code` tool set: sandboxes run by tool-service replicas, reached over the tools' transport.

Two tools (`[serve] sets = ["code"]` on the replica; stubs without an implementation on the
caller, so `NatsTransport` validates calls before sending them):

- `sandbox_create(session, files, limits)`: served by every replica (the queue group picks one);
  the replica makes the session's sandbox over the files sent (base64) and answers with its
  **route**, the name of the second tool;
- `sandbox_<route>(op, session, ...)`: served by that replica alone (its own subject
  `tools.call.sandbox_<route>`), so every later operation of the episode (exec, read, write,
  snapshot, fork, changes, close) reaches the replica that holds the sandbox. The route is the
  replica's id plus a random suffix drawn at start, so two processes never share one.

A replica that is gone answers nothing: its route has no responders, the transport's retries
find none, and the call is `infra_error/unavailable`; `ServiceCaller` raises that as
`SandboxError` and the episode ends as an infrastructure failure (masked, never scored).
"""

from __future__ import annotations

import json
import re
import secrets
from typing import Any

from slipstream.sandbox import SandboxError
from slipstream.sandbox.remote import SandboxHost
from slipstream.toolcalls import Tool, ToolCall, ToolRegistry, ToolTransport

CREATE = "sandbox_create"
ROUTE_PREFIX = "sandbox_"
_OBJECT: dict[str, Any] = {"type": "object", "additionalProperties": True}
_SESSION: dict[str, Any] = {"type": "string", "minLength": 1, "maxLength": 200}


def route_for(replica: str) -> str:
    """The routed tool's name for a replica: `sandbox_<replica, as a tool name>_<random hex>`."""
    token = re.sub(r"[^a-z0-9_]", "_", replica.lower()).strip("_")[:40] or "replica"
    return f"{ROUTE_PREFIX}{token}_{secrets.token_hex(3)}"


def create_tool(host: SandboxHost | None, route: str, timeout_s: float) -> Tool:
    """`sandbox_create`: with a host, the replica's implementation; without, the caller's stub."""

    async def sandbox_create(session: str, files: dict[str, str], limits: dict[str, Any] | None = None) -> str:
        assert host is not None
        args: dict[str, Any] = {"session": session, "files": files, "limits": limits}
        reply = await host.handle("create", args)
        return json.dumps({**reply, "route": route} if "error" not in reply else reply)

    schema = {
        "type": "object",
        "properties": {"session": _SESSION, "files": _OBJECT, "limits": _OBJECT},
        "required": ["session", "files"],
        "additionalProperties": False,
    }
    fn = sandbox_create if host is not None else None
    return Tool(CREATE, "Create a sandbox over the given files (the code env's).", schema, fn, timeout_s)


def routed_tool(host: SandboxHost | None, route: str, timeout_s: float) -> Tool:
    """`sandbox_<route>`: one operation on a sandbox this replica holds."""

    async def operate(op: str, session: str, **args: Any) -> str:
        assert host is not None
        return json.dumps(await host.handle(op, {"session": session, **args}))

    schema = {
        "type": "object",
        "properties": {"op": {"type": "string", "minLength": 1, "maxLength": 20}, "session": _SESSION},
        "required": ["op", "session"],
        "additionalProperties": True,
    }
    fn = operate if host is not None else None
    return Tool(route, "Operate on a sandbox this replica holds.", schema, fn, timeout_s)


class ServiceCaller:
    """A `slipstream.sandbox.remote.Caller` over a tool transport (NATS to the tool-service).

    `create` goes to `sandbox_create` (any replica); its reply names the route, which every later
    operation uses. A call the transport could not get answered raises `SandboxError`.
    """

    def __init__(self, transport: ToolTransport, registry: ToolRegistry, *, session: str, timeout_s: float) -> None:
        self.transport = transport
        self.registry = registry
        self.session = session
        self.timeout_s = timeout_s
        self.route = ""
        self.served_by = ""
        self._calls = 0

    async def __call__(self, op: str, args: dict[str, Any]) -> dict[str, Any]:
        if op == "create":
            name, arguments = CREATE, {k: v for k, v in args.items() if v is not None}
        else:
            if not self.route:
                raise SandboxError(f"sandbox {self.session}: {op} before create")
            name, arguments = self.route, {"op": op, **args}
        self._calls += 1
        result = await self.transport.invoke(
            ToolCall(id=f"{self.session}/{self._calls}", name=name, arguments=arguments)
        )
        if result.outcome != "ok":
            where = f" (replica {self.served_by})" if self.served_by else ""
            raise SandboxError(f"sandbox service{where}: {op} failed: {result.text}")
        try:
            reply = json.loads(result.text)
        except ValueError:
            raise SandboxError(f"sandbox service: {op}: the reply is not JSON: {result.text[:200]!r}") from None
        if not isinstance(reply, dict):
            raise SandboxError(f"sandbox service: {op}: the reply is not an object")
        if op == "create" and "error" not in reply:
            route = str(reply.get("route", ""))
            if not route.startswith(ROUTE_PREFIX):
                raise SandboxError(f"sandbox service: create answered no route: {reply}")
            self.route, self.served_by = route, result.served_by
            if route not in self.registry:
                self.registry.add(routed_tool(None, route, self.timeout_s))
        return reply


def caller_registry(timeout_s: float) -> ToolRegistry:
    """The caller's registry: the create stub; routed stubs are added as replicas answer."""
    return ToolRegistry([create_tool(None, "", timeout_s)])
