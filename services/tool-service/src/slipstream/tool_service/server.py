"""The responder: one queue-group subscription per tool, each request run and answered once.

    tools.call.<tool> --(queue group "tool-service": one replica gets each request)--> run_tool --> reply

Requests are handled concurrently, at most `concurrency` at a time (the rest wait in the
subscription's buffer, in order). Each is classified exactly as in-process (`run_tool`: ok /
invalid_tool_call / infra_error), so a tool answers the same wherever it runs. A request past
its deadline is answered `infra_error/timeout` without running (its caller has given up). A
call id seen recently is answered from `CallMemory` (`replayed`). `drain` removes this replica's
interest first (the server stops routing to it), answers what it already received, then waits
for the calls it is running.
"""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING, Any

import msgspec
from opentelemetry.trace import SpanKind

from slipstream.bus.tracing import extract, service_span
from slipstream.schemas.codec import SchemaError
from slipstream.schemas.subjects import TOOL_QUEUE_GROUP, tool_subject
from slipstream.schemas.tools import ToolReply
from slipstream.telemetry.logs import get_logger
from slipstream.telemetry.metrics import counter, gauge, histogram
from slipstream.tool_service.memory import CallMemory
from slipstream.toolcalls import ToolCall, ToolRegistry, run_tool
from slipstream.toolcalls.remote import decode_request, reply_bytes, reply_of_result

if TYPE_CHECKING:
    from nats.aio.client import Client
    from nats.aio.msg import Msg
    from nats.aio.subscription import Subscription

log = get_logger(__name__)

CALLS = counter(
    "tool-service/calls/handled", "Calls answered (labels tool, status: ok, invalid_tool_call, infra_error)."
)
IN_FLIGHT = gauge("tool-service/calls/in_flight", "Calls this replica is running or holding now (KEDA scales on it).")
LATENCY = histogram(
    "tool-service/calls/latency_s",
    "Seconds from receiving a call to sending its reply (label tool).",
    buckets=(0.0005, 0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0),
)
REPLAYED = counter("tool-service/calls/replayed", "Retried call ids answered from memory, not run again (label tool).")
EXPIRED = counter("tool-service/calls/expired", "Calls received past their deadline, answered without running.")
BAD_REQUESTS = counter("tool-service/calls/bad_requests", "Requests that were not a ToolRequest (label reason).")


class ToolServer:
    """Answers `tools.call.<tool>` for every tool of `registry`, sharing the queue group with other replicas."""

    def __init__(
        self, nc: Client, registry: ToolRegistry, *, replica: str, concurrency: int, memory: CallMemory
    ) -> None:
        self.nc = nc
        self.registry = registry
        self.replica = replica
        self.memory = memory
        self._slots = asyncio.Semaphore(concurrency)
        self._subs: list[Subscription] = []
        self._jobs: set[asyncio.Task[None]] = set()
        self.counts: dict[str, int] = {"handled": 0, "replayed": 0, "expired": 0, "bad_requests": 0}

    @property
    def in_flight(self) -> int:
        """Calls running plus calls received and waiting for a slot (what KEDA scales on)."""
        return len(self._jobs) + sum(sub.pending_msgs for sub in self._subs)

    async def start(self) -> None:
        for tool in self.registry:
            sub = await self.nc.subscribe(
                tool_subject(tool.name), queue=TOOL_QUEUE_GROUP, cb=self._on_message, pending_msgs_limit=65536
            )
            self._subs.append(sub)
        await self.nc.flush()
        IN_FLIGHT.set(0)  # the series exists from the start: KEDA's query must not come back empty
        log.info("serving tools", tools=list(self.registry.names), queue_group=TOOL_QUEUE_GROUP)

    async def _on_message(self, msg: Msg) -> None:
        # The subscription delivers in order, one callback at a time: wait for a slot here, run concurrently.
        await self._slots.acquire()
        job = asyncio.create_task(self._answer(msg))
        self._jobs.add(job)
        IN_FLIGHT.set(self.in_flight)
        job.add_done_callback(self._finished)

    def _finished(self, job: asyncio.Task[None]) -> None:
        self._jobs.discard(job)
        self._slots.release()
        IN_FLIGHT.set(self.in_flight)
        if not job.cancelled() and job.exception() is not None:
            log.error("answering a call failed", error=repr(job.exception()))

    async def _answer(self, msg: Msg) -> None:
        t0 = time.perf_counter()
        tool_name = msg.subject.rsplit(".", 1)[-1]
        try:
            request = decode_request(msg.data, msg.headers)
        except SchemaError as exc:
            BAD_REQUESTS.add(1, reason="decode")
            self.counts["bad_requests"] += 1
            log.warning("bad tool request", subject=msg.subject, error=str(exc))
            await self._send(
                msg,
                ToolReply(
                    call_id="",
                    tool=tool_name,
                    status="infra_error",
                    kind="bad_request",
                    text=f"error: bad request: {exc}",
                    served_by=self.replica,
                ),
            )
            return
        with service_span(
            f"tool {request.tool}",
            {
                "slipstream.tool": request.tool,
                "slipstream.call_id": request.call_id,
                "slipstream.attempt": request.attempt,
            },
            kind=SpanKind.SERVER,
            parent=extract(dict(msg.headers or {})),
        ):
            reply = await self._reply_to(request.call_id, request.tool, request.arguments, request.deadline)
        await self._send(msg, reply)
        LATENCY.observe(time.perf_counter() - t0, tool=request.tool)
        CALLS.add(1, tool=request.tool, status=reply.status)
        self.counts["handled"] += 1

    async def _reply_to(self, call_id: str, tool: str, arguments: dict[str, Any], deadline: float) -> ToolReply:
        if deadline and time.time() > deadline:
            EXPIRED.add(1)
            self.counts["expired"] += 1
            return ToolReply(
                call_id=call_id,
                tool=tool,
                status="infra_error",
                kind="timeout",
                text=f"error: tool {tool} call arrived after its deadline",
                served_by=self.replica,
            )
        future, mine = self.memory.claim(call_id)
        if not mine:
            REPLAYED.add(1, tool=tool)
            self.counts["replayed"] += 1
            previous = await asyncio.shield(future)
            return msgspec.structs.replace(previous, served_by=self.replica, replayed=True)
        try:
            result = await run_tool(
                self.registry.get(tool), ToolCall(id=call_id, name=tool, arguments=arguments), served_by=self.replica
            )
        except BaseException:
            self.memory.forget(call_id)
            future.cancel()
            raise
        reply = reply_of_result(result)
        future.set_result(reply)
        return reply

    async def _send(self, msg: Msg, reply: ToolReply) -> None:
        if not msg.reply:
            return  # a publish without a reply inbox: nobody waits for the answer
        data, headers = reply_bytes(reply)
        await self.nc.publish(msg.reply, data, headers=headers)

    async def drain(self) -> None:
        """Stop taking calls (the server routes new ones to other replicas), then finish those taken."""
        subs, self._subs = self._subs, []
        for sub in subs:
            await sub.drain()
        while self._jobs:
            await asyncio.gather(*list(self._jobs), return_exceptions=True)
        await self.nc.flush()
