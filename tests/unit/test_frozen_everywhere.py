"""Frozen sub-agents play on the pinned weights in the eval-gate and the CLI's held-out evaluation
(issue 32), never on the version under evaluation.

The probe env's orchestrator spawns one frozen sub-agent and answers with the sub-agent's final
message, so the answer shows which weights the sub-agent ran on: each scripted engine says its
own version (`v<version>`). The candidate is version 3, the pin version 0.
"""

from __future__ import annotations

import asyncio
import random
from pathlib import Path
from typing import ClassVar

import msgspec
import pytest

from slipstream.engine import ByteTokenizer
from slipstream.envs import EpisodeContext, Outcome, Score, TaskSpec, registry
from slipstream.envs.base import Environment, Problem
from slipstream.eval_gate.config import GateSection
from slipstream.eval_gate.evaluator import Evaluator
from slipstream.eval_gate.suite import Suite
from slipstream.store import LocalObjectStore
from slipstream.supervised import ScriptedEngine

pytestmark = pytest.mark.unit

TOK = ByteTokenizer()
CANDIDATE, PIN = 3, 0


class Probe(Environment[msgspec.Struct]):
    """One orchestrator turn, one frozen sub-agent; the answer is the sub-agent's final message."""

    name: ClassVar[str] = "t-frozen-probe"

    class Options(msgspec.Struct, frozen=True):
        pass

    components: ClassVar[tuple[str, ...]] = ("pinned",)

    def sample(self, rng: random.Random) -> Problem:
        return Problem(key=f"k{rng.randrange(10**9)}", prompt="plan:", reference=f"v{PIN}")

    def grade(self, task: TaskSpec, completion: str) -> Score:
        ok = completion.strip() == task.reference
        return Score.of({"pinned": float(ok)}, correct=ok, parse_ok=True, reason=completion.strip())

    async def run(self, ctx: EpisodeContext) -> Outcome:
        thread = ctx.open(ctx.task.prompt)
        gen = await ctx.generate(thread, max_tokens=8)
        if ctx.task.metadata.get("child"):
            return Outcome(final_text=gen.text, finish_reason=gen.finish_reason)
        child = msgspec.structs.replace(ctx.task, task_id=f"{ctx.task.task_id}/c", metadata={"child": True})
        out = await ctx.spawn(self, child, agent_id="c0", trainable=False)
        return Outcome(final_text=out.final_text, finish_reason="stop")


def says_version(version: int) -> ScriptedEngine:
    engine = ScriptedEngine(TOK, lambda _r, _c: f"v{version}\n", policy_version=version)
    engine.max_batch = 8  # type: ignore[attr-defined]  # what the evaluator sizes its concurrency by
    return engine


@pytest.fixture
def probe(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(registry.ENVIRONMENTS, Probe.name, Probe)


@pytest.mark.usefixtures("probe")
def test_the_eval_gate_plays_sub_agents_on_the_pinned_version(tmp_path: Path) -> None:
    suite = Suite(GateSection(envs=[Probe.name], suite_size=4))
    candidate, pinned = says_version(CANDIDATE), says_version(PIN)
    evaluator = Evaluator(candidate, TOK, suite, LocalObjectStore(tmp_path), "r1", frozen_engine=pinned)  # type: ignore[arg-type]
    details = asyncio.run(evaluator._rollouts(CANDIDATE))
    # every answer is the sub-agent's, and it ran on version 0 while the orchestrator ran on 3
    assert [c for t in details.tasks for c in t.completions] == [f"v{PIN}\n"] * 4
    assert details.score == 1.0 and details.envs[Probe.name].accuracy == 1.0
    assert candidate.requests == 4 and pinned.requests == 4
    # without a frozen engine the sub-agents would run on the candidate: the evaluation refuses
    bare = Evaluator(says_version(CANDIDATE), TOK, suite, LocalObjectStore(tmp_path), "r1")  # type: ignore[arg-type]
    with pytest.raises(RuntimeError, match=r"frozen agents sampled under versions \[3\]"):
        asyncio.run(bare._rollouts(CANDIDATE))


@pytest.mark.usefixtures("probe")
def test_the_held_out_evaluation_plays_sub_agents_on_the_initial_weights(tmp_path: Path) -> None:
    from slipstream.engine import build_tiny, save_pretrained
    from slipstream.engine.frozen import FrozenEngine
    from slipstream.run.heldout import HeldOut
    from slipstream.run.plan import TrainingPlan

    model, tokenizer = build_tiny("micro", seed=0)
    save_pretrained(model, tokenizer, tmp_path / "model")
    plan = TrainingPlan(env="arith", heldout_tasks=4, heldout_samples=1, train_eval_tasks=0, temperature=1.0)
    held = HeldOut(plan, tmp_path / "model")
    # Its frozen engine is a copy of the weights as loaded, refusing any version.
    assert isinstance(held.frozen, FrozenEngine) and held.frozen.policy_version == 0
    assert not held.frozen.started
    with pytest.raises(RuntimeError, match="keeps version 0"):
        held.frozen.apply_weights(1, {})
    # The evaluation routes the sub-agents there: scripted stand-ins show which one ran.
    probe = Probe()
    held.env, held.tasks, held.train_tasks = probe, probe.generate("heldout", 4, seed=0), []
    held.engine, held.frozen = says_version(CANDIDATE), says_version(PIN)  # type: ignore[assignment]
    score = asyncio.run(held.evaluate())
    assert score.accuracy == 1.0 and score.greedy == 1.0  # every answer "v0": the sub-agent ran on the pin
    with pytest.raises(ValueError, match="pinned to version 2"):
        HeldOut(msgspec.structs.replace(plan, subagent_pool_replicas=1, subagent_pin_version=2), tmp_path / "model")


def test_the_probe_answers_with_the_candidate_when_nothing_is_frozen() -> None:
    """The probe's sanity: with one engine for every agent the answer names that engine's version."""
    from slipstream.harness.evaluate import evaluate

    probe = Probe()
    tasks = probe.generate("heldout", 2, seed=0)
    report = asyncio.run(evaluate(says_version(CANDIDATE), TOK, probe, tasks))
    assert report.accuracy == 0.0 and report.frozen_versions == [CANDIDATE]
    report = asyncio.run(evaluate(says_version(CANDIDATE), TOK, probe, tasks, frozen_engine=says_version(PIN)))
    assert report.accuracy == 1.0 and report.frozen_versions == [PIN] and report.policy_versions == [CANDIDATE]
