"""The chaos suite's plans: which envs get tool-service replicas, how `search` is sized, and that the
replicas a search run starts serve the workers' own tools (same corpus, same backend, same answers)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from slipstream.chaos.suite import CHAOS_PLANS, SCHEDULES, SEARCH_GREP_OPTIONS, chaos_plan, env_tools
from slipstream.envs import get_env
from slipstream.rollout_worker.config import RolloutWorkerConfig
from slipstream.run import service_env
from slipstream.run.presets import demo_plan
from slipstream.runtime.config import resolve
from slipstream.tool_service.config import ToolServiceConfig
from slipstream.tool_service.toolsets import ToolSetError, build_registry
from slipstream.toolcalls import LocalTransport, ToolCall

pytestmark = pytest.mark.unit


def test_envs_whose_tools_can_run_in_the_tool_service_get_two_replicas() -> None:
    assert env_tools("reverse", {}) == []
    assert env_tools("lookup", {}) == ["get"]
    assert set(env_tools("search", demo_plan("search").env_options)) == {
        "search_corpus",
        "grep_corpus",
        "read_document",
    }
    replicas = {env: chaos_plan(env, 10, None, None).tool_service_replicas for env in ("reverse", "lookup", "search")}
    assert replicas == {"reverse": 0, "lookup": 2, "search": 2}
    assert chaos_plan("search", 10, None, 0).tool_service_replicas == 0
    assert chaos_plan("reverse", 10, None, 3).tool_service_replicas == 3


def test_the_reverse_chaos_plan_is_the_demo_with_the_suites_eval_settings() -> None:
    plan, demo = chaos_plan(None, 45, 3, None), demo_plan("reverse")
    assert (plan.env, plan.max_steps, plan.seed, plan.eval_every) == ("reverse", 45, 3, 0)
    assert (plan.heldout_tasks, plan.heldout_samples, plan.train_eval_tasks) == (32, 1, 0)
    assert (plan.sft_steps, plan.group_size, plan.groups_per_step, plan.lr) == (
        demo.sft_steps,
        demo.group_size,
        demo.groups_per_step,
        demo.lr,
    )


def test_the_search_chaos_plan_is_sized_for_two_loaded_cores() -> None:
    plan, demo = chaos_plan("search", 30, None, None), demo_plan("search")
    for name, value in CHAOS_PLANS["search"].items():
        assert getattr(plan, name) == value, name
    # The env, tools and expert of the first search plan (whose 500-step warm-start gives varied
    # groups; the demo's multi-hop pruning plan needs far more): the demo's backend, a smaller run.
    assert plan.env_options == SEARCH_GREP_OPTIONS and plan.loss == demo.loss == "cispo"
    assert demo.env_options["backend"] == SEARCH_GREP_OPTIONS["backend"] == "bm25"
    assert plan.sft_settle_steps == 0 and plan.sft_target_sampled == 0
    # The warm-start runs its fixed length (no probe: the demo's greedy probe never reaches its target).
    assert plan.sft_target_accuracy == 0 and plan.sft_steps >= 400
    # A step's rollouts are a fraction of the demo's, and the learner moves the policy less.
    assert plan.group_size * plan.groups_per_step * 2 <= demo.group_size * demo.groups_per_step
    assert plan.group_size >= 4 and plan.lr < demo.lr
    assert plan.max_steps == 30 and plan.eval_every == 0 and plan.heldout_tasks <= 32 and plan.heldout_samples == 1
    # By default 40 steps one apart: the 12 faults need ~30 at --gap 1, and the corrupt fault a
    # version right before a keyframe (every 10) still to come.
    assert SCHEDULES["search"] == (40, 1) and "reverse" not in SCHEDULES


def test_the_replicas_of_a_search_run_serve_the_workers_tools_from_the_same_corpus(tmp_path: Path) -> None:
    plan = chaos_plan("search", 30, None, None)
    environ = service_env(plan, tmp_path / "m", tmp_path / "s", tmp_path / "o.jsonl")
    worker = resolve(RolloutWorkerConfig, environ=environ)
    served = resolve(ToolServiceConfig, environ=environ)
    assert worker.tools.transport == "nats"
    assert served.serve.sets == ["search"]
    assert (
        served.serve.options
        == {"search": {"env": plan.env_options}}
        == {"search": {"env": worker.worker.env_options["search"]}}
    )
    registry = build_registry(served.serve.sets, served.serve.options, store=served.store)
    env = get_env("search", **plan.env_options)
    assert registry.names == env.registry.names  # type: ignore[attr-defined]
    task = env.generate("train", 1, 0)[0]
    target = task.metadata["targets"].split()[0]
    decade = next(w for w in task.metadata["question"].split() if w.endswith("0s"))[:3]
    calls = [
        ToolCall(id="g", name="grep_corpus", arguments={"pattern": f"from {decade}", "_budget": 400}),
        ToolCall(id="s", name="search_corpus", arguments={"query": task.metadata["queries"], "_budget": 400}),
        ToolCall(id="r", name="read_document", arguments={"doc_id": target, "_budget": 400}),
    ]

    async def answers(transport: LocalTransport) -> list[tuple[str, str]]:
        out = []
        for call in calls:
            result = await transport.invoke(call)
            out.append((result.outcome, result.text))
        return out

    here = asyncio.run(answers(LocalTransport(env.registry)))  # type: ignore[attr-defined]
    there = asyncio.run(answers(LocalTransport(registry)))
    assert here == there and all(outcome == "ok" for outcome, _ in here), here
    assert f'<chunk id="{target}#0">' in here[0][1] and f'<chunk id="{target}#0">' in here[2][1], here


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"env": {"backend": "bm25"}, "index": "indexes/x"}, r"takes that one option.*got options \['env', 'index'\]"),
        ({"env": "bm25"}, "takes that one option, a table"),
        ({"env": {"colour": "red"}}, "tool set 'search'.*colour"),
        ({"env": {"backend": "no-such-backend"}}, "its backend cannot be built.*no-such-backend"),
    ],
)
def test_a_bad_search_env_tool_set_is_refused_naming_what_is_wrong(options: dict, message: str) -> None:  # type: ignore[type-arg]
    with pytest.raises(ToolSetError, match=message):
        build_registry(["search"], {"search": options})
