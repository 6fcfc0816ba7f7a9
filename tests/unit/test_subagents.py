"""Frozen sub-agents: a spawn played in place and the same spawn played by a pool give the same episode.

The pool's side here is `play_subagent` behind an in-memory `SubagentTransport` that round-trips
request and reply through the wire codec (the NATS pool is tests/integration/test_subagent_pool.py).
An orchestrator env spawns several `lookup` children at once (each calls the `get` tool once and
answers); the engines are scripted with lookup's expert, so both runs sample the same tokens:

- local: children run on `frozen_engine` (its version, not the live engine's, is on their tokens);
- pooled: the merged episode has the same samples (renumbered contiguously, `branch_of` fixed),
  trainable False, role 'subagent', the child's agent id on samples and tool events, counts
  added, and `spawn` returns the child's Outcome with steps = 1 call + 1 answer turn = 2;
- a pool that cannot serve: the episode carries an infra error (masked), spawn says 'infra_error'.
"""

from __future__ import annotations

import asyncio
import re
from typing import Any, ClassVar

import msgspec
import pytest

from slipstream.engine import ByteTokenizer, SamplingParams
from slipstream.engine.interface import GenerationRequest
from slipstream.envs import EpisodeContext, Outcome, Score, TaskSpec, get_env
from slipstream.envs.base import Environment, Problem
from slipstream.harness import play_subagent, rollout_episodes
from slipstream.harness.subagents import SUBAGENT_TOOL, child_steps
from slipstream.schemas import Episode, SubagentReply, SubagentRequest, ToolEvent, decode, encode
from slipstream.supervised import ScriptedEngine

pytestmark = pytest.mark.unit

TOK = ByteTokenizer()
LOOKUP = get_env("lookup")
CHILD_TASKS = LOOKUP.generate("train", 4, seed=3)
_KEY = re.compile(r"key ([^?\n]*)\?")


def _reply(_: GenerationRequest, context: str) -> str:
    found = _KEY.search(context)
    if found is None:
        return "done\n"  # the orchestrator's own turns
    task = next(t for t in CHILD_TASKS if f"key {found.group(1)}?" in t.prompt)
    return LOOKUP.expert(task, context)


class _Orchestrator(Environment[msgspec.Struct]):
    """One turn, then every child task assigned at once; the answers come back as observations."""

    name: ClassVar[str] = "t-orchestrator"

    class Options(msgspec.Struct, frozen=True):
        pass

    components: ClassVar[tuple[str, ...]] = ("correct",)

    def sample(self, rng: Any) -> Problem:
        return Problem(key="k", prompt="plan:", reference="")

    def grade(self, task: TaskSpec, completion: str) -> Score:
        return Score.of({"correct": 0.0}, correct=False, parse_ok=True, reason="")

    async def run(self, ctx: EpisodeContext) -> Outcome:
        root = ctx.open(ctx.task.prompt)
        await ctx.generate(root, max_tokens=8)
        outcomes = await asyncio.gather(*(ctx.spawn(LOOKUP, t, agent_id=f"sub{i}") for i, t in enumerate(CHILD_TASKS)))
        ctx.observe(root, "".join(f"[{o.final_text.strip()}|{o.steps}|{o.finish_reason}]" for o in outcomes))
        last = await ctx.generate(root, max_tokens=8)
        self.outcomes = list(outcomes)
        return Outcome(final_text=root.completion_text(), finish_reason=last.finish_reason)


class LoopbackPool:
    """`SubagentTransport` in this process: the pool's own `play_subagent`, through the wire codec."""

    def __init__(self, engine: ScriptedEngine, *, fail: bool = False) -> None:
        self.engine = engine
        self.fail = fail
        self.requests: list[SubagentRequest] = []

    async def run(self, request: SubagentRequest) -> SubagentReply:
        request = decode(encode(request), SubagentRequest)
        self.requests.append(request)
        if self.fail:
            return SubagentReply(request_id=request.request_id, error="sub-agent pool unavailable (test)")
        reply = await play_subagent(self.engine, TOK, request, worker_id="pool/0")
        return decode(encode(reply), SubagentReply)


async def _play(**kwargs: Any) -> tuple[Episode, list[Outcome]]:
    env = _Orchestrator()
    task = env.generate("train", 1, seed=0)[0]
    live = ScriptedEngine(TOK, _reply, policy_version=5)
    params = SamplingParams(temperature=0.0, max_tokens=64, seed=1)
    (episode,) = await rollout_episodes(live, TOK, env, task, group_size=1, params=params, group_id="g", **kwargs)
    return episode, env.outcomes


def _by_agent(e: Episode) -> dict[str, list[bytes]]:
    out: dict[str, list[bytes]] = {}
    for s in e.samples:
        out.setdefault(s.agent_id, []).append(s.token_ids)
    return out


async def test_local_and_pooled_subagents_give_the_same_episode() -> None:
    local, local_outcomes = await _play(frozen_engine=ScriptedEngine(TOK, _reply, policy_version=2))
    pool = LoopbackPool(ScriptedEngine(TOK, _reply, policy_version=2))
    pooled, pooled_outcomes = await _play(subagents=pool)

    assert len(pool.requests) == len(CHILD_TASKS)
    assert sorted(r.request_id for r in pool.requests) == [f"g/0/sub{i}" for i in range(len(CHILD_TASKS))]
    assert {r.env for r in pool.requests} == {"lookup"}
    assert len({r.seed for r in pool.requests}) == len(CHILD_TASKS)  # spawned in one turn, seeded apart
    for e in (local, pooled):
        assert [s.sample_id for s in e.samples] == ["g/0"] + [f"g/0/s{i}" for i in range(1, len(e.samples))]
        root, *children = e.samples
        assert root.trainable and root.agent_id == "policy" and root.versions() == [5]
        assert len(children) == len(CHILD_TASKS)
        for child in children:
            assert (child.role, child.trainable) == ("subagent", False)
            assert child.versions() == [2]  # the frozen engine's version, never the live one
        # One `get` call per child, recorded under the child's agent id on one of its own samples.
        owner = {s.sample_id: s.agent_id for s in e.samples}
        assert sorted(ev.agent_id for ev in e.tool_log) == sorted(f"sub{i}" for i in range(len(CHILD_TASKS)))
        assert all(owner[ev.sample_id] == ev.agent_id and ev.status == "ok" for ev in e.tool_log)
        assert e.counts["subagents"] == len(CHILD_TASKS) and e.counts["tool_calls"] == len(CHILD_TASKS)
        assert e.counts["turns"] == 2 + 2 * len(CHILD_TASKS)
        assert e.infra_error == ""
    # The same tokens per agent, whichever side played them (children may finish in any order).
    assert _by_agent(local) == _by_agent(pooled)
    for outcomes in (local_outcomes, pooled_outcomes):
        assert [o.steps for o in outcomes] == [2] * len(CHILD_TASKS)
        assert [o.final_text.strip() for o in outcomes] == [t.reference for t in CHILD_TASKS]
    assert local.final_text == pooled.final_text


async def test_pool_failure_is_an_infra_error_on_the_parent() -> None:
    pool = LoopbackPool(ScriptedEngine(TOK, _reply), fail=True)
    episode, outcomes = await _play(subagents=pool)
    assert [o.finish_reason for o in outcomes] == ["infra_error"] * len(CHILD_TASKS)
    assert len(episode.samples) == 1  # only the orchestrator's own sample
    failed = [ev for ev in episode.tool_log if ev.name == SUBAGENT_TOOL]
    assert len(failed) == len(CHILD_TASKS) and all(ev.status == "infra_error" for ev in failed)
    assert episode.infra_error.startswith(f"{SUBAGENT_TOOL}: sub-agent pool unavailable")
    assert episode.counts["subagent_errors"] == len(CHILD_TASKS)


async def test_a_pooled_reply_with_branches_is_renumbered_into_the_parent() -> None:
    # A child whose second sample branches off its first: ids and the link move together.
    request = SubagentRequest(request_id="e/sub", env="lookup", agent_id="sub")
    first = _sample("e/sub", "")
    second = _sample("e/sub/s1", "e/sub")
    reply = SubagentReply(
        request_id=request.request_id,
        samples=[first, second],
        tool_log=[ToolEvent(sample_id="e/sub/s1", turn=1, name="get")],
        counts={"turns": 2},
        final_text="7",
        steps=2,
    )
    from slipstream.harness import EpisodeState, merge_reply

    state = EpisodeState(episode_id="p")
    state.samples.append(_builder("p"))
    out = merge_reply(TOK, state, reply, agent_id="sub")
    assert [s.sample_id for s in state.samples] == ["p", "p/s1", "p/s2"]
    assert state.samples[2].branch_of == "p/s1" and state.samples[1].branch_of == ""
    assert [(ev.sample_id, ev.agent_id) for ev in state.tool_log] == [("p/s2", "sub")]
    assert state.counts == {"turns": 2} and (out.final_text, out.steps) == ("7", 2)
    assert state.samples[1].ids() == first.ids() and not state.samples[1].trainable


def test_steps_are_calls_plus_turns_without_a_call() -> None:
    events = [ToolEvent(sample_id="s", turn=t) for t in (0, 0, 2)]
    assert child_steps([0, 1, 2, 3], events) == 3 + 2  # turns 1 and 3 made no call
    assert child_steps([0], []) == 1


def _sample(sample_id: str, branch_of: str) -> Any:
    from slipstream.schemas import Sample, pack_floats, pack_ids, pack_mask

    return Sample(
        sample_id=sample_id,
        agent_id="sub",
        role="subagent",
        trainable=False,
        prompt_len=2,
        token_ids=pack_ids([1, 2, 3]),
        logprobs=pack_floats([-0.5]),
        loss_mask=pack_mask([1]),
        branch_of=branch_of,
        branch_pos=1 if branch_of else 0,
    )


def _builder(sample_id: str) -> Any:
    from slipstream.harness import SampleBuilder

    return SampleBuilder(
        sample_id=sample_id, agent_id="policy", role="policy", trainable=True, prompt=[1], tokenizer=TOK
    )
