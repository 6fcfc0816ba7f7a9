"""The rollout worker's `[tools]` wiring against a real tool-service process and nats-server.

With `transport = "nats"` the worker's sampler plays `lookup` groups whose `get` calls are
answered by the tool-service replica (visible in each tool event's `served_by`); with the
default `local` they run in the worker and the events say nothing of a replica. A worker told to
use remote tools without a NATS url to reach them fails before loading its model, naming the key.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from tool_replicas import ToolReplica

from slipstream.bus import BusConfig
from slipstream.engine import ByteTokenizer
from slipstream.engine.interface import GenerationRequest
from slipstream.envs import get_env, task_of
from slipstream.rollout_worker.config import RolloutWorkerConfig, WorkerSection
from slipstream.rollout_worker.sampler import Sampler
from slipstream.rollout_worker.service import RolloutWorkerService
from slipstream.runtime.section import ServiceSection
from slipstream.stack import Server
from slipstream.supervised import ScriptedEngine
from slipstream.toolcalls import ToolCall, ToolsConfig

pytestmark = pytest.mark.integration

TOK = ByteTokenizer()
SALT = {"salt": "worker-test"}


def _config(url: str, transport: str) -> RolloutWorkerConfig:
    return RolloutWorkerConfig(
        service=ServiceSection(run_id="tools", replica="w0"),
        bus=BusConfig(url=url),
        worker=WorkerSection(max_tokens=64, env_options={"lookup": SALT}),
        tools=ToolsConfig(transport=transport, reply_margin_s=0.5),  # type: ignore[arg-type]
    )


def _expert_engine() -> ScriptedEngine:
    env = get_env("lookup", **SALT)

    def reply(request: GenerationRequest, context: str) -> str:
        # One engine for every task: lookup's expert reads all it needs (the key, the result) from the context.
        return env.expert(None, context)  # type: ignore[arg-type]

    return ScriptedEngine(TOK, reply)


@pytest.mark.parametrize("transport", ["nats", "local"])
async def test_worker_sends_tool_calls_where_its_config_says(
    transport: str, nats_server: Server, tmp_path: Path
) -> None:
    replica = ToolReplica("w-tools", nats_server.url, tmp_path, sets=["lookup"], options={"lookup": SALT})
    replica.wait_ready()
    svc = RolloutWorkerService(_config(nats_server.url, transport))
    try:
        tools = None
        if transport == "nats":
            await svc._connect_tools()
            tools = svc._remote_tools
        sampler = Sampler(_expert_engine(), TOK, svc.cfg.worker, worker_id=svc.worker_id, run_id="tools", tools=tools)
        env = sampler.env("lookup")
        tasks = [t.to_task(run_id="tools", group_size=3) for t in env.generate("train", 4, seed=5)]
        episodes = [e for t in tasks for e in await sampler.sample(t)]
    finally:
        await svc.close()
        handled = replica.status()["handled"]
        replica.stop()
    assert len(episodes) == 12
    assert all(env.score(task_of(e), e).correct and not e.infra_error for e in episodes)
    events = [ev for e in episodes for ev in e.tool_log]
    assert len(events) == 12
    if transport == "nats":
        assert {ev.info.get("served_by") for ev in events} == {replica.served_by}
        assert handled == 12 and svc.tool_stats == {"calls": 12, "retries": 0, "unavailable": 0}
    else:
        assert {ev.info.get("served_by") for ev in events} == {None}
        assert handled == 0


async def test_remote_tools_without_a_nats_url_fail_before_the_model_loads() -> None:
    cfg = _config("nats://unused:4222", "nats")
    cfg.bus = BusConfig(type="memory", url="memory://x")
    svc = RolloutWorkerService(cfg)
    with pytest.raises(ValueError, match=r"\[tools\] url"):
        await svc.setup()
    assert svc.engine is None


async def test_the_local_stack_starts_the_tool_service_replicas_a_run_asks_for(tmp_path: Path) -> None:
    from slipstream.stack.local import Stack
    from slipstream.stack.spec import StackSpec
    from slipstream.toolcalls.remote import NatsTransport

    env = {"SLIPSTREAM_SERVE__SETS": '["lookup"]', "SLIPSTREAM_SERVE__OPTIONS": '{"lookup": {"salt": "worker-test"}}'}
    spec = StackSpec(run_dir=tmp_path / "run", services=(), tool_services=2, env=env, drain_timeout_s=5.0)
    with Stack(spec) as stack:
        stack.wait_ready(60)
        assert sorted(stack.services) == ["tool-service", "tool-service-2"]
        lookup = get_env("lookup", **SALT)
        # Calling as a rollout worker would: the stack's NATS has one user per service.
        as_worker = stack.service_bus("rollout-worker").nats_options()
        t = await NatsTransport.connect(
            stack.servers["nats"].url, lookup.registry, name="stack-test", options=as_worker
        )  # type: ignore[attr-defined]
        try:
            results = [await t.invoke(_get(i)) for i in range(40)]
        finally:
            await t.close()
        codes = stack.stop()
    assert [r.text for r in results] == [lookup.value(str(i)) for i in range(40)]  # type: ignore[attr-defined]
    # The queue group spreads the calls over both replicas (40 calls all on one: p = 2 * 2**-40).
    assert len({r.served_by for r in results}) == 2
    assert codes == {"tool-service": 0, "tool-service-2": 0}


def _get(i: int) -> ToolCall:
    return ToolCall(id=f"stack-{i}", name="get", arguments={"key": str(i)})


async def test_with_no_replica_up_the_episode_is_masked_never_the_models_fault(nats_server: Server) -> None:
    from slipstream.reward_model.scorer import Scorer

    svc = RolloutWorkerService(_config(nats_server.url, "nats"))
    svc.cfg.tools.retry_backoff_s = 0.01
    try:
        await svc._connect_tools()
        sampler = Sampler(
            _expert_engine(), TOK, svc.cfg.worker, worker_id=svc.worker_id, run_id="tools", tools=svc._remote_tools
        )
        task = sampler.env("lookup").generate("train", 1, seed=3)[0].to_task(run_id="tools", group_size=2)
        episodes = await sampler.sample(task)
    finally:
        await svc.close()
    # The expert reads an error result and calls again (lookup's teacher retries after an error),
    # so an episode may hold up to max_calls unanswered calls: each one retried twice, none answered.
    calls = sum(len(e.tool_log) for e in episodes)
    assert calls >= len(episodes)
    assert svc.tool_stats == {"calls": calls, "retries": 2 * calls, "unavailable": calls}
    for e in episodes:
        for event in e.tool_log:
            assert (event.status, event.info["kind"], event.info["attempts"]) == ("infra_error", "unavailable", "3")
        assert e.infra_error.startswith("get: error: tool get unavailable (no responders")
        assert "invalid_tool_call" not in e.counts  # not the model's fault: no tag, no penalty
        scored, score = Scorer({"lookup": SALT}).score(e, now=0.0)
        # Passed on unjudged (the learner drops it as infra_error), not graded as a wrong answer.
        assert (scored.reward, scored.components) == (0.0, {}) and score.reason.startswith("infra_error: get:")
