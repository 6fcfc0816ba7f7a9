"""The eval gate plays a summary-chain env with the run's `[rollout.summary]`, as training does.

The run's summary settings reach every service as SLIPSTREAM_SUMMARY__* variables (libs/run
`run_env`); the gate reads them into its `[summary]` section, plays the suite with them and keys
its fingerprint on them. The policy is the `recall` env's scripted expert (it reads only what is
in its context), so what it answers shows which context mode the gate used.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from slipstream.engine import ByteTokenizer
from slipstream.envs import get_env
from slipstream.envs.recall import SUMMARY_REQUEST, SUMMARY_RESTART
from slipstream.eval_gate.config import EvalGateConfig, GateSection
from slipstream.eval_gate.evaluator import Evaluator
from slipstream.eval_gate.suite import EvalDetails, Suite
from slipstream.harness import SummaryConfig
from slipstream.run.plan import TrainingPlan, run_env
from slipstream.runtime.config import resolve
from slipstream.store import LocalObjectStore
from slipstream.supervised import ScriptedEngine

pytestmark = pytest.mark.unit

TOK = ByteTokenizer()
SUMMARY = {
    "enabled": True,
    "min_tokens": 56,
    "max_tokens": 80,
    "summary_tokens": 24,
    "request": SUMMARY_REQUEST,
    "restart_template": SUMMARY_RESTART,
}


def gate_config(summary: dict[str, object]) -> EvalGateConfig:
    """The gate's config as the stack resolves it from the run's environment variables."""
    plan = TrainingPlan(env="recall", summary=summary)
    return resolve(EvalGateConfig, environ=run_env(plan), overrides={"gate": {"suite_size": 24, "max_batch": 8}})


def judge(cfg: EvalGateConfig, tmp_path: Path) -> EvalDetails:
    env = get_env("recall")
    suite = Suite(cfg.gate, cfg.summary)
    # The expert answers from its context alone (the task only seeds a drop rate, 0 here).
    task = suite.tasks["recall"][0]
    engine = ScriptedEngine(TOK, lambda _, context: env.expert(task, context))
    engine.max_batch = 8  # type: ignore[attr-defined]  # what the evaluator sizes its concurrency by
    evaluator = Evaluator(engine, TOK, suite, LocalObjectStore(tmp_path), "r1")  # type: ignore[arg-type]
    return asyncio.run(evaluator._rollouts(0))


def test_the_gate_reads_the_runs_summary_settings() -> None:
    cfg = gate_config({**SUMMARY, "mode": "truncate"})
    assert cfg.gate.envs == ["recall"]
    assert cfg.summary.enabled and cfg.summary.mode == "truncate"
    assert (cfg.summary.min_tokens, cfg.summary.max_tokens, cfg.summary.summary_tokens) == (56, 80, 24)
    assert cfg.summary.request == SUMMARY_REQUEST and cfg.summary.restart_template == SUMMARY_RESTART
    assert not gate_config({}).summary.enabled


def test_the_fingerprint_changes_with_the_summary_settings_only_when_they_are_on() -> None:
    plain = Suite(GateSection(envs=["recall"], suite_size=4))
    assert Suite(GateSection(envs=["recall"], suite_size=4), SummaryConfig()).fingerprint == plain.fingerprint
    summarised = Suite(GateSection(envs=["recall"], suite_size=4), SummaryConfig(**SUMMARY))  # type: ignore[arg-type]
    truncated = Suite(
        GateSection(envs=["recall"], suite_size=4),
        SummaryConfig(**{**SUMMARY, "mode": "truncate"}),  # type: ignore[arg-type]
    )
    assert len({plain.fingerprint, summarised.fingerprint, truncated.fingerprint}) == 3


def test_the_gate_plays_the_suite_with_the_runs_context_restarts(tmp_path: Path) -> None:
    full = judge(gate_config({}), tmp_path / "a")
    summarised = judge(gate_config({**SUMMARY, "mode": "summary"}), tmp_path / "b")
    truncated = judge(gate_config({**SUMMARY, "mode": "truncate"}), tmp_path / "c")
    # Without restarts nothing is cut; the expert's summaries carry the fact; truncation loses most facts.
    assert full.envs["recall"].restarts_per_episode == 0.0 and full.score > 0.99
    assert summarised.envs["recall"].restarts_per_episode >= 1.0
    assert summarised.envs["recall"].accuracy == 1.0
    assert truncated.envs["recall"].restarts_per_episode >= 1.0
    assert truncated.envs["recall"].accuracy < 0.7
    assert len({full.fingerprint, summarised.fingerprint, truncated.fingerprint}) == 3
