"""Tool calls over NATS request/reply: the caller's side of the tool-service.

`NatsTransport` is a `ToolTransport` whose calls run in a tool-service replica. A call goes to
`tools.call.<tool>`; the replicas subscribe there in one queue group, so the server hands each
request to one of them. What can go wrong between the two is never the model's fault:

- no replica subscribed (no responders), or none answered within the tool's timeout plus a
  margin (a replica died mid-call, or is overloaded): the call is sent again, with the same
  call id, up to `retries` times, after a short doubling pause; the server picks any live
  replica, so a dead one is not asked again. If every attempt fails the result is
  `infra_error/unavailable`, which masks the episode instead of scoring it;
- the reply is for exactly one request: each attempt waits on its own inbox token, and a late
  reply to an abandoned attempt is dropped by the client, so a call yields one result (one
  tool event on the episode) however many attempts it took, and `attempts` says how many.

The call id is the idempotency key: a replica that sees a call id it already ran (a retry that
reached the same replica) answers from memory without running the tool again.

Checks the caller can make itself happen here, before anything is sent, exactly as
`LocalTransport` makes them: an unknown tool and arguments that break the schema are the
model's fault (`invalid_tool_call`). The replica checks again, against its own registry.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from nats.errors import Error as NatsError
from nats.errors import NoRespondersError
from opentelemetry import propagate
from opentelemetry.context import get_current

from slipstream.runtime.backoff import Backoff
from slipstream.schemas.codec import SCHEMA_HEADER, SchemaError, check_header, decode, encode, schema_header
from slipstream.schemas.subjects import tool_subject
from slipstream.schemas.tools import ToolReply, ToolRequest
from slipstream.toolcalls.calls import ToolCall, ToolResult
from slipstream.toolcalls.config import ToolsConfig
from slipstream.toolcalls.execution import run_tool
from slipstream.toolcalls.tool import ToolRegistry

if TYPE_CHECKING:
    from nats.aio.client import Client


def request_headers() -> dict[str, str]:
    """The schema header and the current trace context (W3C traceparent/tracestate)."""
    headers = {SCHEMA_HEADER: schema_header(ToolRequest)}
    ctx = get_current()
    if ctx:
        propagate.inject(headers, context=ctx)
    return headers


class NatsTransport:
    """Runs calls in tool-service replicas; see the module docstring for the failure semantics."""

    def __init__(
        self,
        nc: Client,
        registry: ToolRegistry,
        *,
        retries: int = 2,
        reply_margin_s: float = 1.0,
        retry_backoff_s: float = 0.1,
        caller: str = "",
        owns_connection: bool = False,
        stats: dict[str, int] | None = None,
    ) -> None:
        if retries < 0 or reply_margin_s <= 0 or retry_backoff_s < 0:
            raise ValueError(
                f"need retries >= 0, reply_margin_s > 0, retry_backoff_s >= 0; got {retries}, "
                f"{reply_margin_s}, {retry_backoff_s}"
            )
        self._nc = nc
        self._registry = registry
        self.retries = retries
        self.reply_margin_s = reply_margin_s
        self.retry_backoff_s = retry_backoff_s
        self.caller = caller
        self._owns = owns_connection
        # Counts of calls sent, re-sends and calls no replica answered; pass one dict to several
        # transports (one per episode) to count them together.
        self.stats = stats if stats is not None else {}
        for key in ("calls", "retries", "unavailable"):
            self.stats.setdefault(key, 0)

    @classmethod
    async def connect(
        cls,
        url: str,
        registry: ToolRegistry,
        *,
        name: str = "tools",
        cfg: ToolsConfig | None = None,
        options: Mapping[str, Any] | None = None,
    ) -> NatsTransport:
        """A transport with its own connection (closed by `close`); `options` as for `connect`."""
        cfg = cfg or ToolsConfig(transport="nats")
        nc = await connect(url, name=name, timeout_s=cfg.connect_timeout_s, options=options)
        return cls.from_config(nc, registry, cfg, caller=name, owns_connection=True)

    @classmethod
    def from_config(
        cls,
        nc: Client,
        registry: ToolRegistry,
        cfg: ToolsConfig,
        *,
        caller: str = "",
        owns_connection: bool = False,
        stats: dict[str, int] | None = None,
    ) -> NatsTransport:
        return cls(
            nc,
            registry,
            retries=cfg.retries,
            reply_margin_s=cfg.reply_margin_s,
            retry_backoff_s=cfg.retry_backoff_s,
            caller=caller,
            owns_connection=owns_connection,
            stats=stats,
        )

    @property
    def registry(self) -> ToolRegistry:
        return self._registry

    async def invoke(self, call: ToolCall) -> ToolResult:
        tool = self._registry.get(call.name)
        if tool is None or tool.argument_error(call.arguments) is not None:
            # The model's fault, found without asking anyone: classified exactly as in-process.
            return await run_tool(tool, call, served_by="")
        self.stats["calls"] += 1
        t0 = time.perf_counter()
        wait_s = tool.timeout_s + self.reply_margin_s
        subject = tool_subject(call.name)
        failures: list[str] = []
        retry = Backoff(self.retry_backoff_s)
        for attempt in range(1, self.retries + 2):
            if attempt > 1:
                self.stats["retries"] += 1
                await retry.sleep()
            request = ToolRequest(
                call_id=call.id,
                tool=call.name,
                arguments=dict(call.arguments),
                deadline=time.time() + wait_s,
                attempt=attempt,
                caller=self.caller,
            )
            try:
                msg = await self._nc.request(subject, encode(request), timeout=wait_s, headers=request_headers())
            except NoRespondersError:
                failures.append("no responders")
                continue
            except (NatsError, TimeoutError) as exc:
                failures.append(
                    f"no reply within {wait_s:g} s" if isinstance(exc, TimeoutError) else type(exc).__name__
                )
                continue
            reply = _reply_of(msg.data, msg.headers, call.id)
            if reply is None:
                failures.append("undecodable reply")
                continue
            return ToolResult(
                call_id=call.id,
                name=call.name,
                outcome=reply.status,
                text=reply.text,
                kind=reply.kind,
                elapsed_s=time.perf_counter() - t0,
                attempts=attempt,
                served_by=reply.served_by,
            )
        self.stats["unavailable"] += 1
        return ToolResult(
            call_id=call.id,
            name=call.name,
            outcome="infra_error",
            text=f"error: tool {call.name} unavailable ({'; '.join(failures)})",
            kind="unavailable",
            elapsed_s=time.perf_counter() - t0,
            attempts=self.retries + 1,
        )

    async def close(self) -> None:
        if self._owns and not self._nc.is_closed:
            await self._nc.close()


def _reply_of(data: bytes, headers: dict[str, str] | None, call_id: str) -> ToolReply | None:
    """The reply, or None when it is not a `ToolReply` for this call (treated like no reply)."""
    try:
        check_header((headers or {}).get(SCHEMA_HEADER), ToolReply)
        reply = decode(data, ToolReply)
    except SchemaError:
        return None
    return reply if reply.call_id == call_id else None


async def connect(url: str, *, name: str, timeout_s: float = 5.0, options: Mapping[str, Any] | None = None) -> Client:
    """A NATS connection that reconnects forever (a tool-service restart must not break callers).

    `options` carries the caller's identity (`BusConfig.nats_options()`: user, password, inbox
    prefix, TLS) when the server has one user per service.
    """
    import nats

    return await nats.connect(
        servers=[u.strip() for u in url.split(",") if u.strip()],
        name=name,
        connect_timeout=timeout_s,
        allow_reconnect=True,
        max_reconnect_attempts=-1,
        reconnect_time_wait=0.5,
        **dict(options or {}),
    )


def decode_request(data: bytes, headers: dict[str, str] | None) -> ToolRequest:
    """A tool-service's view of a request; SchemaError when it is not one."""
    check_header((headers or {}).get(SCHEMA_HEADER), ToolRequest)
    return decode(data, ToolRequest)


def reply_bytes(reply: ToolReply) -> tuple[bytes, dict[str, str]]:
    return encode(reply), {SCHEMA_HEADER: schema_header(ToolReply)}


def reply_of_result(result: ToolResult, *, replayed: bool = False) -> ToolReply:
    return ToolReply(
        call_id=result.call_id,
        tool=result.name or "",
        status=result.outcome,
        text=result.text,
        kind=result.kind,
        elapsed_s=result.elapsed_s,
        served_by=result.served_by,
        replayed=replayed,
    )
