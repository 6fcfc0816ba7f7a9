"""The swarm's accounting (issue 32): one critical step per orchestrator turn, malformed calls
counted, `parallel` over distinct sub-agents with finished work, `finish` refusing empty results.

Each test plays scripted episodes through the real harness (test_swarm_env's `play`) and checks
the episode's counts and the score's components by hand.
"""

from __future__ import annotations

import pytest
from test_swarm_env import call, env, grep, play

from slipstream.envs.swarm import Ledger
from slipstream.envs.swarm.tasks import items_of

pytestmark = pytest.mark.unit


async def test_calls_issued_together_in_one_turn_cost_one_step() -> None:
    e = env(mode="single", max_critical_steps=10, wide_min=3, wide_max=3)
    t = e.generate("train", 1, seed=0)[0]
    together = await play(e, t, [grep("a") + grep("b") + grep("c") + "\n", "<docs>x</docs>\n"])
    apart = await play(e, t, [grep("a") + "\n", grep("b") + "\n", grep("c") + "\n", "<docs>x</docs>\n"])
    # the same three greps: one turn (1 step) + the answer, against three turns + the answer
    assert together.counts["critical_steps"] == 2 and apart.counts["critical_steps"] == 4
    # the work is the same: three calls and the answer's turn
    assert together.counts["total_steps"] == apart.counts["total_steps"] == 4
    assert [ev.status for ev in together.tool_log] == ["ok", "ok", "ok"]


async def test_a_malformed_call_costs_its_turn_and_is_counted() -> None:
    e = env(mode="single", max_critical_steps=10, wide_min=2, wide_max=2)
    t = e.generate("train", 1, seed=0)[0]
    bad_json = '<tool>{"name": "grep_corpus", "args": </tool>'
    unknown = call("assign_task", agent="a", prompt="q")  # no swarm tools in single mode
    ep = await play(e, t, [bad_json + "\n", unknown + grep("a") + "\n", "<docs>x</docs>\n"])
    assert ep.counts["malformed_calls"] == 2
    # three turns, one step each; work: the malformed-only turn 1, the grep 1, the answer 1
    assert ep.counts["critical_steps"] == 3 and ep.counts["total_steps"] == 3
    assert sorted(ev.status for ev in ep.tool_log) == ["invalid_tool_call", "invalid_tool_call", "ok"]
    # a turn of malformed calls alone still spends the budget: two of them and no step is left
    tight = env(mode="single", max_critical_steps=2, wide_min=2, wide_max=2)
    cut = await play(tight, t, [bad_json + "\n", bad_json + "\n", "<docs>x</docs>\n"])
    assert cut.finish_reason == "critical_steps" and cut.final_text == ""
    assert cut.counts["malformed_calls"] == 2 and cut.counts["critical_steps"] == 2
    ledger = Ledger()
    ledger.add(0, malformed=2)
    assert (ledger.critical, ledger.total, ledger.malformed) == (1, 1, 2)


async def test_parallel_counts_distinct_sub_agents_with_finished_work() -> None:
    e = env(max_critical_steps=20, wide_min=4, wide_max=4, parallel_cap=4, turn_tokens=4096)
    t = e.generate("train", 1, seed=3)[0]
    q = [it.question for it in items_of(t.metadata)]

    def sub(context: str) -> str:
        return "<docs>x</docs>\n"

    one = call("create_subagent", name="a", system_prompt="find") + "".join(
        call("assign_task", agent="a", prompt=x) for x in q
    )
    ep = await play(e, t, [one + "\n", "<docs>x</docs>\n"], sub)
    assert ep.counts["subagents"] == 4 and ep.counts["parallel_agents"] == 1
    assert e.score(t, ep).components["parallel"] == 1 / 4  # one sub-agent given four tasks: 1, not 4
    four = "".join(call("create_subagent", name=f"a{i}", system_prompt="find") for i in range(4))
    four += "".join(call("assign_task", agent=f"a{i}", prompt=x) for i, x in enumerate(q))
    ep4 = await play(e, t, [four + "\n", "<docs>x</docs>\n"], sub)
    assert ep4.counts["parallel_agents"] == 4 and e.score(t, ep4).components["parallel"] == 1.0
    # a sub-agent that returns nothing finished is not counted, however many it was given
    ep2 = await play(e, t, [four + "\n", "<docs>x</docs>\n"], lambda c: sub(c) if q[0] in c else "<docs></docs>\n")
    assert ep2.counts["parallel_agents"] == 1 and e.score(t, ep2).components["parallel"] == 1 / 4


async def test_an_empty_result_does_not_finish_its_subtask() -> None:
    e = env(max_critical_steps=20, wide_min=2, wide_max=2)
    t = e.generate("train", 1, seed=0)[0]
    q = [it.question for it in items_of(t.metadata)]
    line = call("create_subagent", name="a", system_prompt="find") + "".join(
        call("assign_task", agent="a", prompt=x) for x in q
    )
    empty = await play(e, t, [line + "\n", "<docs>x</docs>\n"], lambda c: "<docs></docs>\n")
    assert empty.counts["subagents"] == 2 and empty.counts["subagents_finished"] == 0
    s = e.score(t, empty)
    assert s.components["finish"] == 0.0 and s.components["parallel"] == 0.0
    assert empty.counts["spurious_parallel"] == 1  # "a" was created and finished nothing
    half = await play(
        e, t, [line + "\n", "<docs>x</docs>\n"], lambda c: "<docs>d1</docs>\n" if q[0] in c else "no docs\n"
    )
    assert half.counts["subagents_finished"] == 1 and e.score(t, half).components["finish"] == 1 / 2
