"""Sandboxes as their own tool service: the `code` tool set on two real replicas over real NATS.

`code` episodes with `sandbox = "service"` are played by the env's scripted expert through the real
harness; their tools call `NatsTransport`, their sandboxes live on tool-service processes (real
bubblewrap, real cgroups). What must hold:

- every episode's operations reach the replica holding its sandbox (`sandbox_create` goes to the
  queue group, then every operation to that replica's own subject): all episodes fix their bug,
  both replicas held sandboxes, and every sandbox made was closed at the episode's end;
- a replica SIGKILLed mid-run: its episodes end as infrastructure errors naming it (masked by the
  reward-model's scorer, never the model's fault), the survivor's finish correctly, and a new
  replica removes the dead one's sandboxes from disk;
- a sandbox nobody closes (its caller died) is reaped after the idle TTL.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from tool_replicas import ToolReplica

from slipstream.engine import ByteTokenizer, SamplingParams
from slipstream.engine.interface import GenerationRequest
from slipstream.envs import TaskSpec, get_env, task_of
from slipstream.envs.code.service import ServiceCaller, caller_registry
from slipstream.harness import rollout_episodes
from slipstream.sandbox import cgroups
from slipstream.sandbox.remote import RemoteSandbox
from slipstream.schemas import Episode
from slipstream.stack import Server
from slipstream.supervised import ScriptedEngine
from slipstream.toolcalls import ToolCall, ToolRegistry, ToolsConfig, ToolTransport, renderer_for
from slipstream.toolcalls.remote import NatsTransport, connect

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(cgroups.available() is not None, reason=f"no cgroups here: {cgroups.available()}"),
]

TOK = ByteTokenizer()
TAGS = renderer_for("tags")
ENV_OPTIONS = {"sandbox": "service"}
CFG = ToolsConfig(transport="nats", retries=2, reply_margin_s=0.5, retry_backoff_s=0.05)


def replica(name: str, url: str, tmp: Path, **options: Any) -> ToolReplica:
    opts = {"root": str(tmp / "sandboxes"), **options}
    return ToolReplica(name, url, tmp, sets=["code"], options={"code": opts})


def slow_expert(task: TaskSpec, pause_s: float) -> Callable[[GenerationRequest, str], str]:
    """The env's expert with a pause first (`run("sleep ...")`), so sandboxes are alive while a replica dies."""
    env = get_env("code", **ENV_OPTIONS)

    def reply(_: GenerationRequest, context: str) -> str:
        if pause_s and "<result>" not in context:
            call = ToolCall(id="p", name="run", arguments={"command": f"sleep {pause_s}"})
            return TAGS.render_calls("", [call])
        return env.expert(task, context.split("<result>", 1)[1] if pause_s and context.count("<result>") else context)

    return reply


async def play(
    url: str, tasks: list[TaskSpec], pause_s: float, during: Callable[[], Any] | None = None
) -> list[Episode]:
    env = get_env("code", **ENV_OPTIONS)
    nc = await connect(url, name="sandbox-worker")

    def tools(registry: ToolRegistry) -> ToolTransport:
        return NatsTransport.from_config(nc, registry, CFG, caller="sandbox-worker")

    async def one(task: TaskSpec) -> Episode:
        (episode,) = await rollout_episodes(
            ScriptedEngine(TOK, slow_expert(task, pause_s)),
            TOK,
            env,
            task,
            group_size=1,
            params=SamplingParams(temperature=0.0, max_tokens=256),
            tools=tools,
        )
        return episode

    try:
        jobs = [asyncio.create_task(one(t)) for t in tasks]
        if during is not None:
            await during()
        return list(await asyncio.gather(*jobs))
    finally:
        await nc.close()


async def test_each_episode_reaches_the_replica_holding_its_sandbox(nats_server: Server, tmp_path: Path) -> None:
    a = replica("a", nats_server.url, tmp_path)
    b = replica("b", nats_server.url, tmp_path)
    try:
        a.wait_ready()
        b.wait_ready()
        tasks = get_env("code").generate("train", 12, seed=5)
        episodes = await play(nats_server.url, tasks, pause_s=0.0)
        sa, sb = a.status()["sandboxes"], b.status()["sandboxes"]
    finally:
        a.stop()
        b.stop()
    env = get_env("code", **ENV_OPTIONS)
    assert [e.infra_error for e in episodes if e.infra_error] == []
    assert all(env.score(task_of(e), e).correct for e in episodes)
    assert all([ev.name for ev in e.tool_log] == ["replace", "run_tests"] for e in episodes)
    # Both replicas took episodes; each sandbox was made once and closed at its episode's end.
    assert sa["created"] > 0 and sb["created"] > 0, (sa, sb)
    assert sa["created"] + sb["created"] == len(tasks)
    assert (sa["closed"], sb["closed"]) == (sa["created"], sb["created"])
    assert sa["open"] == sb["open"] == 0
    assert not [p for p in (tmp_path / "sandboxes").rglob("upper") if p.is_dir()]  # no sandbox left on disk


async def test_a_killed_replica_ends_its_episodes_as_infra_errors_and_leaves_nothing(
    nats_server: Server, tmp_path: Path
) -> None:
    from slipstream.reward_model.scorer import Scorer

    a = replica("a", nats_server.url, tmp_path)
    b = replica("b", nats_server.url, tmp_path)
    killed: dict[str, Any] = {}
    try:
        a.wait_ready()
        b.wait_ready()

        async def kill_a_while_it_holds_sandboxes() -> None:
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline:
                held = (await asyncio.to_thread(a.status))["sandboxes"]["open"]
                if held >= 2:
                    a.kill()
                    killed["held"] = held
                    return
                await asyncio.sleep(0.01)

        # 12 episodes over the queue group (a gets fewer than 2 with p = 13/4096) and 3 s of work in
        # each, so a holds two at once even when sandboxes are made slowly on a loaded machine.
        tasks = get_env("code").generate("train", 12, seed=6)
        t0 = time.monotonic()
        episodes = await play(nats_server.url, tasks, pause_s=3.0, during=kill_a_while_it_holds_sandboxes)
        wall = time.monotonic() - t0
        dead_dirs = [p.name for p in (tmp_path / "sandboxes").iterdir()]
        sb = b.status()["sandboxes"]
        c = replica("c", nats_server.url, tmp_path).wait_ready()  # sweeps what the dead replica left
        left = sorted(p.name for p in (tmp_path / "sandboxes").iterdir())
        c.stop()
    finally:
        a.stop()
        b.stop()
    assert killed.get("held", 0) >= 2, "replica a never held two sandboxes at once: the kill proved nothing"
    env = get_env("code", **ENV_OPTIONS)
    infra = [e for e in episodes if e.infra_error]
    fine = [e for e in episodes if not e.infra_error]
    # The episodes a held end as infrastructure errors that name a; none is scored as the model's fault.
    assert len(infra) >= killed["held"], [e.infra_error for e in episodes]
    assert all("replica tool-service/a" in e.infra_error and "unavailable" in e.infra_error for e in infra), [
        e.infra_error for e in infra
    ]
    scorer = Scorer({"code": ENV_OPTIONS})
    for e in infra:
        scored, score = scorer.score(e, now=time.time())
        assert score.reason.startswith("infra_error: ") and scored.episode.infra_error
    # The rest (on b, or done on a before the kill) fixed their bug; b closed every sandbox it made.
    assert fine and all(env.score(task_of(e), e).correct for e in fine)
    assert sb["open"] == 0 and sb["created"] == sb["closed"] > 0
    assert wall < 60  # a call in flight at the kill waits out its attempt (wall_s + 15 s + the margin)
    # On disk: the dead replica's directory stayed until a new replica started, which removed it.
    assert len(dead_dirs) == 2
    assert len(left) == 2 and set(left) != set(dead_dirs)  # b's and c's, not a's
    print(f"\nkilled a holding {killed['held']} sandboxes: {len(infra)} infra-error episodes, {len(fine)} fine")
    print(f"an infra error: {infra[0].infra_error}")


async def test_an_abandoned_sandbox_is_reaped_after_the_idle_ttl(nats_server: Server, tmp_path: Path) -> None:
    a = replica("a", nats_server.url, tmp_path, idle_ttl_s=1.0, reap_every_s=0.2)
    nc = await connect(nats_server.url, name="abandoning-worker")
    try:
        a.wait_ready()
        registry = caller_registry(20.0)
        transport = NatsTransport.from_config(nc, registry, CFG, caller="abandoning-worker")
        caller = ServiceCaller(transport, registry, session="abandoned/1", timeout_s=20.0)
        box = await RemoteSandbox.create(caller, {"x.txt": "hello"}, session="abandoned/1")
        assert (await box.exec("cat x.txt")).stdout == "hello"
        await box.write("y.txt", "new")
        assert (await box.fetch_changes()) == {"y.txt": b"new"}
        child = await box.fork()
        await child.write("x.txt", "child")
        assert (await box.read("x.txt")) == b"hello"  # a fork's edits are invisible to its parent
        with pytest.raises(FileNotFoundError):
            await box.read("missing.txt")
        assert a.status()["sandboxes"]["open"] == 2
        # The caller "dies": nobody closes them. Within the TTL plus a reap interval both are gone.
        deadline = time.monotonic() + 5
        while a.status()["sandboxes"]["open"] and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        status = a.status()["sandboxes"]
        assert status["open"] == 0 and status["reaped"] == 2
        reply = await caller("exec", {"session": "abandoned/1", "command": "true"})
        assert "no sandbox session" in json.dumps(reply)
    finally:
        await nc.close()
        a.stop()
