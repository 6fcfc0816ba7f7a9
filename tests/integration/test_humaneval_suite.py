"""HumanEval as an eval suite through the code env's harness: the gate reports it, the demo's held-out
evaluation reports its pass@1 sampled and greedy; neither trains on it nor decides a promotion by it.

Policies: the envs' scripted experts (HumanEval's canonical solutions, the bugfix fix) and the
untrained tiny model; every episode runs in real bubblewrap sandboxes and is graded in fresh ones.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from slipstream.engine import ByteTokenizer
from slipstream.engine.interface import GenerationRequest
from slipstream.envs import TaskSpec, get_env
from slipstream.eval_gate.config import EvalGateConfig
from slipstream.eval_gate.evaluator import Evaluator
from slipstream.eval_gate.suite import EvalDetails, Suite
from slipstream.run.plan import TrainingPlan, run_env
from slipstream.runtime.config import resolve
from slipstream.sandbox import cgroups
from slipstream.store import LocalObjectStore
from slipstream.supervised import ScriptedEngine

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(cgroups.available() is not None, reason=f"no cgroups here: {cgroups.available()}"),
]

TOK = ByteTokenizer()


def test_humaneval_is_an_eval_suite_of_its_problems_in_order() -> None:
    env = get_env("humaneval")
    tasks = env.generate("heldout", 5, seed=0)
    assert [t.metadata["key"] for t in tasks] == [f"humaneval:{i}" for i in range(5)]
    assert [t.task_id for t in tasks] == [f"humaneval-heldout-{i}" for i in range(5)]
    everything = env.generate("heldout", 164, seed=3)  # the whole suite; any seed, the same problems
    assert len(everything) == 164 and [t.prompt for t in everything[:5]] == [t.prompt for t in tasks]
    with pytest.raises(ValueError, match="eval suite"):
        env.generate("train", 1, seed=0)
    with pytest.raises(ValueError, match="164 problems"):
        env.generate("heldout", 165, seed=0)
    assert get_env("code", source="humaneval").split_of("humaneval:7") == "heldout"


def experts(suite: Suite, *, solve: bool) -> ScriptedEngine:
    """Every env's scripted expert (or a policy that stops at once), found by the task's prompt."""
    tasks: list[tuple[TaskSpec, object]] = [(t, suite.envs[n]) for n, ts in suite.tasks.items() for t in ts]

    def reply(_: GenerationRequest, context: str) -> str:
        if not solve:
            return "done\n"
        task, env = next((t, e) for t, e in tasks if context.startswith(t.prompt))
        return env.expert(task, context)  # type: ignore[attr-defined, no-any-return]

    engine = ScriptedEngine(TOK, reply, max_seq_len=8192)
    engine.max_batch = 8  # type: ignore[attr-defined]  # what the evaluator sizes its concurrency by
    return engine


def judge(cfg: EvalGateConfig, tmp_path: Path, *, solve: bool) -> EvalDetails:
    suite = Suite(cfg.gate, cfg.summary)
    evaluator = Evaluator(experts(suite, solve=solve), TOK, suite, LocalObjectStore(tmp_path), "r1")  # type: ignore[arg-type]
    return asyncio.run(evaluator._rollouts(0))


def test_the_gate_reports_humaneval_beside_the_runs_env_without_deciding_by_it(tmp_path: Path) -> None:
    plan = TrainingPlan(env="code", eval_suites={"humaneval": 4})
    environ = run_env(plan)
    assert json.loads(environ["SLIPSTREAM_GATE__ENVS"]) == ["code", "humaneval"]
    cfg = resolve(EvalGateConfig, environ=environ, overrides={"gate": {"suite_size": 3}})
    assert cfg.gate.report_only == ["humaneval"] and cfg.gate.size_of("humaneval") == 4
    solved = judge(cfg, tmp_path / "a", solve=True)
    # HumanEval's pass@1 is reported (the canonical solutions pass every problem's own check) ...
    assert solved.envs["humaneval"].tasks == 4 and solved.envs["humaneval"].accuracy == 1.0
    assert solved.envs["code"].accuracy == 1.0
    # ... but the decision pairs only the run's env's tasks.
    assert [t.env for t in solved.tasks] == ["code"] * 3
    idle = judge(cfg, tmp_path / "b", solve=False)
    assert idle.envs["humaneval"].accuracy == 0.0 and idle.envs["code"].accuracy == 0.0
    assert idle.fingerprint == solved.fingerprint and len(idle.tasks) == 3


def test_the_held_out_evaluation_reports_humaneval_pass_at_1_sampled_and_greedy(tmp_path: Path) -> None:
    from slipstream.engine import build_tiny, save_pretrained
    from slipstream.run.heldout import HeldOut

    model, tokenizer = build_tiny("micro", seed=0)
    save_pretrained(model, tokenizer, tmp_path / "model")
    plan = TrainingPlan(env="arith", heldout_tasks=4, heldout_samples=1, eval_suites={"humaneval": 2}, temperature=1.0)

    async def run() -> dict[str, dict[str, float]]:
        held = HeldOut(plan, tmp_path / "model")
        await held.start()
        try:
            score = await held.evaluate()
        finally:
            await held.stop()
        assert {"humaneval/pass@1_sampled", "humaneval/pass@1_greedy"} <= set(score.row(0))
        return score.suites

    suites = asyncio.run(run())
    figures = suites["humaneval"]
    assert figures["tasks"] == 2.0
    # An untrained model solves nothing: the suite reports its pass rate, whatever it is.
    assert figures["pass@1_sampled"] == 0.0 and figures["pass@1_greedy"] == 0.0
