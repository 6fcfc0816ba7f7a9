"""The `swarm` environment (issue 15): critical steps, the budget, reward components, modes, tasks.

Episodes run through the real harness (`rollout_episodes`, a `Recorder` per agent) with a
`ScriptedEngine` replaying fixed model lines for the orchestrator and for each sub-agent (told
apart by their prompts), and the byte tokenizer. The search backend is tests/unit/search_backend.py's
deterministic "terms" backend: retrieval quality is not under test, the orchestration is.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from typing import Any

import pytest
import search_backend  # noqa: F401  (registers the "terms" backend)

from slipstream.engine import ByteTokenizer, SamplingParams
from slipstream.envs import get_env
from slipstream.envs.base import TaskSpec
from slipstream.envs.swarm import Ledger, Stage, Swarm
from slipstream.envs.swarm import tasks as tk
from slipstream.envs.swarm.tasks import HEADER, items_of
from slipstream.harness import RecordingEngine, rollout_episodes, token_problems
from slipstream.schemas import Episode
from slipstream.supervised import ScriptedEngine, expert_examples

pytestmark = pytest.mark.unit

TOK = ByteTokenizer()
SEARCH = {"backend": "terms", "max_hops": 1, "tasks_per_domain": 24, "tools_line": False, "max_turns": 6}


def env(search: dict[str, Any] | None = None, **options: Any) -> Swarm:
    e = get_env("swarm", search={**SEARCH, **(search or {})}, **options)
    assert isinstance(e, Swarm)
    return e


def call(tool: str, **args: Any) -> str:
    return "<tool>" + json.dumps({"name": tool, "args": args}) + "</tool>"


def grep(pattern: str) -> str:
    return call("grep_corpus", pattern=pattern)


Script = Callable[[str], str]


async def play(e: Swarm, t: TaskSpec, orchestrator: list[str] | None, sub: Script | None = None) -> Episode:
    """One episode: `orchestrator` lines in order (None: the env's expert for every agent); `sub`
    maps a sub-agent's context to its next line."""
    lines = iter(orchestrator or [])

    def reply(_req: Any, context: str) -> str:
        if orchestrator is None:
            return e.expert(t, context)
        if HEADER in context:
            return next(lines, "<docs></docs>\n")
        assert sub is not None
        return sub(context)

    engine = RecordingEngine(ScriptedEngine(TOK, reply, max_seq_len=1 << 16))
    params = SamplingParams(temperature=1.0, max_tokens=4096)
    (episode,) = await rollout_episodes(engine, TOK, e, t, group_size=1, params=params, group_id=f"g-{t.task_id}")
    assert token_problems(episode, engine.calls_of(episode), TOK) == []
    return episode


def calls_made(context: str) -> int:
    return context.count("<tool>")


def sub_by_question(steps: dict[str, int]) -> Script:
    """A sub-agent that makes `steps[q] - 1` greps (one per turn), then answers `<docs>x</docs>`."""

    def reply(context: str) -> str:
        q = next(q for q in steps if q in context)
        return grep("zzz") + "\n" if calls_made(context) < steps[q] - 1 else "<docs>x</docs>\n"

    return reply


def test_stage_arithmetic() -> None:
    ledger = Ledger()
    ledger.add(0)
    assert (ledger.critical, ledger.total) == (1, 1)
    ledger.add(3, [2, 5])  # three direct calls run together: one step of time, three of work
    assert (ledger.critical, ledger.total) == (1 + 1 + 5, 1 + 3 + 2 + 5)
    assert Stage(direct=0, subagents=()).critical == 1
    with pytest.raises(ValueError, match="step counts"):
        Stage(direct=-1)


async def test_a_serial_episode_has_critical_steps_equal_to_total_steps() -> None:
    e = env(mode="single", max_critical_steps=10, wide_min=3, wide_max=3)
    t = e.generate("train", 1, seed=0)[0]
    ep = await play(e, t, [grep("a") + "\n", grep("b") + grep("c") + "\n", "<docs>x</docs>\n"])
    assert ep.finish_reason == "stop"
    # turns: 1 direct call, 2 direct calls run together (1 step of time, 2 of work), the answer (1)
    assert ep.counts["critical_steps"] == 1 + 1 + 1
    assert ep.counts["total_steps"] == 1 + 2 + 1
    assert ep.counts["subagents"] == 0 and ep.counts["serial_collapse"] == 0  # single mode never collapses


async def test_a_parallel_episode_costs_the_sum_of_stage_maxima() -> None:
    e = env(max_critical_steps=20, wide_min=3, wide_max=3)
    t = e.generate("train", 1, seed=0)[0]
    q = [it.question for it in items_of(t.metadata)]
    lines = [
        call("create_subagent", name="a", system_prompt="find")
        + call("assign_task", agent="a", prompt=q[0])
        + call("assign_task", agent="a", prompt=q[1])
        + "\n",
        call("assign_task", agent="a", prompt=q[2]) + grep("x") + grep("y") + "\n",
        "<docs>x</docs>\n",
    ]
    ep = await play(e, t, lines, sub_by_question({q[0]: 2, q[1]: 4, q[2]: 1}))
    # stage 1: 1 + max(2, 4); stage 2: 1 (two direct calls run together) + 1; the answer: 1
    assert ep.counts["critical_steps"] == (1 + 4) + (1 + 1) + 1
    assert ep.counts["total_steps"] == (1 + 2 + 4) + (2 + 1) + 1
    assert ep.counts["subagents"] == 3 and ep.counts["subagents_finished"] == 3
    assert ep.counts["parallel_agents"] == 1  # three assignments, one sub-agent
    subs = [s for s in ep.samples if s.role == "subagent"]
    assert subs and not any(s.trainable for s in subs)
    # the orchestrator saw only each sub-agent's final message, as that call's result
    root = ep.samples[0]
    assert "<result><docs>x</docs></result>" in TOK.decode(root.ids())
    assert "zzz" not in TOK.decode(root.ids()).split(HEADER)[-1].replace(grep("zzz"), "")


async def test_reward_components_are_named_raw_and_sum_to_the_reward() -> None:
    e = env(max_critical_steps=20, wide_min=4, wide_max=4, parallel_cap=8)
    t = e.generate("train", 1, seed=3)[0]
    q = [it.question for it in items_of(t.metadata)]
    need = t.reference.split()
    lines = [
        call("create_subagent", name="a", system_prompt="find")
        + call("create_subagent", name="idle", system_prompt="nothing")
        + "".join(call("assign_task", agent="a", prompt=x) for x in q[:2])
        + "\n",
        f"<docs>{need[0]} {need[2]} 999</docs>\n",
    ]
    # the second sub-agent never answers: unfinished
    ep = await play(e, t, lines, lambda c: "<docs>x</docs>\n" if q[0] in c else grep("zzz") + "\n")
    s = e.score(t, ep)
    assert set(s.components) == {"perf", "parallel", "finish"}
    # parallel: one sub-agent ("a") returned finished work, whatever it was assigned
    assert s.components == {"perf": 2 / 4, "parallel": 1 / 8, "finish": 1 / 2}
    assert s.reward == pytest.approx(sum(s.components.values()))
    assert not s.correct and s.parse_ok
    assert ep.counts["spurious_parallel"] == 1  # "idle" was created and finished nothing
    # text-only grading: the verifier alone
    text = e.score(t, f"<docs>{' '.join(need)}</docs>\n")
    assert text.correct and text.components == {"perf": 1.0, "parallel": 0.0, "finish": 0.0}
    # no answer: perf 0, not parsed, the auxiliary terms kept
    assert e.grade(t, "no docs").components["perf"] == 0.0


async def test_the_critical_step_budget_ends_the_episode_unanswered() -> None:
    e = env(mode="single", max_critical_steps=4, wide_min=5, wide_max=5)
    t = e.generate("train", 1, seed=0)[0]
    ep = await play(e, t, [grep(f"g{i}") + "\n" for i in range(10)])
    assert ep.finish_reason == "critical_steps" and ep.final_text == ""
    assert ep.counts["critical_steps"] == 4  # the 4th call left no step for the answer
    s = e.score(t, ep)
    assert s.components["perf"] == 0.0 and not s.parse_ok
    # the step line shows the budget after every turn
    assert "[Steps: 3/4]" in TOK.decode(ep.samples[0].ids())


async def test_single_mode_has_no_swarm_tools() -> None:
    single, swarm = env(mode="single", max_critical_steps=10), env(max_critical_steps=10)
    assert "assign_task" not in single.model_registry.names and "create_subagent" not in single.model_registry.names
    assert {"assign_task", "create_subagent"} <= set(swarm.model_registry.names)
    t = single.generate("train", 1, seed=0)[0]
    # the same items; single mode's prompt opens with its mode token (issue 32)
    assert t.prompt == "[single]\n" + swarm.generate("train", 1, seed=0)[0].prompt
    line = call("create_subagent", name="a", system_prompt="x") + call("assign_task", agent="a", prompt="q") + "\n"
    ep = await play(single, t, [line, "<docs>x</docs>\n"], lambda c: "<docs>x</docs>\n")
    assert ep.counts["subagents"] == 0 and len(ep.samples) == 1
    assert [ev.status for ev in ep.tool_log] == ["invalid_tool_call", "invalid_tool_call"]


def test_tasks_are_deterministic_and_split_by_task_key() -> None:
    e = env(wide_min=2, wide_max=4)
    a, b = e.generate("train", 40, seed=7), e.generate("train", 40, seed=7)
    assert a == b and e.generate("train", 10, seed=7) == a[:10]
    assert e.generate("train", 40, seed=8) != a
    held = e.generate("heldout", 40, seed=7)
    train_keys, held_keys = {t.metadata["key"] for t in a}, {t.metadata["key"] for t in held}
    assert not train_keys & held_keys
    assert all(e.split_of(k) == "heldout" for k in held_keys) and all(e.split_of(k) == "train" for k in train_keys)
    for t in a:
        items = items_of(t.metadata)
        assert 2 <= len(items) <= 4 and len({it.key for it in items}) == len(items)
        assert t.reference.split() == [d for it in items for d in it.targets]
        assert all(it.question in t.prompt for it in items) and "parallel" not in t.prompt
        # items are the search corpus's train-split tasks, in both splits
        assert all(e.search.split_of(it.key) == "train" for it in items)


async def test_the_expert_is_serial_or_parallel_and_warm_starts_the_sub_agents_too() -> None:
    # The sub-agents' expert greps the clues (one call, then the answer): 2 steps each.
    e = env({"expert_grep": True}, max_critical_steps=4, wide_min=4, wide_max=4, expert_parallel_rate=0.5)
    tasks = e.generate("train", 12, seed=0)
    kinds = set()
    for t in tasks[:6]:
        ep = await play(e, t, None)
        parallel = ep.counts["subagents"] > 0
        kinds.add(parallel)
        s = e.score(t, ep)
        if parallel:  # 1 + 2 (create, assign: a grep and the answer each) + 1 (the answer)
            assert ep.counts["critical_steps"] == 4 and ep.counts["total_steps"] == 1 + 4 * 2 + 1
            assert ep.counts["subagents_finished"] == 4
        else:  # serial: 3 greps, then a partial answer at the last step
            assert ep.counts["critical_steps"] == ep.counts["total_steps"] == 4
            assert ep.counts["serial_collapse"] == 1 and s.components["perf"] <= 0.75
        assert ep.finish_reason == "stop"
    assert kinds == {True, False}
    # the warm-start trains on the orchestrator's samples and the frozen sub-agents' samples
    examples = await asyncio.to_thread(expert_examples, e, TOK, tasks[:6])
    episodes = [await play(e, t, None) for t in tasks[:6]]
    assert len(examples) == sum(len(ep.samples) for ep in episodes) > len(episodes)
    # warmstart_subagent_rows: at most that many sub-agent rows an episode (its first), the
    # orchestrator's rows all kept; -1 (the default) is all of them.
    one = env({"expert_grep": True}, max_critical_steps=4, wide_min=4, wide_max=4, warmstart_subagent_rows=1)
    fewer = await asyncio.to_thread(expert_examples, one, TOK, tasks[:6])
    trainable = [s for ep in episodes for s in ep.samples if s.trainable]
    spawned = sum(1 for ep in episodes if any(not s.trainable for s in ep.samples))
    assert spawned > 0 and len(fewer) == len(trainable) + spawned
    assert all(row in examples for row in fewer)
    with pytest.raises(ValueError, match="warmstart_subagent_rows"):
        env(None, warmstart_subagent_rows=-2)


async def test_deep_tasks_chain_hops_per_branch_and_parallel_beats_serial() -> None:
    e = env({"max_hops": 2, "expert_grep": True}, deep_rate=1.0, deep_branches=3, max_critical_steps=20)
    seen = set()
    for t in e.generate("train", 6, seed=0):
        assert t.metadata["kind"] == "deep" and len(items_of(t.metadata)) == 3
        ep = await play(e, t, None)
        assert e.score(t, ep).correct
        parallel = ep.counts["subagents"] > 0
        seen.add(parallel)
        # a 2-hop branch: grep, search the bridge, answer (3 steps in a sub-agent, 2 calls serially)
        want = 1 + 3 + 1 if parallel else 3 * 2 + 1
        assert ep.counts["critical_steps"] == want
    assert seen == {True, False}


async def test_evaluation_plays_sub_agents_on_the_frozen_engine() -> None:
    from slipstream.harness.evaluate import evaluate

    e = env({"expert_grep": True}, max_critical_steps=4, wide_min=4, wide_max=4, expert_parallel_rate=1.0)
    tasks = e.generate("heldout", 3, seed=0)

    def reply(_req: Any, context: str) -> str:
        t = next(t for t in tasks if any(it.question in context for it in items_of(t.metadata)))
        return e.expert(t, context)

    policy = ScriptedEngine(TOK, reply, max_seq_len=1 << 16)
    frozen = ScriptedEngine(TOK, reply, max_seq_len=1 << 16)
    report = await evaluate(policy, TOK, e, tasks, frozen_engine=frozen)
    assert report.accuracy == 1.0 and report.metrics["subagents"] == 4.0
    assert report.metrics["critical_steps"] == 4.0 and report.metrics["finish_rate"] == 1.0
    assert policy.requests == 3 * 2  # the orchestrator's two turns per task
    assert frozen.requests == 3 * 4 * 2  # four sub-agents a task, a grep and an answer each


async def test_the_fixed_layout_puts_every_copy_one_distance_after_its_source() -> None:
    # The fixed layout: briefs, lines as wide as the call that assigns them, ids spaced as in the
    # observation. Whatever the questions say, every assignment (and every answered id) sits one
    # distance after what it copies, the same for every item of every task.
    e = env(
        # the CPU demo's corpus settings: unique (region, decade) clues, short ids, the decade last
        {
            "expert_grep": True,
            "short_ids": True,
            "fixed_offsets": True,
            "unique_clues": True,
            "regions": 12,
            "min_year": 1000,
            "distractors": 0,
        },
        layout="fixed",
        wide_min=4,
        wide_max=4,
        max_critical_steps=4,
        expert_parallel_rate=1.0,
    )
    assign_gaps, id_gaps = set(), set()
    tasks = e.generate("train", 6, seed=0) + e.generate("heldout", 2, seed=0)
    for t in tasks:
        lines = t.prompt.splitlines()[1:]
        assert len(lines) == 4 and len({len(line) for line in lines}) == 1
        ep = await play(e, t, None)
        s = e.score(t, ep)
        assert s.correct and ep.counts["critical_steps"] == 4 and ep.counts["subagents_finished"] == 4
        text = TOK.decode(ep.samples[0].ids())
        for it in items_of(t.metadata):
            assert len(it.question) == tk.BRIEF_WIDTH and it.question.endswith("0s")
            first = text.index(it.question)
            assign_gaps.add(text.index(it.question, first + 1) - first)
            doc = it.targets[-1]
            returned = text.index(f"<docs>{doc}</docs>")
            answered = text.rindex(doc)
            id_gaps.add(answered - returned)
    assert len(assign_gaps) == 1 and len(id_gaps) == 1, (assign_gaps, id_gaps)


def test_the_fixed_layout_briefs_one_hop_questions_only() -> None:
    q = "What is the chief executive of the mill that lies in a region between mountains and dates from the 1450s?"
    assert tk.brief(q) == "mill: a region between mountains, 1450s".rjust(tk.BRIEF_WIDTH)
    with pytest.raises(ValueError, match="one-hop questions"):
        tk.brief("Who founded the mill?")
    with pytest.raises(ValueError, match="deep_rate 0 and wide_hops 1"):
        env({"max_hops": 2}, layout="fixed", deep_rate=0.5)
    with pytest.raises(ValueError, match="fixed_offsets"):
        env(layout="fixed")
