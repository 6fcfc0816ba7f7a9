"""One contract for every tool transport: a tool answers the same in-process and from a tool-service.

Each test runs twice: against `LocalTransport` and against `NatsTransport` talking to a real
tool-service process (`python -m slipstream.tool_service`) on a real nats-server, both on free
loopback ports started by this module. Results, the model's errors, timeouts, an unknown tool,
a backend that is missing, and several calls of one turn must come out identically classified;
only `served_by` tells where a call ran. Below the suite, what only the remote side has: retries
against no responders, a retried call id answered from memory, SIGTERM draining in-flight calls.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
from opentelemetry import trace
from opentelemetry.trace import NonRecordingSpan, SpanContext, TraceFlags
from tool_replicas import ToolReplica

from slipstream.envs import get_env
from slipstream.schemas import ToolReply, ToolRequest, decode, encode
from slipstream.schemas.subjects import tool_subject
from slipstream.stack import Server, start_nats
from slipstream.tool_service.toolsets import build_registry
from slipstream.toolcalls import (
    LocalTransport,
    MalformedCall,
    Tool,
    ToolCall,
    ToolRegistry,
    ToolTransport,
    execute,
    tally,
    tool_event,
)
from slipstream.toolcalls.remote import NatsTransport, connect, request_headers

pytestmark = pytest.mark.contract

SETS = ["calc", "wait", "lookup"]
OPTIONS = {"wait": {"timeout_s": 0.5}}
# Known to the caller's registry, served by nobody: its backend is missing.
GHOST = Tool(
    name="ghost",
    description="A tool whose backend is not running.",
    parameters={"type": "object", "properties": {}, "additionalProperties": False},
    timeout_s=0.3,
)


def registry() -> ToolRegistry:
    """What the caller knows: the served sets, built exactly as a replica builds them, plus GHOST."""
    return ToolRegistry([*build_registry(SETS, OPTIONS), GHOST])


@pytest.fixture(scope="module")
def nats(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    root = tmp_path_factory.mktemp("tools-nats")
    srv = start_nats(root / "nats", root / "logs")
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def replica(nats: Server, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ToolReplica]:
    r = ToolReplica("contract-0", nats.url, tmp_path_factory.mktemp("tools-svc"), sets=SETS, options=OPTIONS)
    try:
        yield r.wait_ready()
    finally:
        r.stop()


@pytest.fixture(params=["local", "nats"])
async def transport(request: pytest.FixtureRequest) -> AsyncIterator[ToolTransport]:
    if request.param == "local":
        t: ToolTransport = LocalTransport(registry())
    else:
        replica: ToolReplica = request.getfixturevalue("replica")
        nats: Server = request.getfixturevalue("nats")
        t = await NatsTransport.connect(nats.url, registry(), name="contract-caller")
        t.served = replica.served_by  # type: ignore[attr-defined]
    yield t
    await t.close()


def served_where(t: ToolTransport) -> str:
    return getattr(t, "served", "local")


def call(i: str, name: str, **arguments: object) -> ToolCall:
    return ToolCall(id=f"ep-{time.monotonic_ns()}-{i}", name=name, arguments=arguments)


# --------------------------------------------------------------------------- the contract (both transports)


async def test_results_and_where_they_ran(transport: ToolTransport) -> None:
    calc = await transport.invoke(call("0", "calculator", expression="(12 + 7) * 3"))
    got = await transport.invoke(call("1", "get", key="417"))
    assert (calc.outcome, calc.text, calc.kind, calc.attempts) == ("ok", "57", "", 1)
    assert (got.outcome, got.text) == ("ok", get_env("lookup").value("417"))  # type: ignore[attr-defined]
    assert {calc.served_by, got.served_by} == {served_where(transport)}


async def test_the_models_errors_are_invalid_tool_calls(transport: ToolTransport) -> None:
    by_tool = await transport.invoke(call("0", "calculator", expression="1/0"))
    by_schema = await transport.invoke(call("1", "calculator", expr="1"))
    by_pattern = await transport.invoke(call("2", "get", key="ABC"))
    unknown = await transport.invoke(call("3", "nope", x=1))
    assert {r.outcome for r in (by_tool, by_schema, by_pattern, unknown)} == {"invalid_tool_call"}
    assert [(r.kind, r.text) for r in (by_tool, by_schema, by_pattern, unknown)] == [
        ("bad_arguments", "error: invalid arguments for calculator: division by zero"),
        ("bad_arguments", "error: invalid arguments for calculator: 'expression' is a required property"),
        ("bad_arguments", "error: invalid arguments for get: 'ABC' does not match '^[0123456789]{1,16}$' (at key)"),
        ("unknown_tool", "error: unknown tool 'nope'"),
    ]


async def test_a_tool_past_its_timeout_is_an_infra_error(transport: ToolTransport) -> None:
    t0 = time.monotonic()
    slow = await transport.invoke(call("0", "wait", ms=3000, text="late"))
    assert (slow.outcome, slow.kind, slow.text) == ("infra_error", "timeout", "error: tool wait timed out after 0.5 s")
    assert slow.is_error and time.monotonic() - t0 < 2.5  # the tool's 0.5 s, not its 3 s


async def test_a_missing_backend_is_an_infra_error_never_the_models(transport: ToolTransport) -> None:
    r = await transport.invoke(call("0", "ghost"))
    assert (r.outcome, r.kind) == ("infra_error", "unavailable")
    event = tool_event(call("0", "ghost"), r, sample_id="s", turn=0)
    assert (event.status, event.result, event.error) == ("infra_error", "", r.text)
    assert tally([r]) == {"infra_error": 1, "infra_error/unavailable": 1}


async def test_the_calls_of_one_turn_run_concurrently_and_keep_their_order(transport: ToolTransport) -> None:
    items: list[ToolCall | MalformedCall] = [
        call("0", "wait", ms=300, text="a"),
        call("1", "calculator", expression="2 + 3"),
        MalformedCall(id="m", kind="bad_json", error="error: bad json", raw="<tool>{</tool>"),
        call("3", "wait", ms=300, text="b"),
        call("4", "get", key="9"),
        call("5", "wait", ms=300, text="c"),
        call("6", "wait", ms=300, text="d"),
    ]
    t0 = time.monotonic()
    results = await execute(items, transport)
    wall = time.monotonic() - t0
    assert [(r.outcome, r.text) for r in results] == [
        ("ok", "a"),
        ("ok", "5"),
        ("invalid_tool_call", "error: bad json"),
        ("ok", "b"),
        ("ok", get_env("lookup").value("9")),  # type: ignore[attr-defined]
        ("ok", "c"),
        ("ok", "d"),
    ]
    assert [r.call_id for r in results] == [i.id for i in items]
    # Four 300 ms calls one after another would take 1.2 s.
    assert wall < 1.0, f"the turn took {wall:.2f} s: its calls did not overlap"
    assert tally(results) == {"ok": 6, "invalid_tool_call": 1, "invalid_tool_call/bad_json": 1}


async def test_the_same_call_twice_gives_the_same_answer(transport: ToolTransport) -> None:
    c = call("0", "get", key="123")
    first, again = await transport.invoke(c), await transport.invoke(c)
    assert (first.outcome, first.text) == (again.outcome, again.text) == ("ok", get_env("lookup").value("123"))  # type: ignore[attr-defined]


# --------------------------------------------------------------------------- only the remote side


async def test_no_responders_is_retried_then_unavailable(nats: Server, replica: ToolReplica) -> None:
    t = await NatsTransport.connect(nats.url, registry(), name="retry-caller")
    try:
        t.retry_backoff_s = 0.05
        r = await t.invoke(call("0", "ghost"))
    finally:
        await t.close()
    assert (r.outcome, r.kind, r.attempts) == ("infra_error", "unavailable", 3)
    assert r.text == "error: tool ghost unavailable (no responders; no responders; no responders)"
    assert t.stats == {"calls": 1, "retries": 2, "unavailable": 1}


async def test_a_retried_call_id_is_answered_from_memory(nats: Server, replica: ToolReplica) -> None:
    nc = await connect(nats.url, name="raw-caller")
    before = replica.status()["replayed"]
    try:

        async def ask(attempt: int) -> ToolReply:
            req = ToolRequest(call_id="memo-1", tool="wait", arguments={"ms": 200, "text": "once"}, attempt=attempt)
            msg = await nc.request(tool_subject("wait"), encode(req), timeout=3, headers=request_headers())
            return decode(msg.data, ToolReply)

        # The retry arrives while the first run is still sleeping: it joins that run.
        first, second = await asyncio.gather(ask(1), ask(2))
        third = await ask(3)
    finally:
        await nc.close()
    assert [(r.status, r.text) for r in (first, second, third)] == [("ok", "once")] * 3
    assert sorted([first.replayed, second.replayed]) == [False, True] and third.replayed
    assert replica.status()["replayed"] - before == 2


async def test_sigterm_drains_the_calls_a_replica_holds(nats_server: Server, tmp_path: Path) -> None:
    # Its own nats-server: the module's replica must not share the queue group and take calls.
    opts = {"lookup": {"salt": "drain", "tool_latency_ms": 400}}
    r = ToolReplica("drainer", nats_server.url, tmp_path, sets=["lookup"], options=opts)
    r.wait_ready()
    reg = build_registry(["lookup"], {"lookup": {"salt": "drain"}})
    t = await NatsTransport.connect(nats_server.url, reg, name="drain-caller")
    try:
        jobs = [asyncio.create_task(t.invoke(call(str(i), "get", key=str(i)))) for i in range(8)]
        await asyncio.sleep(0.2)  # every call is now sleeping inside the replica
        code = await asyncio.to_thread(r.stop)
        results = await asyncio.gather(*jobs)
    finally:
        await t.close()
    env = get_env("lookup", salt="drain")
    assert code == 0
    assert [(x.outcome, x.text, x.attempts, x.served_by) for x in results] == [
        ("ok", env.value(str(i)), 1, r.served_by)  # type: ignore[attr-defined]
        for i in range(8)
    ]


async def test_a_call_carries_its_trace_into_the_replica(nats_server: Server, tmp_path: Path) -> None:
    spans = tmp_path / "spans.jsonl"
    traced = ("--telemetry.traces", "file", "--telemetry.traces-file", str(spans))
    r = ToolReplica("traced", nats_server.url, tmp_path, sets=["calc"], extra=traced)
    r.wait_ready()
    t = await NatsTransport.connect(nats_server.url, registry(), name="traced-caller")
    caller = SpanContext(trace_id=0xABC123, span_id=0x42, is_remote=False, trace_flags=TraceFlags(TraceFlags.SAMPLED))
    try:
        with trace.use_span(NonRecordingSpan(caller)):
            result = await t.invoke(call("0", "calculator", expression="6*7"))
    finally:
        await t.close()
        assert r.stop() == 0  # a clean exit flushes the span file
    assert (result.outcome, result.text) == ("ok", "42")
    records = [json.loads(line) for line in spans.read_text().splitlines()]
    (span,) = [s for s in records if s["name"] == "tool calculator"]
    assert (span["trace_id"], span["parent_span_id"], span["kind"]) == (f"{0xABC123:032x}", f"{0x42:016x}", "server")
    assert span["attributes"]["slipstream.call_id"] == result.call_id
