"""A search tool-service replica SIGKILLed while calls are in flight: every call is answered, once, by the other.

Two real tool-service processes serve the `search` tool set from one stored index (the real
MiniLM, tests/search_corpus.py) on a real nats-server. A caller keeps `AT_ONCE` search, grep and
read calls in flight through `NatsTransport` (the harness's hidden exclusion and budget set on
each). When a third of the calls are answered and replica A holds some, A is SIGKILLed: its
calls get no reply (A is frozen with SIGSTOP first, and killed only once calls the caller still
waits on stay unanswered: a search call takes milliseconds, and a kill that lands after A
answered what it held proves nothing), and each caller re-sends the same call id after the tool's timeout plus the
margin, which the server routes to B.

What must hold: one result per call id (none lost, none doubled), every one `ok` and equal to
what the in-process backend answers for the same call; the re-sent calls were all answered by
B; both replicas served calls; B ran every call it answered once (no call id reached it twice).
"""

from __future__ import annotations

import asyncio
import signal
import time
from pathlib import Path

import pytest
from search_corpus import stored_index
from tool_replicas import ToolReplica

from slipstream.retrieval.backend import HybridSearch
from slipstream.retrieval.dense import MiniLM
from slipstream.retrieval.index import load_index
from slipstream.retrieval.tools import search_tools
from slipstream.stack import Server
from slipstream.store import LocalObjectStore
from slipstream.toolcalls import LocalTransport, ToolCall, ToolRegistry, ToolResult
from slipstream.toolcalls.remote import NatsTransport, connect

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]

CALLS, AT_ONCE = 150, 8
# Generous: a call queued behind others on a busy 2-core machine must not time out and be re-sent
# while its replica is alive (that would be a second send of a call id B then answers from memory).
TIMEOUT_S, MARGIN_S = 8.0, 0.5
QUIET_S = 1.0  # with A frozen, calls still unanswered after B answered none for this long are A's
QUERIES = ["river floods", "salt crystal", "comet tail", "court appeal", "album drummer", "signal box", "grain harbour"]


def workload() -> list[ToolCall]:
    out: list[ToolCall] = []
    for i in range(CALLS):
        q = QUERIES[i % len(QUERIES)]
        if i % 5 == 3:
            args: dict[str, object] = {"pattern": q.split()[0], "_budget": 200}
            name = "grep_corpus"
        elif i % 5 == 4:
            args, name = (
                {"doc_id": ["river", "chem", "space", "law"][i % 4], "_query": q, "_budget": 30},
                "read_document",
            )
        else:
            args, name = {"query": q, "_exclude": [f"river#{i % 3}"], "_budget": 20 + i % 40}, "search_corpus"
        out.append(ToolCall(id=f"failover-{i}", name=name, arguments=args))
    return out


async def test_sigkill_of_one_search_replica_loses_and_doubles_no_call(
    nats_server: Server, tmp_path: Path, minilm: MiniLM
) -> None:
    root = tmp_path / "store"
    key = stored_index(root, minilm)
    opts = {"search": {"index": key, "store": {"type": "local", "root": str(root)}, "timeout_s": TIMEOUT_S}}
    a = ToolReplica("a", nats_server.url, tmp_path, sets=["search"], options=opts)
    b = ToolReplica("b", nats_server.url, tmp_path, sets=["search"], options=opts)
    try:
        a.wait_ready(timeout_s=300)
        b.wait_ready(timeout_s=300)
        results, killed = await _run(nats_server.url, a)
    finally:
        a.stop()
        b_status = b.status()
        b.stop()

    batch = workload()
    index = load_index(LocalObjectStore(root), key)
    local = LocalTransport(ToolRegistry(search_tools(HybridSearch(index, minilm), titles=index.titles())))
    expected = {c.id: await local.invoke(c) for c in batch}

    # None lost, none doubled: exactly one result per call id, every one ok and as in-process.
    assert sorted(r.call_id for r in results) == sorted(c.id for c in batch)
    assert [r.call_id for r in results if r.outcome != "ok"] == []
    assert [r.call_id for r in results if r.text != expected[r.call_id].text] == []

    retried = [r for r in results if r.attempts > 1]
    assert killed["inflight"] > 0 and killed["held"] > 0
    assert retried, "no call was in flight at A when it died: the kill proved nothing"
    assert {r.served_by for r in retried} == {b.served_by}
    assert {r.served_by for r in results} == {a.served_by, b.served_by}
    # A re-sent call waited out one attempt (the tool's timeout + the margin) before B ran it.
    assert min(r.elapsed_s for r in retried) >= TIMEOUT_S + MARGIN_S
    # B answered each call id once: no reply of B's came from memory, and it handled what it served.
    assert b_status["replayed"] == 0
    assert b_status["handled"] == sum(r.served_by == b.served_by for r in results)
    print(
        f"\n{len(results)} calls, killed A holding {killed['inflight']} after {killed['done']} answered; "
        f"{len(retried)} re-sent and answered by B; A={sum(r.served_by == a.served_by for r in results)} "
        f"B={sum(r.served_by == b.served_by for r in results)}"
    )


async def _run(url: str, victim: ToolReplica) -> tuple[list[ToolResult], dict[str, int]]:
    nc = await connect(url, name="search-failover-caller")
    transport = NatsTransport(
        nc,
        ToolRegistry(search_tools(None, timeout_s=TIMEOUT_S)),
        retries=2,
        reply_margin_s=MARGIN_S,
        retry_backoff_s=0.05,
    )
    slots = asyncio.Semaphore(AT_ONCE)
    done = 0
    waiting: set[str] = set()  # call ids sent and not answered yet
    answered_at = time.monotonic()
    third = asyncio.Event()

    async def one(call: ToolCall) -> ToolResult:
        nonlocal done, answered_at
        async with slots:
            waiting.add(call.id)
            result = await transport.invoke(call)
            waiting.discard(call.id)
            answered_at = time.monotonic()
        done += 1
        if done >= CALLS // 3:
            third.set()
        return result

    async def held_by_frozen_victim() -> int:
        """With A stopped: how many calls stay unanswered once B has gone QUIET_S without answering
        one (B's take milliseconds); those are A's. Well inside the tool's timeout, so none is re-sent."""
        start = time.monotonic()
        while time.monotonic() - start < TIMEOUT_S / 2:
            await asyncio.sleep(0.05)
            if waiting and time.monotonic() - answered_at >= QUIET_S:
                return len(waiting)
        return 0

    async def killer() -> dict[str, int]:
        await third.wait()
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            inflight = (await asyncio.to_thread(victim.status))["inflight"]
            if inflight > 0:
                victim.proc.send(signal.SIGSTOP)
                held = await held_by_frozen_victim()
                if held:
                    victim.kill()
                    return {"inflight": inflight, "held": held, "done": done}
                victim.proc.send(signal.SIGCONT)  # it had answered what it held: try again
            await asyncio.sleep(0.005)
        return {"inflight": 0, "held": 0, "done": done}

    try:
        kill = asyncio.create_task(killer())
        results = await asyncio.gather(*(one(c) for c in workload()))
        killed = await kill
    finally:
        await nc.close()
    return list(results), killed
