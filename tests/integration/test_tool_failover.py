"""A tool-service replica SIGKILLed mid-run: every episode still completes, once, on the survivor.

Two real tool-service processes serve the `lookup` env's `get` on a real nats-server (each call
takes 150 ms in the replica, so calls are always in flight). Many `lookup` episodes, played by
the env's scripted expert through the real harness, call `get` through `NatsTransport`. When a
third of the groups are done and replica A holds calls, A is SIGKILLed. The calls it held get no
reply; each caller re-sends its call id after the tool's timeout plus the margin, and B answers.

What must hold: every episode finishes with the right answer and no infra error (none lost);
every episode has exactly one tool event for its one call (none double-counted, whatever the
number of attempts); the retried calls were all answered by B; both replicas served calls.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest
from tool_replicas import ToolReplica

from slipstream.engine import ByteTokenizer, SamplingParams
from slipstream.engine.interface import GenerationRequest
from slipstream.envs import TaskSpec, get_env, task_of
from slipstream.envs.lookup import Lookup
from slipstream.harness import rollout_episodes
from slipstream.schemas import Episode
from slipstream.stack import Server
from slipstream.supervised import ScriptedEngine
from slipstream.toolcalls import ToolRegistry, ToolsConfig, ToolTransport
from slipstream.toolcalls.remote import NatsTransport, connect

pytestmark = pytest.mark.integration

TOK = ByteTokenizer()
OPTIONS = {"tool_latency_ms": 150}
GROUPS, GROUP_SIZE, AT_ONCE = 40, 4, 6  # 160 episodes, 24 running at a time


async def test_sigkill_of_one_replica_loses_and_double_counts_no_episode(nats_server: Server, tmp_path: Path) -> None:
    a = ToolReplica("a", nats_server.url, tmp_path, sets=["lookup"], options={"lookup": OPTIONS})
    b = ToolReplica("b", nats_server.url, tmp_path, sets=["lookup"], options={"lookup": OPTIONS})
    try:
        a.wait_ready()
        b.wait_ready()
        episodes, killed = await _run(nats_server.url, a)
    finally:
        a.stop()
        b_status = b.status()
        b.stop()
    env = get_env("lookup", **OPTIONS)
    assert isinstance(env, Lookup)

    # None lost: every episode of every group came back, finished, answered right, no infra error.
    assert len(episodes) == GROUPS * GROUP_SIZE
    assert len({e.episode_id for e in episodes}) == len(episodes)
    assert [e.infra_error for e in episodes if e.infra_error] == []
    wrong = [e.episode_id for e in episodes if not env.score(task_of(e), e).correct]
    assert wrong == []

    # None double-counted: one call per episode, so one tool event and tool_calls == 1, retried or not.
    assert {(len(e.tool_log), e.counts.get("tool_calls")) for e in episodes} == {(1, 1)}
    events = [e.tool_log[0] for e in episodes]
    assert {ev.status for ev in events} == {"ok"}

    served = {ev.info["served_by"] for ev in events}
    retried = [ev for ev in events if int(ev.info["attempts"]) > 1]
    assert served == {a.served_by, b.served_by}, served
    assert killed["inflight"] > 0
    assert len(retried) > 0, "no call was in flight at A when it died: the kill proved nothing"
    assert {ev.info["served_by"] for ev in retried} == {b.served_by}
    # A retried call waited out one attempt (the tool's 2 s timeout + the 0.5 s margin) before B ran it.
    assert min(ev.latency_s for ev in retried) >= 2.5
    # B ran each call it answered once: none of its replies came from memory (no call id reached it twice).
    assert b_status["replayed"] == 0
    print(
        f"\n{len(episodes)} episodes, killed A holding {killed['inflight']} calls after {killed['done']} groups; "
        f"{len(retried)} calls retried on B; served: "
        f"A={sum(ev.info['served_by'] == a.served_by for ev in events)} "
        f"B={sum(ev.info['served_by'] == b.served_by for ev in events)}"
    )


async def _run(url: str, victim: ToolReplica) -> tuple[list[Episode], dict[str, int]]:
    env = get_env("lookup", **OPTIONS)
    nc = await connect(url, name="failover-worker")
    cfg = ToolsConfig(transport="nats", retries=2, reply_margin_s=0.5, retry_backoff_s=0.05)

    def tools(registry: ToolRegistry) -> ToolTransport:
        return NatsTransport.from_config(nc, registry, cfg, caller="failover-worker")

    tasks = env.generate("train", GROUPS, seed=11)
    slots = asyncio.Semaphore(AT_ONCE)
    done = 0
    third = asyncio.Event()

    async def group(task: TaskSpec) -> list[Episode]:
        nonlocal done

        def reply(_: GenerationRequest, context: str) -> str:
            return env.expert(task, context)

        async with slots:
            out = await rollout_episodes(
                ScriptedEngine(TOK, reply),
                TOK,
                env,
                task,
                group_size=GROUP_SIZE,
                params=SamplingParams(temperature=0.0, max_tokens=64),
                tools=tools,
            )
        done += 1
        if done >= GROUPS // 3:
            third.set()
        return out

    async def killer() -> dict[str, int]:
        await third.wait()
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            inflight = (await asyncio.to_thread(victim.status))["inflight"]
            if inflight > 0:
                victim.kill()
                return {"inflight": inflight, "done": done}
            await asyncio.sleep(0.005)
        return {"inflight": 0, "done": done}

    try:
        kill = asyncio.create_task(killer())
        groups = await asyncio.gather(*(group(t) for t in tasks))
        killed = await kill
    finally:
        await nc.close()
    return [e for g in groups for e in g], killed
